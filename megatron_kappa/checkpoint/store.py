"""Atomic, resumable checkpoints that store every weight once and load into any layout.

Layout: <run.dir>/checkpoints/step_<N>/ (published by one rename once every rank has written),
<run.dir>/checkpoints/latest (written to a temp name, then renamed). A kill at any moment leaves
the previous checkpoint untouched; half-written ones live under checkpoints/.tmp/ and are ignored.

What is stored (format 2): one file per rank, rank_<r>.pt, with
  - "weights": the parameters and buffers this rank *owns* (dense ones on data-parallel rank 0,
    expert ones on expert-data-parallel rank 0: each weight once; sharding.owned_state), and
    "coords", where its tensors sit in the full layout;
  - "optimizer": for the same owned parameters, ZeRO's fp32 master copy and the optimizer's
    moments (AdamW's exp_avg/exp_avg_sq, Muon's momentum) shaped like the weights, and
    "optimizer_steps" (checkpoint/optimizer_state.py);
  - "rng": the rank's random states (restored when the layout is unchanged).
Nothing in it depends on ZeRO's flat partitions, so `load` restores a checkpoint into any TP, EP,
ETP, PP, DP layout, world size and ZeRO stage: the full tensors are assembled from the owners'
files (sharding.consolidate; each file is memory-mapped) and each rank takes its fragments.
Format 1 checkpoints (earlier versions: DeepSpeed's ZeRO files beside rank files without the
optimizer) still load, in the layout that wrote them.
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

from megatron_kappa.checkpoint import optimizer_state
from megatron_kappa.checkpoint.listing import (
    CheckpointDir,
    CheckpointSaveError,
    atomic_write_text,
    file_checksum,
    write_failure,
)
from megatron_kappa.parallel import sharding

FORMAT = 2  # meta.json "format": 2 = parameter-shaped optimizer state (any layout); absent = 1


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


def _gather_failures(mine: str | None, group=None) -> str | None:
    """The first failing rank's message, the same on every rank (None when all succeeded)."""
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return next((m for m in every if m), None)


