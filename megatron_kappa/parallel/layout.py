"""A parallel layout (TP, EP, ETP, PP, CP over a world of ranks): the record of it that checkpoints
keep (a resume must use the same one). Whether it can be built: megatron_kappa.config.world.

Torch-free: the preflight checks a layout before any process group or heavy import exists.
"""
from __future__ import annotations

from megatron_kappa.config import ParallelConfig


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
