"""Whether the trainer runs a plan: its layout and settings through the trainer's own config
reading and checks.

The layout and settings are written into the config as a user would write them (`parallel.*`,
the EP overlap `parallel.overlap_moe_expert_parallel_comm` among them, `train.micro_batch`,
`model.recompute`), then read by the trainer's loader and checked by the checks
`launch/pretrain.py --check WORLD` runs on a layout (megatron_kappa.config.loading.from_mapping:
unknown keys, types, the cross-field checks; megatron_kappa.preflight.check_parallel: the world,
the batch, the micro-batches of virtual stages, empty pipeline entries).

A factor the trainer's schema does not have is refused as the trainer refuses it: before
`parallel.cp` existed, a context-parallel layout was "unknown key 'parallel.cp'"; once the key and
its checks exist, the same layouts pass them or not with no change here. The planner's own
settings beside the layout (plan.planned.Planned: DualPipe, the planned-only overlap terms, fp8
activations, ...) are not config keys; they are asked for by flag and labelled in every row
(Plan.planned_only).
"""
from __future__ import annotations

import re

from megatron_kappa.config import Config, ConfigError, to_dict
from megatron_kappa.config.loading import from_mapping
from megatron_kappa.plan.layout import Layout
from megatron_kappa.preflight import check_parallel


def trainer_config(cfg: Config, layout: Layout) -> Config:
    """`cfg` run in `layout`, as the trainer reads it (ConfigError where it refuses it). The stage
    split follows plan.layout.with_layout: the config's first/last stage layers only for its own
    number of stages, its layout string only for its own stages and virtual stages."""
    data = to_dict(cfg)
    par = data["parallel"]
    same_pp = layout.pp == cfg.parallel.pp
    same_chunks = same_pp and layout.vpp == cfg.parallel.vpp
    par.update(tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp, vpp=layout.vpp)
    if not same_pp:
        par.update(first_stage_layers=None, last_stage_layers=None)
    if not same_chunks:
        par["layout"] = None
    if layout.cp != 1 or "cp" in par:  # written only where it says something: a schema without it refuses it
        par["cp"] = layout.cp
    trainer = from_mapping(data)
    check_parallel(trainer, layout.world)
    return trainer


def refusal(cfg: Config, layout: Layout) -> str | None:
    """The trainer's one-line refusal of `cfg` in `layout`, or None when it runs it."""
    try:
        trainer_config(cfg, layout)
    except ConfigError as e:
        return str(e)
    return None


def refused_label(message: str) -> str:
    """A search row's short mark for a refusal: the key it names."""
    found = re.search(r"unknown key '([^']+)'", message) or re.search(r"config: ([\w.]+):", message)
    return f"refused by the trainer ({found.group(1) if found else message})"
