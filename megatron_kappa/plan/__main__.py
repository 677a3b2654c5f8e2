"""`python -m megatron_kappa.plan`: the command line of megatron_kappa.plan."""
from __future__ import annotations

import argparse
import json
import sys

from megatron_kappa import plan as planner
from megatron_kappa.plan import search
from megatron_kappa.cli_types import positive_float, positive_int
from megatron_kappa.config import ConfigError, load_config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_kappa.plan", description=planner.__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--world", type=positive_int, required=True, help="GPUs (ranks) in the job")
    ap.add_argument("--gpu-mem", type=positive_float, default=80.0, help="GiB of memory per GPU")
    ap.add_argument("--gpus-per-node", type=positive_int, default=8)
    ap.add_argument("--search", action="store_true",
                    help="rank the layouts that fit by estimated tokens/s (micro-batch and recompute searched too)")
    defaults = planner.speed.Rates()
    ap.add_argument("--tflops", type=positive_float, default=defaults.tflops,
                    help="achievable dense bf16 TFLOP/s per GPU (fp8 GEMMs: twice)")
    ap.add_argument("--nvlink-gbs", type=positive_float, default=defaults.nvlink_gbs,
                    help="GB/s per GPU, one way, inside a node")
    ap.add_argument("--ib-gbs", type=positive_float, default=defaults.ib_gbs, help="GB/s per GPU across nodes")
    ap.add_argument("--expert-imbalance", type=positive_float, default=1.0,
                    help="the busiest EP rank's routed tokens over the average, under dropless routing (>= 1)")
    ap.add_argument("--top", type=positive_int, default=10, help="layouts listed by --search")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides")
    args = ap.parse_args(argv)
    if args.expert_imbalance < 1:
        ap.error("--expert-imbalance must be at least 1 (the busiest rank over the average)")
    for name in ("world", "gpus_per_node"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    rates = planner.speed.Rates(args.tflops, args.nvlink_gbs, args.ib_gbs)
    try:
        cfg = load_config(args.config, args.set)
        if args.search:
            rows = search.search(cfg, args.world, args.gpu_mem, args.gpus_per_node, args.top, rates, args.expert_imbalance)
            print(json.dumps(rows, indent=1) if args.json else search.render_search(rows))
            return 0 if rows else 1
        result = planner.plan(cfg, planner.layout_of(cfg, args.world), args.gpu_mem, args.gpus_per_node, rates,
                              args.expert_imbalance)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else planner.render(result))
    return 0 if result["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
