"""Atomic, resumable checkpoints that store every weight once.

Layout: <run.dir>/checkpoints/step_<N>/ (published by one rename once every rank has written),
<run.dir>/checkpoints/latest (written to a temp name, then renamed). A kill at any moment leaves
the previous checkpoint untouched; half-written ones live under checkpoints/.tmp/ and are ignored.

What is stored, and where:
  - DeepSpeed's ZeRO files: the optimizer state, including ZeRO's fp32 master copy of every
    parameter (partitioned over the data-parallel ranks). Resume restores the weights from that
    master copy (`update_lp_params`), so DeepSpeed's own module file is written empty: with
    megatron experts it would hold only DP-rank 0's experts anyway, and a second copy of the
    dense weights.
  - rank_<r>.pt per rank: RNG states, where the rank's tensors sit in the full layout (coords),
    its buffers (e.g. the router's expert bias), and the parameters this rank *owns*: dense ones on
    data-parallel rank 0, expert ones on expert-data-parallel rank 0 — each weight once
    (megatron_kappa.parallel.sharding.owned_parameters). Evaluation and consolidation read those.
DeepSpeed's MoE checkpoint path expects its native experts, hence `has_moe_layers` is off around
save/load (the experts are megatron's; see megatron_kappa.parallel.engine).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megatron_kappa.checkpoint.listing import CheckpointDir, CheckpointSaveError, atomic_write_text


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


@contextlib.contextmanager
def _deepspeed_without_module_copy(engine):
    """DeepSpeed's save/load with native MoE off and no module weights in its files (ours and
    ZeRO's fp32 master copy hold them)."""
    saved = engine.has_moe_layers
    engine.has_moe_layers = False
    engine.module_state_dict = lambda *args, **kwargs: {}  # instance attribute: this engine only
    try:
        yield
    finally:
        engine.has_moe_layers = saved
        del engine.module_state_dict


def _gather_failures(mine: str | None) -> str | None:
    """The first failing rank's message, the same on every rank (None when all succeeded)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return next((m for m in every if m), None)


class Checkpoints(CheckpointDir):
    """The checkpoints of a run: the listing, plus saving and loading through a DeepSpeed engine."""

    def rank_files(self, step: int, map_location="cpu") -> list[dict]:
        """Every rank's file of a checkpoint (offline; no process group needed)."""
        world = self.meta(step)["layout"]["world"]
        return [torch.load(self.folder(step) / f"rank_{r}.pt", map_location=map_location,
                           weights_only=False) for r in range(world)]

    def save(self, engine, step: int, meta: dict, rank_state: dict):
        """Write checkpoint `step`: every rank's files into checkpoints/.tmp/step_<N>, then rank 0
        records every file's size in meta.json (what `verify` checks) and moves it in place. A
        failure on any rank (no space, an I/O error) removes the partial files, leaves the previous
        checkpoint the latest and raises CheckpointSaveError (one line) on every rank."""
        rank = dist.get_rank()
        tag = f"step_{step}"
        staging = self.tmp / tag

        def stage(part):
            try:
                part()
            except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
                return f"rank {rank}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            return None

        def rank0(part):
            return stage(part) if rank == 0 else None

        def prepare():
            shutil.rmtree(staging, ignore_errors=True)  # leftovers of a killed save
            staging.mkdir(parents=True)

        def write_own():
            with _deepspeed_without_module_copy(engine):
                engine.save_checkpoint(str(self.tmp), tag=tag, save_latest=False)
            torch.save(rank_state, staging / f"rank_{rank}.pt.tmp")
            os.replace(staging / f"rank_{rank}.pt.tmp", staging / f"rank_{rank}.pt")

        def publish():
            files = self.record_files(staging)
            atomic_write_text(staging / "meta.json", json.dumps({**meta, "step": step, "files": files}, indent=1))
            final = self.folder(step)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
            atomic_write_text(self.root / "latest", tag + "\n")
            self.set_aside_damaged()  # never kept in place of a good one
            for old in self.complete()[:-self.keep]:
                shutil.rmtree(self.folder(old), ignore_errors=True)

        for part in (lambda: rank0(prepare), lambda: stage(write_own), lambda: rank0(publish)):
            failed = _gather_failures(part())
            if failed:
                if rank == 0:
                    shutil.rmtree(staging, ignore_errors=True)
                previous = self.latest(warn=lambda message: None)
                raise CheckpointSaveError(
                    f"checkpoint {self.folder(step)}: saving failed ({failed}); its partial files are removed, "
                    + (f"the latest checkpoint is still {self.folder(previous)}" if previous else "no checkpoint exists yet"))

    def load(self, engine, step: int, device: torch.device) -> dict:
        """Restore the engine (ZeRO optimizer state and, from its fp32 master copy, the weights);
        returns this rank's own file."""
        tag = f"step_{step}"
        with _deepspeed_without_module_copy(engine):
            path, _ = engine.load_checkpoint(str(self.root), tag=tag, load_optimizer_states=True,
                                             load_lr_scheduler_states=False, load_module_strict=False)
        if path is None:
            raise RuntimeError(f"checkpoint {self.folder(step)}: DeepSpeed could not load it")
        # ZeRO copies its fp32 partitions back into the model only at the next step; without this
        # the first resumed forward would use the weights the engine was built with.
        engine.optimizer.update_lp_params()
        return torch.load(self.folder(step) / f"rank_{dist.get_rank()}.pt", map_location=device,
                          weights_only=False)
