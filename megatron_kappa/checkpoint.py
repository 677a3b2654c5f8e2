"""Atomic, resumable checkpoints: DeepSpeed's engine checkpoint + a small per-rank file.

Layout: <run.dir>/checkpoints/step_<N>/ (published by one rename once every rank has written),
<run.dir>/checkpoints/latest (written to a temp name, then renamed). A kill at any moment leaves
the previous checkpoint untouched; half-written ones live under checkpoints/.tmp/ and are ignored.

DeepSpeed writes the model file from DP-rank 0 only, which holds only that rank's experts;
ZeRO's fp32 partitions are right on every rank, so after loading we refresh the model's weights
from them (`update_lp_params`, notes/deepspeed-on-cpu.md §7). DeepSpeed's own MoE checkpoint path
expects its native experts, hence `has_moe_layers` is off around save/load.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker


def _atomic_write_text(path: Path, text: str):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "tracker": get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    get_cuda_rng_tracker().set_states(state["tracker"])


@contextlib.contextmanager
def _without_native_moe(engine):
    saved = engine.has_moe_layers
    engine.has_moe_layers = False
    try:
        yield
    finally:
        engine.has_moe_layers = saved


class Checkpoints:
    def __init__(self, run_dir: str | Path, keep: int):
        self.root = Path(run_dir) / "checkpoints"
        self.tmp = self.root / ".tmp"
        self.keep = keep

    def complete(self) -> list[int]:
        """Steps of the fully written checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(int(d.name[5:]) for d in self.root.glob("step_*")
                      if d.name[5:].isdigit() and (d / "meta.json").is_file())

    def latest(self) -> int | None:
        done = self.complete()
        return done[-1] if done else None

    def meta(self, step: int) -> dict:
        return json.loads((self.root / f"step_{step}" / "meta.json").read_text())

    def save(self, engine, step: int, meta: dict, rank_state: dict):
        rank = dist.get_rank()
        tag = f"step_{step}"
        staging = self.tmp / tag
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # leftovers of a killed save
            staging.mkdir(parents=True)
        dist.barrier()
        with _without_native_moe(engine):
            engine.save_checkpoint(str(self.tmp), tag=tag, save_latest=False)
        torch.save(rank_state, staging / f"rank_{rank}.pt.tmp")
        os.replace(staging / f"rank_{rank}.pt.tmp", staging / f"rank_{rank}.pt")
        dist.barrier()
        if rank == 0:
            (staging / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=1))
            final = self.root / tag
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
            _atomic_write_text(self.root / "latest", tag + "\n")
            for old in self.complete()[:-self.keep]:
                shutil.rmtree(self.root / f"step_{old}", ignore_errors=True)
        dist.barrier()

    def load(self, engine, step: int) -> dict:
        """Restore engine (weights, ZeRO optimizer state); returns this rank's saved state."""
        tag = f"step_{step}"
        with _without_native_moe(engine):
            path, _ = engine.load_checkpoint(str(self.root), tag=tag, load_optimizer_states=True,
                                             load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"checkpoint {self.root / tag}: DeepSpeed could not load it")
        engine.optimizer.update_lp_params()
        return torch.load(self.root / tag / f"rank_{dist.get_rank()}.pt", weights_only=False)
