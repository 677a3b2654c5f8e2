"""A trained checkpoint as a plain logits function, for evaluation.

`load_for_eval(run_dir)` rebuilds the model from the run's config.yaml and loads the latest
checkpoint: under the training layout (same world size, e.g. `deepspeed eval/core.py ...`) each
rank loads its own weights; otherwise (e.g. one process) the full weights are consolidated from
every rank's file and loaded into a layout without model parallelism.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_kappa.checkpoint import Checkpoints
from megatron_kappa.config import ConfigError, ParallelConfig, load_config
from megatron_kappa.model import build_model, moe_layer_pattern
from megatron_kappa.parallel import init_distributed
from megatron_kappa.sharding import consolidate, load_full_state_dict


def logits_fn_for(model, vocab_size: int | None = None):
    """tokens [B, T] → full-vocabulary logits [B, T, V] (TP-gathered, vocab padding cut off)."""
    tp = ps.get_tensor_model_parallel_world_size()
    vocab = vocab_size or model.vocab_size

    def logits_fn(tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        pad = (-length) % tp  # sequence parallelism splits the sequence over TP
        if pad:
            tokens = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], pad)], dim=1)
        position = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits = model(tokens, position, None)
        if tp > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
        return logits[:, :length, :vocab].float()

    return logits_fn


def load_for_eval(run_dir: str | Path):
    """(logits_fn, tokenizer, max_seq_len) of the latest checkpoint in `run_dir`."""
    from megatron_kappa.tokenizer import Tokenizer

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"checkpoint: {run_dir}: no config.yaml (expected a training run directory)")
    cfg = load_config(run_dir / "config.yaml")
    ckpts = Checkpoints(run_dir, keep=1)
    step = ckpts.latest()
    if step is None:
        raise ConfigError(f"checkpoint: {ckpts.root}: no complete checkpoint")
    if not cfg.data.tokenizer:
        raise ConfigError(f"checkpoint: {run_dir}/config.yaml: data.tokenizer is not set")
    trained = ckpts.meta(step)["layout"]
    world = int(os.environ.get("WORLD_SIZE", "1")) if not dist.is_initialized() else dist.get_world_size()
    same_layout = world == trained["world"]
    par = cfg.parallel if same_layout else ParallelConfig()
    num_experts = cfg.model.moe.num_experts if any(moe_layer_pattern(cfg)) else None
    init_distributed(par, cfg.train.seed, num_experts)
    cfg.parallel = par
    model = build_model(cfg)
    if same_layout:
        state = torch.load(ckpts.root / f"step_{step}" / f"rank_{dist.get_rank()}.pt", weights_only=False)
        model.load_state_dict(state["model"], strict=True)
    else:
        load_full_state_dict(model, consolidated_state(run_dir))
    model.eval()
    return logits_fn_for(model, cfg.model.vocab_size), Tokenizer(cfg.data.tokenizer), cfg.model.seq_length


def consolidated_state(run_dir: str | Path) -> dict:
    """The full (single-process layout) weights of the latest checkpoint in `run_dir`, assembled
    offline from every rank's file; no process group needed."""
    ckpts = Checkpoints(run_dir, keep=1)
    step = ckpts.latest()
    if step is None:
        raise ConfigError(f"checkpoint: {ckpts.root}: no complete checkpoint")
    folder, world = ckpts.root / f"step_{step}", ckpts.meta(step)["layout"]["world"]
    files = [torch.load(folder / f"rank_{r}.pt", weights_only=False) for r in range(world)]
    return consolidate([(f["coords"], f["model"]) for f in files])
