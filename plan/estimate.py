"""The plan of one layout: what the most-loaded rank holds (parameters, training state, buckets,
activations at the config's recompute mode), whether it fits, and the step-time estimate."""
from __future__ import annotations

import dataclasses

from megatron_kappa.config import Config, stage_layout
from plan import dualpipe, speed
from plan.activations import activation_bytes
from plan.layout import Layout, check
from plan.params import stage_params
from plan.planned import Planned
from plan.state import bucket_bytes, gradient_bytes, state_bytes
from plan.units import GIB

HEADROOM = 0.9  # a layout fits when the estimate stays under this share of the GPU's memory


def plan_stage(cfg: Config, layout: Layout, stage: int, recompute: str | None = None, imbalance: float = 1.0,
               planned: Planned = Planned()) -> dict:
    """One rank of pipeline stage `stage` (under DualPipe: pipeline rank `stage`, holding two)."""
    dual = dualpipe.applies(planned, layout)
    params = dualpipe.rank_params(cfg, layout, stage) if dual else stage_params(cfg, layout, stage)
    recompute = recompute or cfg.model.recompute
    states = state_bytes(params, cfg, layout, planned)
    offloaded = states.pop("offloaded", 0.0)
    grads = gradient_bytes(params, cfg, layout, planned)
    buckets = bucket_bytes(cfg)
    keeps = dualpipe.rank_activations if dual else activation_bytes
    activations = {mode: keeps(cfg, layout, stage, mode, cfg.train.micro_batch, imbalance, planned)
                   for mode in ("none", "selective", "full")}
    total = sum(states.values()) + buckets + activations[recompute]
    return {"stage": stage, "params": params, "param_count": sum(params.values()), "cpu_bytes": offloaded,
            "bytes": {**states, "buckets": buckets, "activations": activations[recompute]},
            "gradient_peaks": {"backward": grads["backward"], "step": grads["step"]},
            "activations_by_recompute": activations, "recompute": recompute, "total_bytes": total}


def plan(cfg: Config, layout: Layout, gpu_mem_gib: float, gpus_per_node: int = 8,
         rates: speed.Rates = speed.Rates(), imbalance: float = 1.0, planned: Planned = Planned()) -> dict:
    """The most-loaded rank of `layout` (by total bytes, over the pipeline stages), a verdict, and
    the estimated step time (plan.speed). `imbalance`: the busiest EP rank's routed
    rows over the average, under dropless routing (1: balanced). `planned`: settings the trainer
    does not run (and the layout's CP and VPP), listed as "planned_only"."""
    check(cfg, layout)
    dual = dualpipe.applies(planned, layout)
    if dual:
        dualpipe.check(layout, cfg.train.global_batch // (cfg.train.micro_batch * layout.dp))
    shown = planned  # zero.offload_optimizer: the trainer runs it, so it is not "planned only"
    if cfg.zero.offload_optimizer:
        shown, planned = dataclasses.replace(planned, offload_optimizer=False), \
            dataclasses.replace(planned, offload_optimizer=True)
    stages = [plan_stage(cfg, layout, s, imbalance=imbalance, planned=planned) for s in range(layout.pp)]
    worst = max(stages, key=lambda r: r["total_bytes"])
    budget = HEADROOM * gpu_mem_gib * GIB
    return {"layout": dataclasses.asdict(layout) | {"dp": layout.dp, "edp": layout.edp},
            "label": layout.label(), "gpu_mem_gib": gpu_mem_gib, "gpus_per_node": gpus_per_node,
            "zero_stage": cfg.zero.stage, "precision": cfg.precision, "most_loaded": worst,
            "stage_totals_gib": [r["total_bytes"] / GIB for r in stages],
            "fits": worst["total_bytes"] <= budget, "budget_gib": budget / GIB,
            "ep_inside_node": layout.ep * layout.etp <= gpus_per_node,
            "tp_inside_node": layout.tp <= gpus_per_node,
            "micro_batch": cfg.train.micro_batch,
            "expert_imbalance": imbalance,
            "planned_only": shown.labels(layout) + ["stages without decoder layers"] * bool(
                cfg.parallel.layout and stage_layout.empty_entries(cfg.parallel.layout)), "dualpipe": dual,
            "speed": speed.step_time(cfg, layout, rates, gpus_per_node,
                                     [stage_params(cfg, layout, s) for s in range(layout.pp)] if dual
                                     else [r["params"] for r in stages],
                                     imbalance=imbalance, overlap=planned.overlap,
                                     node_dispatch=planned.node_dispatch, dualpipe=dual)}
