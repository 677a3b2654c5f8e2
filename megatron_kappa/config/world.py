"""Whether a parallel layout fits a world of ranks, and the batch it then splits: the one place
the trainer's preflight, its process groups, `python -m megatron_kappa.config --world N` and the
planner's search check a world size and a global batch.

Torch-free: these run before any process group or heavy import exists.
"""
from __future__ import annotations

from megatron_kappa.config.schema import ConfigError, ParallelConfig, TrainConfig


def data_parallel(par: ParallelConfig, world: int) -> int:
    """Data-parallel size: the ranks that read different samples (the CP ranks of a sequence
    read the same ones)."""
    return world // (par.tp * par.cp * par.pp)


def check_world(par: ParallelConfig, world: int, num_experts: int | None = None):
    """One-line errors for a layout that cannot be built on `world` ranks."""
    etp, pp = par.expert_tp, par.pp
    if world % (par.tp * pp):
        raise ConfigError(f"config: parallel.tp: world size {world} is not divisible by tp × pp = "
                          f"{par.tp} × {pp}")
    if world % (par.tp * pp * par.cp):
        raise ConfigError(f"config: parallel.cp: world size {world} is not divisible by tp × pp × cp = "
                          f"{par.tp} × {pp} × {par.cp}")
    if world % (etp * par.ep * pp):
        raise ConfigError(f"config: parallel.ep: world size {world} is not divisible by "
                          f"ep × etp × pp = {par.ep} × {etp} × {pp} (start {par.ep * etp * pp} or a multiple of "
                          f"processes, or lower parallel.ep)")
    if num_experts is not None and num_experts % par.ep:
        raise ConfigError(f"config: parallel.ep: {num_experts} experts are not divisible by ep={par.ep}")


def check_batch(train: TrainConfig, dp: int):
    """train.global_batch splits into whole micro-batches on each of `dp` data-parallel ranks."""
    if train.global_batch % (train.micro_batch * dp):
        raise ConfigError(f"config: train.global_batch: {train.global_batch} is not a multiple of "
                          f"micro_batch × data-parallel size = {train.micro_batch} × {dp}")