class Checkpoints(CheckpointDir):
    """The checkpoints of a run: the listing, plus saving and loading through a DeepSpeed engine."""

    def rank_files(self, step: int, map_location="cpu") -> list[dict]:
        """Every rank's file of a checkpoint (offline; no process group needed), memory-mapped:
        a tensor is read from disk only when used."""
        world = self.meta(step)["layout"]["world"]
        return [torch.load(self.folder(step) / f"rank_{r}.pt", map_location=map_location,
                           weights_only=False, mmap=True) for r in range(world)]

    def weights(self, step: int, wanted=None) -> dict:
        """The full (one-process layout) weights and buffers of checkpoint `step`, assembled offline
        from every rank's file (no process group needed). `wanted`: a set of full names or a
        predicate on them; only those are read (the files are memory-mapped and opened once per
        step, so a caller can assemble a large model a layer at a time)."""
        cached = getattr(self, "_opened", None)
        if cached is None or cached[0] != step:
            self._opened = cached = (step, self.rank_files(step))
        return sharding.consolidate([(f["coords"], f["weights"]) for f in cached[1]], wanted)

    def rank_weights(self, step: int, rank: int) -> dict:
        """The weights and buffers of `rank` in the layout that wrote checkpoint `step`, collected
        from their owners' files."""
        files = self.rank_files(step)
        return sharding.local_state([(f["coords"], f["weights"]) for f in files], files[rank]["coords"])

    def rank_state(self, engine, model, device: torch.device) -> dict:
        """What this rank's file holds (collective: the optimizer state's all-reduces). The
        "weights" are the live parameters (detached, not copied); "optimizer" is made afresh."""
        moments, steps = optimizer_state.by_parameter(engine, model)
        return {"rng": rng_state(device), "coords": sharding.rank_coords(model),
                "weights": sharding.owned_state(model), "optimizer": moments, "optimizer_steps": steps}

    def save(self, engine, model, step: int, meta: dict, device: torch.device):
        """Checkpoint `step` of `model` trained by `engine` (collective: every rank calls it)."""
        self._write(step, {**meta, "format": FORMAT}, self.rank_state(engine, model, device))

    def _write(self, step: int, meta: dict, rank_state: dict, group=None):
        """Write checkpoint `step`: every rank's files into checkpoints/.tmp/step_<N>, each rank's
        checksum of its own file, then rank 0 records every file's size and checksum in meta.json
        (what `verify` checks) and moves it in place. A
        failure on any rank (no space, an I/O error) removes the partial files, leaves the previous
        checkpoint the latest and raises CheckpointSaveError (one line) on every rank. `group`: the
        process group the ranks agree on (checkpoint.async_save: a gloo group of its own, as this
        runs in a background thread beside the training's collectives)."""
        rank = dist.get_rank(group)
        tag = f"step_{step}"
        staging = self.tmp / tag

        def stage(part):
            try:
                part()
            except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
                return f"rank {rank}: {write_failure(e, self.root)}"
            except Exception as e:  # anything else too: a rank that raised alone would leave the others waiting
                return f"rank {rank}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            return None

        def rank0(part):
            return stage(part) if rank == 0 else None

        def prepare():
            shutil.rmtree(staging, ignore_errors=True)  # leftovers of a killed save
            staging.mkdir(parents=True)

        sums = {}

        def write_own():
            torch.save(rank_state, staging / f"rank_{rank}.pt.tmp")
            os.replace(staging / f"rank_{rank}.pt.tmp", staging / f"rank_{rank}.pt")
            sums[f"rank_{rank}.pt"] = file_checksum(staging / f"rank_{rank}.pt")  # read back from the page cache

        def gather_sums():
            every = [None] * dist.get_world_size(group)
            dist.all_gather_object(every, sums, group=group)
            sums.update({k: v for part in every for k, v in part.items()})

        def publish():
            files = self.record_files(staging)
            atomic_write_text(staging / "meta.json", json.dumps(
                {**meta, "step": step, "files": files, "checksums": dict(sorted(sums.items()))}, indent=1))
            final = self.folder(step)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
            atomic_write_text(self.root / "latest", tag + "\n")
            self.set_aside_damaged()  # never kept in place of a good one
            for old in self.complete()[:-self.keep]:
                if old not in getattr(self, "protected", ()):  # a Hugging Face export reads it (hf_exports.py)
                    shutil.rmtree(self.folder(old), ignore_errors=True)

        for part in (lambda: rank0(prepare), lambda: stage(write_own), lambda: gather_sums(), lambda: rank0(publish)):
            failed = _gather_failures(part(), group)
            if failed:
                if rank == 0:
                    shutil.rmtree(staging, ignore_errors=True)
                previous = self.latest(warn=lambda message: None, content=False)
                raise CheckpointSaveError(
                    f"checkpoint {self.folder(step)}: saving failed ({failed}); its partial files are removed, "
                    + (f"the latest checkpoint is still {self.folder(previous)}" if previous else "no checkpoint "
                       "exists yet"))

    def load(self, engine, model, step: int, device: torch.device, same_layout: bool):
        """Restore checkpoint `step` into `model` and `engine` (collective): the weights and
        buffers, ZeRO's fp32 master copy and the optimizer state, in this run's layout whatever
        the checkpoint's; the random states too when `same_layout`."""
        if self.meta(step).get("format", 1) < FORMAT:
            self._load_format1(engine, model, step, device)
            return
        files = self.rank_files(step)  # memory-mapped: only the pieces this rank's tensors need are read
        coords, wanted = [f["coords"] for f in files], sharding.full_names(model)
        sharding.load_full_state_dict(model, sharding.consolidate(list(zip(coords, (f["weights"] for f in files))),
                                                                  wanted))
        kinds = sorted(set().union(*(f["optimizer"].keys() for f in files)))
        full = {k: sharding.consolidate([(c, f["optimizer"].get(k, {})) for c, f in zip(coords, files)], wanted)
                for k in kinds}
        steps = {n: v for f in files for n, v in f["optimizer_steps"].items()}
        optimizer_state.restore(engine, model, full, steps)
        if same_layout:
            set_rng_state(files[dist.get_rank()]["rng"], device)

    def _load_format1(self, engine, model, step: int, device: torch.device):
        """A checkpoint of format 1 (DeepSpeed's ZeRO files; its own layout only)."""
        tag = f"step_{step}"
        with _deepspeed_without_module_copy(engine):
            path, _ = engine.load_checkpoint(str(self.root), tag=tag, load_optimizer_states=True,
                                             load_lr_scheduler_states=False, load_module_strict=False)
        if path is None:
            raise RuntimeError(f"checkpoint {self.folder(step)}: DeepSpeed could not load it")
        # ZeRO copies its fp32 partitions back into the model only at the next step; without this
        # the first resumed forward would use the weights the engine was built with.
        engine.optimizer.update_lp_params()
        saved = torch.load(self.folder(step) / f"rank_{dist.get_rank()}.pt", map_location=device, weights_only=False)
        model.load_state_dict(saved["buffers"], strict=False)
        set_rng_state(saved["rng"], device)
