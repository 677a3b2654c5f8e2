"""`python -m plan`: the planner's command line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from megatron_kappa import plan as planner
from megatron_kappa.cli_types import non_negative_float, positive_float, positive_int
from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.plan import search
from megatron_kappa.plan.planned import FP8_ACTIVATIONS, OVERLAP, Planned, check_overlap
from megatron_kappa.plan.render import describe


def overlap_terms(text: str) -> tuple[str, ...]:
    try:
        return check_overlap(t.strip() for t in text.split(",") if t.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("overlap: ")) from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m plan", description=planner.__doc__.splitlines()[0])
    ap.add_argument("--config", help="the model's config (required but with --published)")
    ap.add_argument("--world", type=positive_int, help="GPUs (ranks) in the job (required but with --published)")
    ap.add_argument("--gpu-mem", type=positive_float, default=80.0, help="GiB of memory per GPU")
    ap.add_argument("--gpus-per-node", type=positive_int, default=8)
    ap.add_argument("--search", action="store_true",
                    help="rank the layouts that fit by estimated tokens/s (micro-batch, recompute and the EP overlap, "
                         "parallel.overlap_moe_expert_parallel_comm, searched too)")
    defaults = planner.speed.Rates()
    ap.add_argument("--tflops", type=positive_float, default=defaults.tflops,
                    help="achievable dense bf16 TFLOP/s per GPU (fp8 GEMMs: --fp8-speedup times that)")
    ap.add_argument("--fp8-speedup", type=positive_float, default=defaults.fp8_speedup,
                    help="fp8 GEMMs' rate over bf16's (default 2, the peak ratio)")
    ap.add_argument("--nvlink-gbs", type=positive_float, default=defaults.nvlink_gbs,
                    help="GB/s per GPU, one way, inside a node")
    ap.add_argument("--ib-gbs", type=positive_float, default=defaults.ib_gbs, help="GB/s per GPU across nodes")
    ap.add_argument("--latency-us", type=non_negative_float, default=defaults.latency_us,
                    help="microseconds per message of a collective")
    ap.add_argument("--hbm-tbs", type=positive_float, default=defaults.hbm_tbs,
                    help="TB/s of GPU memory bandwidth (the routed experts' GEMMs as a roofline)")
    ap.add_argument("--attention-tflops", type=positive_float, default=None,
                    help="TFLOP/s of the attention cores (QKᵀ, AV; default: --tflops's; bench/plan_rates.py "
                         "measures it)")
    ap.add_argument("--layer-ms", type=non_negative_float, default=defaults.layer_ms,
                    help="ms per layer and micro-batch, forward + backward, that grow with no token (launches, "
                         "host syncs; bench/plan_rates.py measures it)")
    ap.add_argument("--expert-imbalance", type=positive_float, default=1.0,
                    help="the busiest EP rank's routed tokens over the average, under dropless routing (>= 1)")
    ap.add_argument("--top", type=positive_int, default=10, help="layouts listed by --search")
    ap.add_argument("--vpp", type=positive_int, default=None,
                    help="virtual pipeline stages per rank (interleaved 1F1B; default: the config's parallel.vpp)")
    ap.add_argument("--cp", type=positive_int, default=None,
                    help="context-parallel size (default: the config's parallel.cp)")
    planned = ap.add_argument_group("planned only", "settings the planner models and the trainer does not run")
    planned.add_argument("--optimizer-states", choices=("fp32", "bf16"), default="fp32",
                         help="the optimizer's moments in bf16 (the master copy stays fp32)")
    planned.add_argument("--fp8-activations", choices=FP8_ACTIVATIONS, default="none",
                         help="saved tensors kept in fp8: every linear layer's input, the experts' (moe), or both")
    planned.add_argument("--recompute-norms", action="store_true", help="megatron's layernorm recompute module")
    planned.add_argument("--offload-optimizer", action="store_true", help="master copy and moments in CPU memory")
    planned.add_argument("--offload-activations", action="store_true",
                         help="saved activations in CPU memory, two chunks on the GPU")
    planned.add_argument("--overlap", type=overlap_terms, default=(), metavar="TERMS",
                         help=f"traffic run beside the compute, comma-separated: {','.join(OVERLAP)} (expert: the "
                              "whole all-to-all; the trainer's own EP overlap is "
                              "parallel.overlap_moe_expert_parallel_comm)")
    planned.add_argument("--node-dispatch", action="store_true",
                         help="EP across nodes: a token crosses to each node once, then NVLink (DeepEP)")
    planned.add_argument("--dualpipe", action="store_true",
                         help="DeepSeek-V3's DualPipe in place of 1F1B (even PP, no VPP; searched beside 1F1B)")
    planned.add_argument("--fused-swiglu", action="store_true",
                         help="megatron's fused SwiGLU in the dense MLPs and shared experts: silu(gate) not kept")
    planned.add_argument("--ring-attention", action="store_true",
                         help="CP passes K and V round a ring (Transformer Engine's p2p) instead of the trainer's "
                              "all-gather: 3 (cp - 1) hops a layer, the rank's own K and V kept")
    planned.add_argument("--planned-layouts", action="store_true",
                         help="with --search: also rank the layouts and settings the trainer refuses (its own config "
                              "checks, as pretrain --check runs them), each row labelled with the refusal")
    ap.add_argument("--published", action="store_true",
                    help="plan each published frontier run at its layout and settings (plan.published)")
    ap.add_argument("--rank", action="store_true",
                    help="with --published: also rank each run among --search's layouts (a search each: about two "
                    "minutes for all eight)")
    ap.add_argument("--markdown", action="store_true",
                    help="with --published: docs/plan.md's tables of the runs at 80 GiB, 8 GPUs a node (plan.tables; "
                         "with --rank, their search positions)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr (--search, --rank)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides")
    args = ap.parse_args(argv)
    if args.published:
        given = [f for f, v in (("--config", args.config), ("--world", args.world), ("--search", args.search),
                                ("--set", args.set)) if v]
        if given:
            ap.error(f"--published plans each run at its own config, world and settings: leave out {', '.join(given)}")
        if args.markdown:
            from megatron_kappa.plan import tables
            return tables.main(["--print"] + ["--no-rank"] * (not args.rank) + ["--no-progress"] * args.no_progress)
        return published(args.gpu_mem, args.gpus_per_node, args.json, args.rank, not args.no_progress)
    if args.rank or args.markdown:
        ap.error(f"--{'rank' if args.rank else 'markdown'} goes with --published")
    if args.planned_layouts and not args.search:
        ap.error("--planned-layouts goes with --search")
    for name in ("config", "world"):
        if getattr(args, name) is None:
            ap.error(f"--{name} is required (but with --published)")
    if args.expert_imbalance < 1:
        ap.error("--expert-imbalance must be at least 1 (the busiest rank over the average)")
    for name in ("world", "gpus_per_node"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    rates = planner.speed.Rates(tflops=args.tflops, nvlink_gbs=args.nvlink_gbs, ib_gbs=args.ib_gbs,
                                latency_us=args.latency_us, hbm_tbs=args.hbm_tbs, fp8_speedup=args.fp8_speedup,
                                attention_tflops=args.attention_tflops, layer_ms=args.layer_ms)
    extra = Planned(optimizer_states=args.optimizer_states, fp8_activations=args.fp8_activations,
                    recompute_norms=args.recompute_norms, offload_optimizer=args.offload_optimizer,
                    offload_activations=args.offload_activations, overlap=args.overlap,
                    node_dispatch=args.node_dispatch, fused_swiglu=args.fused_swiglu, dualpipe=args.dualpipe,
                    ring_attention=args.ring_attention)
    try:
        cfg = load_config(args.config, args.set)
        if args.search:
            rows = search.search(cfg, args.world, gpu_mem_gib=args.gpu_mem, gpus_per_node=args.gpus_per_node,
                                 top=args.top, rates=rates, imbalance=args.expert_imbalance, planned=extra,
                                 planned_layouts=args.planned_layouts, progress=not args.no_progress)
            print(json.dumps([p.as_dict() for p in rows], indent=1) if args.json else planner.render_search(rows))
            return 0 if rows else 1
        layout = planner.layout_of(cfg.parallel, args.world)
        layout = dataclasses.replace(layout, cp=args.cp or layout.cp, vpp=args.vpp or layout.vpp)
        result = planner.plan(cfg, layout, gpu_mem_gib=args.gpu_mem, gpus_per_node=args.gpus_per_node, rates=rates,
                              imbalance=args.expert_imbalance, planned=extra)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_dict(), indent=1) if args.json else planner.render(result))
    return 0 if result.fits else 1


def published(gpu_mem: float, gpus_per_node: int, as_json: bool, ranked: bool, progress: bool = False) -> int:
    """Each published run (the reports' and recipes' layouts, then NVIDIA's tuned ones with the
    step times they measured): its plan's verdict and (`ranked`) its position among --search's
    layouts."""
    try:  # the runs' files are read as the module loads: a bad one is a one-line error, not a traceback
        from megatron_kappa.plan.published import RUNS, TUNED, check_run
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for title, runs in (("published runs", RUNS), ("NVIDIA's tuned layouts, measured on H100 (Megatron-MoE-ModelZoo)",
                                                   TUNED)):
        if not as_json:
            print(f"{title}:", flush=True)
        for run in runs:
            r = check_run(run, gpu_mem_gib=gpu_mem, gpus_per_node=gpus_per_node, ranked=ranked, progress=progress)
            rows.append(r)
            if not as_json:
                print(describe(run, r, ranked), flush=True)
                if run.note:
                    print(f"  note: {run.note}", flush=True)
    if as_json:
        print(json.dumps([r.as_dict() for r in rows], indent=1, default=str))
    return 0 if all(r.fits for r in rows) else 1


# what Ctrl-C leaves (a search of a large world runs for tens of seconds; megatron_kappa/cli/commands.py)
INTERRUPTED = "the planner writes nothing, so nothing is lost; run it again"

if __name__ == "__main__":  # python -m megatron_kappa.plan
    from megatron_kappa.entry import run
    run("megatron_kappa.plan.__main__")
