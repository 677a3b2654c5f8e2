"""`--search`: the layouts that fit, fastest first, each at its fastest micro-batch and recompute
mode (the step-time estimate of megatron_kappa.plan.speed)."""
from __future__ import annotations

import dataclasses

from megatron_kappa.config import Config, ConfigError
from megatron_kappa.model.layout import model_layout
from megatron_kappa.plan import GIB, Layout, check, plan, speed


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: Config, world: int, gpus_per_node: int):
    """Every layout of `world` ranks the model can be split by, TP within a node."""
    has_moe = model_layout(cfg).has_moe
    experts = cfg.model.moe.num_experts if has_moe else 1
    for tp in (d for d in _divisors(world) if d <= gpus_per_node):
        for pp in _divisors(world // tp):
            for ep in _divisors(experts) if has_moe else [1]:
                for etp in sorted({1, tp}) if has_moe else [tp]:
                    layout = Layout(world, tp, pp, ep, etp)
                    try:
                        check(cfg, layout)
                    except ConfigError:
                        continue
                    yield layout


MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTE = ("none", "selective", "full")


def settings(cfg: Config, layout: Layout):
    """`cfg` with each micro-batch (that divides the data-parallel share of the global batch) and
    recompute mode the search tries for `layout`."""
    share = cfg.train.global_batch // layout.dp if cfg.train.global_batch % layout.dp == 0 else 0
    for micro in (mb for mb in MICRO_BATCHES if share and share % mb == 0):
        for recompute in RECOMPUTE:
            yield dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch=micro),
                                      model=dataclasses.replace(cfg.model, recompute=recompute))


def search(cfg: Config, world: int, gpu_mem_gib: float, gpus_per_node: int = 8, top: int = 10,
           rates: speed.Rates = speed.Rates(), imbalance: float = 1.0) -> list[dict]:
    """The layouts that fit, fastest first (estimated tokens/s, megatron_kappa.plan.speed), each
    with the micro-batch and recompute mode that make it fastest while it fits; EP may cross nodes."""
    best = {}
    for layout in candidates(cfg, world, gpus_per_node):
        for variant in settings(cfg, layout):
            try:
                p = plan(variant, layout, gpu_mem_gib, gpus_per_node, rates, imbalance)
            except ConfigError:  # e.g. a global batch the layout's data-parallel ranks cannot split
                continue
            if p["fits"] and (layout not in best or p["speed"]["tokens_per_s"] > best[layout]["speed"]["tokens_per_s"]):
                best[layout] = p
    return sorted(best.values(), key=lambda p: -p["speed"]["tokens_per_s"])[:top]


def render_search(rows: list[dict]) -> str:
    if not rows:
        return "no layout fits"
    out = [f"{'layout':<42}{'tokens/s':>12}{'step s':>8}  micro  recompute {'GiB':>6}  EP in node"]
    for p in rows:
        w, v = p["most_loaded"], p["speed"]
        out.append(f"{p['label']:<42}{v['tokens_per_s']:>12,.0f}{v['seconds']:>8.2f}  {p['micro_batch']:>5}  "
                   f"{w['recompute']:<9} {w['total_bytes'] / GIB:>6.1f}  {'yes' if p['ep_inside_node'] else 'no'}")
    return "\n".join(out)
