"""The plan of one layout: what the most-loaded rank holds (parameters, training state, buckets,
activations at the config's recompute mode), whether it fits, and the step-time estimate."""
from __future__ import annotations

import dataclasses

from megatron_kappa.config import Config, stage_layout
from megatron_kappa.plan import dualpipe, speed
from megatron_kappa.plan.activations import activation_bytes
from megatron_kappa.plan.layout import Layout, check
from megatron_kappa.plan.params import stage_params
from megatron_kappa.plan.planned import Planned
from megatron_kappa.plan.state import bucket_bytes, gradient_bytes, state_bytes
from megatron_kappa.plan.units import GIB

HEADROOM = 0.9  # a layout fits when the estimate stays under this share of the GPU's memory


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """What one rank of a pipeline stage holds (under DualPipe: a pipeline rank, holding two)."""
    stage: int
    params: dict[str, int]  # by kind (plan.params.KINDS)
    param_count: int
    cpu_bytes: float  # master copy and moments offloaded to CPU memory
    bytes: dict[str, float]  # weights, gradients, master, moments, buckets, activations
    gradient_peaks: dict[str, float]  # backward, step (plan.state.gradient_bytes)
    activations_by_recompute: dict[str, float]  # none, selective, full
    recompute: str
    total_bytes: float


@dataclasses.dataclass(frozen=True)
class Plan:
    """A layout's plan: its most-loaded rank, the verdict and the step-time estimate."""
    layout: Layout
    label: str
    gpu_mem_gib: float
    gpus_per_node: int
    zero_stage: int
    precision: str
    most_loaded: StagePlan
    stage_totals_gib: list[float]
    fits: bool
    budget_gib: float
    ep_inside_node: bool
    tp_inside_node: bool
    micro_batch: int
    expert_imbalance: float
    planned_only: list[str]  # what of the plan the trainer cannot run
    dualpipe: bool
    speed: speed.StepTime
    ep_overlap: bool = False  # the config's parallel.overlap_moe_expert_parallel_comm (run by the trainer)

    def as_dict(self) -> dict:
        """For --json: the fields, the layout with its data-parallel sizes."""
        out = dataclasses.asdict(self)
        out["layout"] |= {"dp": self.layout.dp, "edp": self.layout.edp}
        return out


def plan_stage(cfg: Config, layout: Layout, stage: int, *, recompute: str | None = None, imbalance: float = 1.0,
               planned: Planned = Planned()) -> StagePlan:
    """One rank of pipeline stage `stage` (under DualPipe: pipeline rank `stage`, holding two)."""
    dual = dualpipe.applies(planned, layout)
    params = dualpipe.rank_params(cfg, layout, stage) if dual else stage_params(cfg, layout, stage)
    recompute = recompute or cfg.model.recompute
    states = state_bytes(params, cfg, layout, planned)
    offloaded = states.pop("offloaded", 0.0)
    grads = gradient_bytes(params, cfg, layout, planned)
    buckets = bucket_bytes(cfg.precision, cfg.train.grad_accum_dtype)
    keeps = dualpipe.rank_activations if dual else activation_bytes
    activations = {mode: keeps(cfg, layout, stage, mode, cfg.train.micro_batch, imbalance=imbalance, planned=planned)
                   for mode in ("none", "selective", "full")}
    total = sum(states.values()) + buckets + activations[recompute]
    return StagePlan(stage=stage, params=params, param_count=sum(params.values()), cpu_bytes=offloaded,
                     bytes={**states, "buckets": buckets, "activations": activations[recompute]},
                     gradient_peaks={"backward": grads["backward"], "step": grads["step"]},
                     activations_by_recompute=activations, recompute=recompute, total_bytes=total)


def plan(cfg: Config, layout: Layout, *, gpu_mem_gib: float = 80.0, gpus_per_node: int = 8,
         rates: speed.Rates = speed.Rates(), imbalance: float = 1.0, planned: Planned = Planned()) -> Plan:
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
    worst = max(stages, key=lambda r: r.total_bytes)
    budget = HEADROOM * gpu_mem_gib * GIB
    return Plan(layout=layout, label=layout.label(), gpu_mem_gib=gpu_mem_gib, gpus_per_node=gpus_per_node,
                zero_stage=cfg.zero.stage, precision=cfg.precision, most_loaded=worst,
                stage_totals_gib=[r.total_bytes / GIB for r in stages],
                fits=worst.total_bytes <= budget, budget_gib=budget / GIB,
                ep_inside_node=layout.ep * layout.etp <= gpus_per_node,
                tp_inside_node=layout.tp <= gpus_per_node,
                micro_batch=cfg.train.micro_batch,
                expert_imbalance=imbalance,
                planned_only=shown.labels(layout) + ["stages without decoder layers"] * bool(
                    cfg.parallel.layout and stage_layout.empty_entries(cfg.parallel.layout)), dualpipe=dual,
                speed=speed.step_time(cfg, layout,
                                      stage_params=[stage_params(cfg, layout, s) for s in range(layout.pp)] if dual
                                      else [r.params for r in stages],
                                      rates=rates, gpus_per_node=gpus_per_node, imbalance=imbalance,
                                      overlap=planned.overlap, node_dispatch=planned.node_dispatch, dualpipe=dual,
                                      ring_attention=planned.ring_attention),
                ep_overlap=cfg.parallel.overlap_moe_expert_parallel_comm)
