"""`--search`: the layouts that fit, fastest first, each at its fastest micro-batch, recompute
mode and EP overlap (the step-time estimate of plan.speed). Virtual stages, context parallelism
and the trainer's EP overlap (parallel.overlap_moe_expert_parallel_comm, on and off) are searched
too, and with --dualpipe DualPipe beside 1F1B (planned only: plan.planned).

Only what the trainer runs is proposed: each layout and setting is written into the config and
read by the trainer's own loader and checks (plan.accepted), so a factor the trainer refuses or
lacks is left out, and one it gains (parallel.cp) comes in with no change here. `planned_layouts`
(--planned-layouts) keeps the refused ones too, each row labelled with the refusal; the planner's
own settings (plan.planned) are applied only when asked for, and labelled in every row."""
from __future__ import annotations

import dataclasses

from tqdm import tqdm

from megatron_kappa.config import Config, ConfigError
from megatron_kappa.model.layout import model_layout
from megatron_kappa.plan import speed
from megatron_kappa.plan.accepted import refusal, refused_label
from megatron_kappa.plan.estimate import Plan, plan
from megatron_kappa.plan.layout import Layout, check, model_shape
from megatron_kappa.plan.planned import Planned

CONTEXT_PARALLEL = (1, 2, 4)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: Config, world: int, gpus_per_node: int):
    """Every layout of `world` ranks the model can be split by, TP within a node, CP of 1, 2 or 4,
    and for PP > 1 every number of virtual stages that divides the largest stage's layers."""
    has_moe = model_layout(cfg).has_moe
    experts = cfg.model.moe.num_experts if has_moe else 1
    for tp in (d for d in divisors(world) if d <= gpus_per_node):
        for cp in (c for c in CONTEXT_PARALLEL if (world // tp) % c == 0):
            for pp in divisors(world // (tp * cp)):
                for ep in divisors(experts) if has_moe else [1]:
                    for etp in sorted({1, tp}) if has_moe else [tp]:
                        layout = Layout(world, tp, pp, ep, etp, cp)
                        try:
                            check(cfg, layout)
                        except ConfigError:
                            continue
                        most = max(model_shape(cfg, layout).stage_counts()) if pp > 1 else 1
                        for vpp in divisors(most):
                            yield dataclasses.replace(layout, vpp=vpp)


MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTE = ("none", "selective", "full")


def ep_overlaps(cfg: Config, vary: bool = True) -> list[Config]:
    """`cfg` with the trainer's EP overlap (parallel.overlap_moe_expert_parallel_comm) off and on,
    for a MoE model (`vary` False, or a dense model: as the config has it). Off keeps no
    delay_wgrad_compute (the trainer refuses it alone), on the config's. Where the trainer refuses
    the overlap (EP 1, fp32, ZeRO-2, ...) plan.accepted drops the row."""
    if not vary or not model_layout(cfg).has_moe:
        return [cfg]
    return [dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, overlap_moe_expert_parallel_comm=on, delay_wgrad_compute=on and cfg.parallel.delay_wgrad_compute))
        for on in (False, True)]


def settings(cfg: Config, layout: Layout, vary_overlap: bool = True):
    """`cfg` with each micro-batch (that divides the data-parallel share of the global batch),
    recompute mode and EP overlap (ep_overlaps) the search tries for `layout`."""
    share = cfg.train.global_batch // layout.dp if cfg.train.global_batch % layout.dp == 0 else 0
    for micro in (mb for mb in MICRO_BATCHES if share and share % mb == 0):
        for recompute in RECOMPUTE:  # the config's recompute modules go with selective recompute
            modules = cfg.model.recompute_modules if recompute == "selective" else None
            for base in ep_overlaps(cfg, vary_overlap):
                yield dataclasses.replace(base, train=dataclasses.replace(base.train, micro_batch=micro),
                                          model=dataclasses.replace(base.model, recompute=recompute,
                                                                    recompute_modules=modules))


def schedules(planned: Planned, layout: Layout) -> list[Planned]:
    """The pipeline schedules tried for `layout`: with DualPipe asked for, DualPipe (where it can
    run, plan.dualpipe.check) and 1F1B, as DualPipe's second parameter copy may not
    fit where 1F1B does."""
    if planned.dualpipe and layout.pp > 1:
        return [planned, dataclasses.replace(planned, dualpipe=False)]
    return [planned]


def search(cfg: Config, world: int, *, gpu_mem_gib: float = 80.0, gpus_per_node: int = 8, top: int | None = 10,
           rates: speed.Rates = speed.Rates(), imbalance: float = 1.0, planned: Planned = Planned(),
           planned_layouts: bool = False, progress: bool = False, vary_overlap: bool = True) -> list[Plan]:
    """The layouts that fit, fastest first (estimated tokens/s, plan.speed), each
    with the micro-batch, recompute mode and EP overlap that make it fastest while it fits; EP may
    cross nodes. Only layouts and settings the trainer accepts (plan.accepted), or with
    `planned_layouts` also those it refuses, labelled. `planned`: the planned-only settings every
    layout gets; `top` None: all of them; `progress`: a bar on stderr over the candidate layouts (a
    large world takes tens of seconds); `vary_overlap` False: the config's EP overlap only."""
    best = {}
    layouts = list(candidates(cfg, world, gpus_per_node))
    for layout in tqdm(layouts, desc="layouts", unit="layout", disable=not progress, leave=False):
        for variant in settings(cfg, layout, vary_overlap):
            refused = refusal(variant, layout)
            if refused and not planned_layouts:
                continue
            for schedule in schedules(planned, layout):
                try:
                    p = plan(variant, layout, gpu_mem_gib=gpu_mem_gib, gpus_per_node=gpus_per_node, rates=rates,
                             imbalance=imbalance, planned=schedule)
                except ConfigError:  # e.g. a global batch the layout's data-parallel ranks cannot split
                    continue
                if refused:
                    p = dataclasses.replace(p, planned_only=[*p.planned_only, refused_label(refused)])
                if p.fits and (layout not in best or p.speed.tokens_per_s > best[layout].speed.tokens_per_s):
                    best[layout] = p
    return sorted(best.values(), key=lambda p: -p.speed.tokens_per_s)[:top]


def rank_of(rows: list[Plan], layout: Layout) -> int | None:
    """1-based position of `layout` among `search`'s rows (None: it is not among them)."""
    for i, p in enumerate(rows, 1):
        if p.layout == layout:
            return i
    return None
