"""Timing variants against each other in one process, their steps interleaved.

The variants' steps alternate (a, b, a, b, …) instead of running one variant's steps and then the
other's: a shared machine that slows down or speeds up during the run then moves every variant
alike, and their ratio stays put. On the 2-core CI machine, the same back-to-back comparison moved
by ±10 % between runs.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(steps: dict[str, Callable[[], None]], rounds: int, device: torch.device) -> dict[str, float]:
    """Median milliseconds of each named step over `rounds` rounds, each round running every step
    once in turn. The caller warms the steps up first."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            sync(device)
            start = time.perf_counter()
            step()
            sync(device)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}
