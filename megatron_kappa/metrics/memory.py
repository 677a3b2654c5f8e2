"""Peak memory for the step line and metrics.jsonl, the largest over all ranks.

On CUDA: the caching allocator's peak allocated and reserved bytes since the previous logging step
(`mem_peak_alloc_gib`, `mem_peak_reserved_gib`; the peaks are reset after each reading, as
Megatron-LM reports them per interval). On the CPU: the process's peak resident set size since it
started (`mem_peak_rss_gib`, getrusage's ru_maxrss: the kernel keeps no per-interval peak).
"""
from __future__ import annotations

import resource
import sys

import torch
import torch.distributed as dist

GIB = 2 ** 30


def peak_rss_bytes() -> int:
    """This process's peak resident set size (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def peak_memory(device: torch.device) -> dict:
    """The peaks above as GiB, each the maximum over the ranks (a collective: every rank calls it
    on the same steps)."""
    if device.type == "cuda":
        local = [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)]
        torch.cuda.reset_peak_memory_stats(device)
        keys = ("mem_peak_alloc_gib", "mem_peak_reserved_gib")
    else:
        local, keys = [peak_rss_bytes()], ("mem_peak_rss_gib",)
    peaks = torch.tensor(local, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return dict(zip(keys, (peaks / GIB).tolist()))


def memory_words(record: dict) -> str:
    """The step line's part: `mem 12.3/14.0 GiB` (peak allocated / reserved) on CUDA, `rss 0.61 GiB`
    on the CPU."""
    if "mem_peak_alloc_gib" in record:
        return f"mem {record['mem_peak_alloc_gib']:.1f}/{record['mem_peak_reserved_gib']:.1f} GiB"
    return f"rss {record['mem_peak_rss_gib']:.2f} GiB"
