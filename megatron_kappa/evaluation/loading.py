"""A trained checkpoint as a plain logits function, for evaluation.

`load_for_eval(checkpoint, step)` rebuilds the model from the run's config.yaml on this process's
device and loads its latest checkpoint that verifies, or `step`'s, or the checkpoint folder given
(megatron_kappa.checkpoint.listing.locate: a step asked for is read or refused, never replaced).
Under the training layout (same world size, e.g. `deepspeed eval/core.py ...`) each rank loads
its own weights from their owners' files; otherwise (e.g. one process) the full weights are
consolidated from every rank's file and loaded into a layout without model parallelism.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_kappa.checkpoint.listing import locate, run_of
from megatron_kappa.checkpoint.store import Checkpoints
from megatron_kappa.config import ConfigError, ParallelConfig, load_recorded
from megatron_kappa.model.build import build_model
from megatron_kappa.model.layout import model_layout
from megatron_kappa.parallel.groups import init_distributed
from megatron_kappa.parallel.sharding import load_full_state_dict, load_local_state, read_full_state_dict


def logits_fn_for(model, vocab_size: int | None = None, bos: bool = True):
    """tokens [B, T] → full-vocabulary logits [B, T, V] (TP-gathered, vocab padding cut off).
    The function's `.device` is the model's: callers send their token batches there. Its `.bos`
    says whether the model was trained on documents that start with BOS (the run's data.bos):
    CORE puts BOS before its prompts exactly then."""
    tp = ps.get_tensor_model_parallel_world_size()
    vocab = vocab_size or model.vocab_size
    device = next(model.parameters()).device

    def logits_fn(tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.to(device)
        length = tokens.shape[1]
        pad = (-length) % tp  # sequence parallelism splits the sequence over TP
        if pad:
            tokens = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], pad)], dim=1)
        position = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
        logits = model(tokens, position, None)
        if tp > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
        return logits[:, :length, :vocab].float()

    logits_fn.device = device
    logits_fn.bos = bool(bos)
    return logits_fn


def load_for_eval(checkpoint: str | Path, step: int | None = None):
    """(logits_fn, tokenizer, max_seq_len) of a run's latest checkpoint (or `step`'s), or of one
    checkpoint folder."""
    from megatron_kappa.tokenizer import Tokenizer

    run_dir, step = locate(checkpoint, step)
    cfg = _run_config(run_dir)
    if not cfg.data.tokenizer:
        raise ConfigError(f"checkpoint: {run_dir}/config.yaml: data.tokenizer is not set")
    logits_fn, cfg = load_model_for_eval(run_dir, step)
    return logits_fn, Tokenizer(cfg.data.tokenizer), cfg.model.seq_length


def _run_config(run_dir: str | Path):
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"checkpoint: {run_dir}: no config.yaml (expected a training run directory)")
    cfg = load_recorded(run_dir / "config.yaml")
    if cfg.data.tokenizer and Path(cfg.data.tokenizer).is_file():  # replaced since the run was trained?
        from megatron_kappa.data.made_with import check_run_shards
        check_run_shards(cfg.data.tokenizer, cfg.data, f"checkpoint: {run_dir}/config.yaml: data.tokenizer")
    return cfg


def load_model_for_eval(checkpoint: str | Path, step: int | None = None):
    """(logits_fn, config) of a run's latest checkpoint (or `step`'s), on this process's device."""
    model, cfg = load_model(checkpoint, step=step)
    return logits_fn_for(model, cfg.model.vocab_size, cfg.data.bos), cfg


def load_model(checkpoint: str | Path, weights: str | Path | None = None, step: int | None = None):
    """(model in eval mode, config) of a run's latest checkpoint that verifies (or `step`'s, or
    the checkpoint folder `checkpoint`), on this process's device: in the training layout when
    this job has its world size (each rank reads its own weights), else consolidated into a layout
    without model parallelism. `weights`: a consolidated
    state dict (launch/consolidate.py) to load instead of the run's checkpoints. The config's
    data.bos is filled in (whether the documents started with BOS)."""
    trained = None
    if weights is None:
        run_dir, step = locate(checkpoint, step)
        ckpts = Checkpoints(run_dir, keep=1)
        trained = ckpts.meta(step)["layout"]
    elif step is not None:
        raise ConfigError(f"--step: {step}: a checkpoint's step, but --weights gives the weights; give one of them")
    else:
        run_dir = run_of(checkpoint)[0]  # the config's run
    cfg = _run_config(run_dir)
    if weights is not None and not Path(weights).is_file():
        raise ConfigError(f"--weights: {weights}: no such file (expected launch/consolidate.py's output)")
    world = int(os.environ.get("WORLD_SIZE", "1")) if not dist.is_initialized() else dist.get_world_size()
    # pipeline stages, context parallelism (its split sequences): evaluation runs the whole model
    # on whole prompts per rank, from the consolidated weights
    same_layout = (trained is not None and world == trained["world"] and trained.get("pp", 1) == 1
                   and trained.get("cp", 1) == 1)
    cfg.parallel = cfg.parallel if same_layout else ParallelConfig()
    layout = model_layout(cfg)
    device = init_distributed(cfg.parallel, cfg.train.seed, layout.experts)
    model = build_model(cfg, device, layout=layout)
    if same_layout:
        load_local_state(model, ckpts.rank_weights(step, dist.get_rank()))
    elif weights is None:
        load_full_state_dict(model, ckpts.weights(step))
    else:
        load_full_state_dict(model, read_full_state_dict(weights, "--weights"), source=f"--weights: {weights}")
    model.eval()  # also selects eval.capacity_factor (megatron_kappa.model.capacity)
    # Runs from before data.bos was recorded: the manifests beside their shards, else no BOS.
    from megatron_kappa.data.bos import documents_start_with_bos
    cfg.data.bos = documents_start_with_bos(cfg.data)
    return model, cfg


def consolidated_state(checkpoint: str | Path, step: int | None = None) -> dict:
    """The full (single-process layout) weights of a run's latest checkpoint that verifies (or
    `step`'s, or the checkpoint folder `checkpoint`), assembled offline from every rank's file; no
    process group needed. (Each file's checksum is read once per process: locating it again is cheap.)"""
    run_dir, step = locate(checkpoint, step, need_config=False)  # the weights alone: no model is built
    return Checkpoints(run_dir, keep=1).weights(step)
