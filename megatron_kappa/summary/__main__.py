"""`python -m megatron_kappa.summary`: the command line of megatron_kappa.summary (the counts, the
paper table) and `--optimizer`, the training's parameter groups: an entry point, so it may use
the training stage."""
from __future__ import annotations

import argparse
import json
import sys

from megatron_kappa import summary
from megatron_kappa.config import Config, ConfigError, load_config
from megatron_kappa.summary import PAPER_CONFIGS, _fmt, count, paper_table, render, summarize


def optimizer_groups(cfg: Config) -> list[dict]:
    """The optimizer's parameter groups of the unsharded model (meta device): tensors, optimizer,
    peak learning rate, weight decay at step 0 (megatron_kappa.train.optimizer.describe_groups)."""
    from megatron_kappa.config import ParallelConfig
    from megatron_kappa.model.build import build_model
    from megatron_kappa.parallel.groups import init_distributed
    from megatron_kappa.train.optimizer import describe_groups
    from megatron_kappa.train.recipe import kappa_lr

    unsharded = Config(**{**cfg.__dict__, "parallel": ParallelConfig()})
    init_distributed(unsharded.parallel, cfg.train.seed)
    model = build_model(unsharded, meta=True)
    total = cfg.train.steps or count(model, cfg)["steps_for_budget"]
    kappa_peak = max(kappa_lr(step, total, cfg) for step in range(total))
    return describe_groups(model, cfg, kappa_peak)


def render_groups(rows: list[dict]) -> str:
    lines = [f"{'group':<11}{'optimizer':<10}{'tensors':>8}{'params':>10}{'peak lr':>11}{'wd':>9}  settings"]
    for r in rows:
        extra = (f"momentum {r['momentum']}" if "momentum" in r
                 else f"betas {r['betas']} eps {r['eps']:g}")
        lines.append(f"{r['group']:<11}{r['optimizer']:<10}{r['tensors']:>8}{_fmt(r['params']):>10}"
                     f"{r['lr']:>11.4g}{r['weight_decay']:>9.4g}  {extra}")
        lines += [f"    {name}" for name in r["names"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_kappa.summary", description=summary.__doc__.splitlines()[0])
    ap.add_argument("--config", help="a config file (or --paper)")
    ap.add_argument("--paper", action="store_true",
                    help="the 8 paper configs (configs/moe*.yaml, sandwich*.yaml) beside the paper's numbers")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides")
    ap.add_argument("--optimizer", action="store_true",
                    help="list the optimizer's parameter groups (tensors, optimizer, peak LR, weight decay)")
    args = ap.parse_args(argv)
    if args.paper:
        from pathlib import Path
        folder = Path(__file__).resolve().parents[2] / "configs"
        rows = {n: summarize(load_config(folder / f"{n}.yaml", args.set)) for n in PAPER_CONFIGS}
        print(json.dumps(rows, indent=2) if args.json else paper_table(rows))
        return 0
    if not args.config:
        ap.error("give --config FILE or --paper")
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.optimizer:
        rows = optimizer_groups(cfg)
        print(json.dumps(rows, indent=2) if args.json else render_groups(rows))
        return 0
    s = summarize(cfg)
    print(json.dumps(s, indent=2) if args.json else render(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
