"""The quick CORE subset the paper's pipeline logged during training (`eval.core_every`)."""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps

from megatron_kappa.config import Config
from megatron_kappa.evaluation.core import core_metrics, evaluate_core, load_bundle
from megatron_kappa.evaluation.loading import logits_fn_for
from megatron_kappa.tokenizer import Tokenizer


class CoreSubset:
    """Scores `eval.core_max_per_task` items per task of `eval.core_bundle` with the training
    model; the preflight has checked that the bundle and the tokenizer are there and readable."""

    def __init__(self, cfg: Config, engine, device: torch.device):
        self.cfg, self.engine = cfg, engine
        self.bundle = load_bundle(cfg.eval.core_bundle)
        self.tokenizer = Tokenizer(cfg.data.tokenizer)
        self.logits_fn = logits_fn_for(engine.module, cfg.model.vocab_size, bool(cfg.data.bos))
        self.device = device

    def evaluate(self) -> dict:
        self.engine.eval()
        with torch.no_grad():
            result = evaluate_core(self.logits_fn, self.tokenizer, self.bundle, self.cfg.model.seq_length,
                                   max_per_task=self.cfg.eval.core_max_per_task, progress=False,
                                   dp_rank=ps.get_data_parallel_rank(),
                                   dp_world=ps.get_data_parallel_world_size(), device=self.device)
        self.engine.train()
        return core_metrics(result)
