"""Fail-safe checks of the κ Triton kernels (megatron_kappa.kappa.triton_op): tile sizes before a
launch, and the one-line error for a kernel that cannot compile or launch on this machine."""
from __future__ import annotations

import torch

# Tile limits (checked by check_tiles): at most 8 fp32 elements per thread in a [BLOCK_N, BLOCK_F]
# tile (the default's load; the grouped backward holds ~10 such tiles and ptxas fits them at 8
# per thread without spilling), warps 1..32 (1024 threads per program).
MAX_BLOCK_N, MAX_BLOCK_F, MAX_TILE_PER_THREAD, MAX_NUM_WARPS = 64, 1024, 8, 32


class KappaKernelError(RuntimeError):
    """A κ kernel failed to compile or launch; the message is one line naming the config key."""


def failure_message(err, device, backend) -> str:
    # Triton's compile errors start with the source location; their reason is `error_message`.
    text = getattr(err, "error_message", None) or str(err)
    cause = next((line.strip() for line in str(text).splitlines() if line.strip()), "")
    cause = f"{type(err).__name__}: {cause}"[:300]
    where = str(device)
    try:
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            where += f" ({torch.cuda.get_device_name(device)}, sm_{major}{minor})"
    except Exception:  # the message must not fail for want of a device name
        pass
    return (f"model.kappa.backend: {backend}: the κ kernel failed to compile or launch for {where} "
            f"({cause}); set model.kappa.backend=torch")


def power_of_2(name, value, most):
    if type(value) is not int or not 1 <= value <= most or value & (value - 1):
        raise ValueError(f"κ Triton kernels: {name} must be a power of 2 in [1, {most}], got {value!r}")


def check_tiles(block_n: int, block_f: int, num_warps: int, chunk_rows: int | None = None):
    """Tile sizes the kernels take: powers of 2 (tl.arange), and a tile of at most
    MAX_TILE_PER_THREAD elements per thread (larger ones spill registers)."""
    power_of_2("BLOCK_N", block_n, MAX_BLOCK_N)
    power_of_2("BLOCK_F", block_f, MAX_BLOCK_F)
    power_of_2("NUM_WARPS", num_warps, MAX_NUM_WARPS)
    most = MAX_TILE_PER_THREAD * 32 * num_warps
    if block_n * block_f > most:
        raise ValueError(f"κ Triton kernels: BLOCK_N·BLOCK_F must be at most {most} ({MAX_TILE_PER_THREAD} "
                         f"per thread of {num_warps} warps), got {block_n}·{block_f}")
    if chunk_rows is not None and (type(chunk_rows) is not int or chunk_rows < 1):
        raise ValueError(f"κ Triton kernels: chunk_rows must be an int ≥ 1, got {chunk_rows!r}")
