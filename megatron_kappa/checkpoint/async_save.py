"""Checkpoints that do not stop training (checkpoint.async_save).

At a checkpoint step every rank takes what it saves (checkpoint/store.py's `rank_state`: the
optimizer state's all-reduces run here, on the training's groups, as in a synchronous save) and
makes it its own: on CPU the weights are copied (the optimizer state is built afresh by
`by_parameter`, so nothing else aliases what the next step changes); on a GPU every tensor goes
into pinned host buffers kept from save to save, copied on a side stream that the training's
stream waits for, so the host does not wait for the copy. The rank then returns to training and a
background thread serializes, writes and checksums its file and publishes the checkpoint through
the same `Checkpoints._write` as a synchronous save: the ranks agree (each file written and its
CRC-32 read back, then rank 0's rename and `latest`) on a gloo process group of their own, never
on the training's groups or stream. So a checkpoint is visible only once whole, a failure on any
rank leaves the previous one `latest` on every rank, and `checkpoint.keep` removes old ones only
at that commit (never the newest committed one while a newer save is being written).

A thread, not a process: the snapshot is already in this process's memory, where a writer process
would need it copied again (shared memory or a pipe) before writing; torch.save's file writes and
zlib's CRC-32 release the GIL (the overlapped steps' slowdown: bench/checkpoint_async.py,
docs/benchmarks.md).

At most one save is in flight: a checkpoint step that finds the previous one still writing waits
for it and says how long. `finish()` (the run's end, a preemption signal or Ctrl-C, a divergence
stop) waits for the save in flight; a failed one raises CheckpointSaveError, one line, on every
rank alike (they agreed on it). A process that dies (kill -9) leaves only checkpoints/.tmp/, which
the next save removes.
"""
from __future__ import annotations

import copy
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_kappa.checkpoint.listing import CheckpointSaveError
from megatron_kappa.checkpoint.store import FORMAT, Checkpoints


class SyncSaver:
    """checkpoint.async_save false: the save is written before the next step."""

    def __init__(self, ckpts: Checkpoints, exports=None):
        self.ckpts, self.exports = ckpts, exports  # exports: rank 0's HfExports (checkpoint.hf_every), or None

    def save(self, engine, model, step: int, meta: dict, device: torch.device):
        self.ckpts.save(engine, model, step, meta, device)
        if self.exports is not None:
            self.exports.committed(step)

    def finish(self, exports: bool = True):
        """The run ends; `exports`: wait for the Hugging Face exports too (not on a stop signal,
        whose grace period they need not fit: a process of their own, they go on)."""
        if exports and self.exports is not None:
            self.exports.finish()


class AsyncSaver:
    """checkpoint.async_save true: one background save at a time (collective: every rank makes one)."""

    def __init__(self, ckpts: Checkpoints, timeout_s: float, log=print, exports=None):
        self.ckpts, self.log, self.exports = ckpts, log, exports
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.pinned: dict = {}  # GPU: key path → pinned host buffer, reused by every save
        self.stream = None
        self.thread: threading.Thread | None = None
        self.step: int | None = None  # the save in flight (or the last one)
        self.error: BaseException | None = None

    def save(self, engine, model, step: int, meta: dict, device: torch.device):
        self.wait(f"step {step}")
        state = self.ckpts.rank_state(engine, model, device)
        ready = None
        if device.type == "cuda":
            state, ready = self._to_pinned(state)
        else:
            state = self._copy(state)
        self.step, self.error = step, None
        self.thread = threading.Thread(target=self._write, args=(step, {**meta, "format": FORMAT}, state, ready),
                                       name=f"checkpoint-step-{step}", daemon=True)  # never holds the exit up
        self.thread.start()

    def _write(self, step: int, meta: dict, state: dict, ready):
        try:
            if ready is not None:
                ready.synchronize()  # the copies into the pinned buffers are done
            self.ckpts._write(step, meta, state, group=self.group)
            if self.exports is not None:
                self.exports.committed(step)
        except BaseException as e:  # said by the training thread, at its next save or at the end
            self.error = e

    def wait(self, why: str = "the end"):
        """Wait for the save in flight; raise its failure."""
        if self.thread is not None and self.thread.is_alive():
            began = time.perf_counter()
            self.thread.join()
            self.log(f"checkpoint: {why} waited {time.perf_counter() - began:.2f} s for the save of step "
                     f"{self.step} to finish writing")
        self.thread = None
        error, self.error = self.error, None
        if isinstance(error, CheckpointSaveError):
            raise error
        if error is not None:  # _write agrees on its own failures; this is anything around it
            previous = self.ckpts.latest(warn=lambda message: None, content=False)
            raise CheckpointSaveError(
                f"checkpoint {self.ckpts.folder(self.step)}: the background save failed "
                f"({type(error).__name__}: {(str(error).splitlines() or [''])[0]}); "
                + (f"the latest checkpoint is still {self.ckpts.folder(previous)}" if previous
                   else "no checkpoint exists yet"))

    def finish(self, exports: bool = True):
        """The run ends (its last step, a stop signal, a divergence): the save in flight is written
        (and with `exports` the Hugging Face exports started)."""
        self.wait()
        if exports and self.exports is not None:
            self.exports.finish()

    @staticmethod
    def _copy(state: dict) -> dict:
        """CPU: the weights copied (they are the live parameters); the optimizer state is new."""
        return {**state, "weights": {n: t.clone() for n, t in state["weights"].items()},
                "rng": copy.deepcopy(state["rng"])}

    def _to_pinned(self, state: dict):
        """`state` with every device tensor copied into its pinned host buffer, on a side stream
        that the training's stream waits for (GPU order, no host wait); returns the copies' event."""
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        training = torch.cuda.current_stream()
        self.stream.wait_stream(training)

        def host(value, key):
            if isinstance(value, dict):
                return {k: host(v, (*key, k)) for k, v in value.items()}
            if not (torch.is_tensor(value) and value.is_cuda):
                return copy.deepcopy(value)
            buf = self.pinned.get(key)
            if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                buf = self.pinned[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            value.record_stream(self.stream)  # the allocator keeps it until the copy has read it
            buf.copy_(value, non_blocking=True)
            return buf

        with torch.cuda.stream(self.stream):
            out = host(state, ())
            done = torch.cuda.Event()
            done.record(self.stream)
        training.wait_stream(self.stream)  # the next step's writes come after the copies
        return out, done


def saver(ckpts: Checkpoints, checkpoint, timeout_s: float, log=print, exports=None):
    """The run's saver for its `checkpoint` config section: SyncSaver, or AsyncSaver (collective to
    make: every rank calls it). `exports`: told each committed step (train/hf_exports.py), or None."""
    if checkpoint.async_save:
        return AsyncSaver(ckpts, timeout_s, log, exports)
    return SyncSaver(ckpts, exports)
