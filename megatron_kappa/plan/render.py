"""The planner's text output: a plan, a search's table and a published run's line."""
from __future__ import annotations

from megatron_kappa.plan import dualpipe
from megatron_kappa.plan.estimate import HEADROOM, Plan
from megatron_kappa.plan.units import GIB


def where(stage: int, pp: int, dual: bool) -> str:
    """The most-loaded rank's place in the pipeline, for the output."""
    if dual:
        return "rank {} of {} (stages {} and {}: DualPipe)".format(stage, pp, *dualpipe.stages_of(pp, stage))
    return f"stage {stage} of {pp}"


def render(p: Plan) -> str:
    w = p.most_loaded
    lines = [f"layout        {p.label}  on {p.layout.world} GPUs ({p.gpus_per_node} per node)"
             + ("" if p.ep_inside_node else "  [EP × ETP crosses nodes]"),
             f"precision     {p.precision}, ZeRO-{p.zero_stage}, recompute {w.recompute}"
             + ", EP overlap (combined 1F1B)" * p.ep_overlap,
             f"most loaded   pipeline {where(w.stage, p.layout.pp, p.dualpipe)}: "
             f"{w.param_count / 1e9:.3f} B parameters",
             "  by kind     " + ", ".join(f"{k} {v / 1e9:.3f} B" for k, v in w.params.items() if v)]
    for key, value in w.bytes.items():
        lines.append(f"  {key:<12}{value / GIB:>9.2f} GiB" + ("  (the larger of: backward {:.2f}, step {:.2f})".format(
            *(v / GIB for v in w.gradient_peaks.values())) if key == "gradients" else ""))
    lines.append("  activations by recompute: " + ", ".join(
        f"{k} {v / GIB:.2f} GiB" for k, v in w.activations_by_recompute.items()))
    lines.append(f"  total       {w.total_bytes / GIB:>9.2f} GiB of {p.gpu_mem_gib:g} GiB "
                 f"({HEADROOM:.0%} usable: {p.budget_gib:.1f})")
    if w.cpu_bytes:
        lines.append(f"  offloaded   {w.cpu_bytes / GIB:>9.2f} GiB of master copy and moments in CPU memory")
    lines.append(f"verdict       {'fits' if p.fits else 'does NOT fit'}")
    if p.planned_only:
        lines.append("planned only  " + ", ".join(p.planned_only) + " (the trainer does not run these)")
    v = p.speed
    lines.append(f"step time     {v.seconds:.3f} s estimated ({v.tokens_per_s:,.0f} tokens/s, "
                 f"{v.tokens_per_s_per_gpu:,.0f} per GPU; micro-batch {p.micro_batch}, "
                 f"{v.micro_batches} per step): " + ", ".join(f"{k} {t:.3f}" for k, t in v.terms.items()))
    return "\n".join(lines)


def render_search(rows: list[Plan]) -> str:
    if not rows:
        return "no layout fits"
    out = [f"{'layout':<50}{'tokens/s':>12}{'step s':>8}  micro  recompute {'GiB':>6}  EP in node  EP overlap  "
           "planned only"]
    for p in rows:  # "EP overlap": parallel.overlap_moe_expert_parallel_comm; "planned only": what of the
        w, v = p.most_loaded, p.speed  # row the trainer does not run (none: "-")
        out.append(f"{p.label:<50}{v.tokens_per_s:>12,.0f}{v.seconds:>8.2f}  {p.micro_batch:>5}  "
                   f"{w.recompute:<9} {w.total_bytes / GIB:>6.1f}  {'yes' if p.ep_inside_node else 'no':<10}  "
                   f"{'on' if p.ep_overlap else 'off':<10}  {', '.join(p.planned_only) or '-'}")
    return "\n".join(out)


def describe(run, r: dict, ranked: bool) -> str:
    """One line: layout, memory, verdict, estimate (and the measured step time), search position."""
    p = r.plan
    line = (f"{run.name}: {p.label} on {run.layout.world} GPUs: {r.gib:.1f} GiB, "
            f"{'fits' if r.fits else 'does NOT fit'}; {p.speed.tokens_per_s:,.0f} tokens/s")
    if r.measured_s:
        line += f", {p.speed.seconds:.2f} s per step (measured: {r.measured_s:.1f} s)"
    if ranked:
        at = r.rank or f"{r.by_speed} by its own estimate"
        line += f"; search position {at} of {r.layouts_that_fit} that fit ({r.of_first:.2f}x the first)"
    if p.planned_only:
        line += f"; planned only: {', '.join(p.planned_only)}"
    return line
