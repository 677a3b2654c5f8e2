"""A parallel layout (TP, EP, ETP, PP, CP over a world of ranks): whether it can be built, and the record
of it that checkpoints keep (a resume must use the same one).

Torch-free: the preflight checks a layout before any process group or heavy import exists.
"""
from __future__ import annotations

from megatron_kappa.config import ConfigError, ParallelConfig


def check_layout(par: ParallelConfig, world: int, num_experts: int | None = None):
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


def layout_record(par: ParallelConfig, world: int) -> dict:
    """The layout as checkpoints record it (meta.json "layout") and resumes compare it."""
    record = {"world": world, "tp": par.tp, "ep": par.ep, "etp": par.expert_tp}
    if par.cp > 1:  # absent for cp 1, as pp: earlier checkpoints still match
        record["cp"] = par.cp
    if par.pp > 1:  # absent for pp 1, so checkpoints written before parallel.pp existed still match
        record["pp"] = par.pp
        # the stages' split likewise, where set: another split is another layout (the rank files
        # then hold other layers), loaded through the full model's names
        if par.vpp > 1:
            record["vpp"] = par.vpp
        for key in ("first_stage_layers", "last_stage_layers", "layout"):
            if getattr(par, key) is not None:
                record[key] = getattr(par, key)
    return record
