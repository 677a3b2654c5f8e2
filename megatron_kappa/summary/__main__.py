"""`python -m megatron_kappa.summary`: the command line of megatron_kappa.summary (the counts, the
paper table). The optimizer's parameter groups are `python -m megatron_kappa.optim`."""
from __future__ import annotations

import argparse

from megatron_kappa import summary
from megatron_kappa.config import load_config, load_config_for_cli
from megatron_kappa.summary import PAPER_CONFIGS, paper_table, render, show, summarize


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_kappa.summary", description=summary.__doc__.splitlines()[0])
    ap.add_argument("--config", help="a config file (or --paper)")
    ap.add_argument("--paper", action="store_true",
                    help="the 8 paper configs (configs/moe*.yaml, sandwich*.yaml) beside the paper's numbers")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides")
    args = ap.parse_args(argv)
    if args.paper:
        from pathlib import Path
        folder = Path(__file__).resolve().parents[2] / "configs"
        rows = {n: summarize(load_config(folder / f"{n}.yaml", args.set)) for n in PAPER_CONFIGS}
        return show(rows, args.json, paper_table)
    if not args.config:
        ap.error("give --config FILE or --paper")
    cfg = load_config_for_cli(args.config, args.set)
    return 2 if cfg is None else show(summarize(cfg), args.json, render)


if __name__ == "__main__":  # python -m megatron_kappa.summary
    from megatron_kappa.entry import run
    run("megatron_kappa.summary.__main__")
