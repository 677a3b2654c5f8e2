"""The profiler in training (`profile`): a torch.profiler trace of the chosen steps on the chosen
ranks, Megatron-style NVTX ranges on CUDA, and a CUDA memory snapshot on request.

`profile.steps: [a, b]` traces steps a to b (numbered as the step line numbers them, both included)
on the ranks of `profile.ranks` into <run.dir>/profile/rank<r>_steps<a>-<b>.pt.trace.json: Chrome's
trace format, which chrome://tracing, Perfetto and TensorBoard's profiler plugin
(`tensorboard --logdir <run.dir>/profile`) all open. Each step is a `step <n>` range, and its parts
`forward`, `backward` and `optimizer` ranges (train.loop's train_step; with pipeline stages
megatron's schedule runs them, without these ranges). On CUDA the same ranges are NVTX ranges on
every step, and the profiled steps lie between cudaProfilerStart and cudaProfilerStop, so that
`nsys profile --capture-range=cudaProfilerApi` records those steps only (Megatron-LM's --profile);
`profile.memory_snapshot` records the allocator's history over them and writes
rank<r>_steps<a>-<b>.memory.pickle (https://pytorch.org/memory_viz opens it).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from megatron_kappa.config import ProfileConfig

_nvtx = False       # CUDA: every region is an NVTX range (set by StepProfiler)
_recording = False  # torch.profiler is on: every region is a record_function range too
SNAPSHOT_ENTRIES = 100_000  # allocator events kept by the memory history (PyTorch's example's size)


class _Range:
    """One open range: an NVTX range and/or a record_function range, closed in reverse order."""

    def __init__(self, name: str):
        self.function = torch.autograd.profiler.record_function(name) if _recording else None
        self.nvtx = _nvtx
        if self.nvtx:
            torch.cuda.nvtx.range_push(name)
        if self.function is not None:
            self.function.__enter__()

    def close(self):
        if self.function is not None:
            self.function.__exit__(None, None, None)
        if self.nvtx:
            torch.cuda.nvtx.range_pop()


@contextlib.contextmanager
def region(name: str):
    """A named part of a step (forward, backward, optimizer): an NVTX range on CUDA, a range in a
    torch.profiler trace while one records; nothing (a no-op) otherwise."""
    if not (_nvtx or _recording):
        yield
        return
    opened = _Range(name)
    try:
        yield
    finally:
        opened.close()


class StepProfiler:
    """Call `begin_step(n)` at the start of each step n and `close()` when the loop ends (done,
    stopped or failed): a step's range runs to the next step's start."""

    def __init__(self, profile: ProfileConfig, run_dir: str | Path, rank: int, device: torch.device, log=print):
        global _nvtx
        self.first, self.last = profile.steps if profile.steps else (None, None)
        self.active = bool(profile.steps) and rank in profile.ranks
        self.cuda = device.type == "cuda"
        self.snapshot = profile.memory_snapshot and self.active and self.cuda
        if profile.memory_snapshot and self.active and not self.cuda:
            log("warning: profile.memory_snapshot: a CUDA allocator snapshot; none on the CPU (the step line "
                "and metrics.jsonl have the process's peak RSS)")
        self.folder, self.rank, self.log = Path(run_dir) / "profile", rank, log
        self.profiler, self.started, self.current, self.open, self.done = None, None, None, None, False
        _nvtx = self.cuda

    def begin_step(self, number: int):
        """Close step number-1's range (and the trace after the window's last step), open step
        `number`'s (and the trace at the window's first step, or the first one a resume runs)."""
        self._close_range()
        if self.profiler is not None and number > self.last:
            self._stop()
        if self.active and not self.done and self.profiler is None and self.first <= number <= self.last:
            self._start(number)
        self.current = number
        self.open = _Range(f"step {number}") if (_nvtx or _recording) else None

    def close(self):
        global _nvtx
        self._close_range()
        if self.profiler is not None:
            self._stop()
        _nvtx = False

    def _close_range(self):
        if self.open is not None:
            self.open.close()
            self.open = None

    def _start(self, number: int):
        global _recording
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if not self.cuda:  # Kineto's start/stop lines and "gpuGetDeviceCount failed": noise on the CPU
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # (read when a trace starts; the user's value wins)
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.cudart().cudaProfilerStart()
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self.profiler.start()
        self.started = number
        _recording = True

    def _stop(self):
        """End the trace after step `last` (or where the run ended) and write it."""
        global _recording
        _recording = False
        self.profiler.stop()
        ended = self.current  # the last step begun under the profiler: `last`, or where the run ended
        name = f"rank{self.rank}_steps{self.started}-{ended}"
        trace = self.folder / f"{name}.pt.trace.json"
        self.profiler.export_chrome_trace(str(trace))
        written = [trace]
        if self.cuda:
            torch.cuda.cudart().cudaProfilerStop()
        if self.snapshot:
            snapshot = self.folder / f"{name}.memory.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(snapshot)
        self.profiler, self.done = None, True
        self.log(f"profile: steps {self.started}-{ended} of rank {self.rank}: {', '.join(map(str, written))}")
