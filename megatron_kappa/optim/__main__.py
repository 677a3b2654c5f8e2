"""`python -m megatron_kappa.optim --config X`: the optimizer's parameter groups of a config (which
tensors, the optimizer, the peak learning rate, the weight decay at step 0), on the meta device."""
from __future__ import annotations

import argparse

from megatron_kappa.config import Config, ParallelConfig, load_config_for_cli
from megatron_kappa.summary import _fmt, count, show


def optimizer_groups(cfg: Config) -> list[dict]:
    """The parameter groups of the unsharded model (megatron_kappa.optim.optimizer.describe_groups)."""
    from megatron_kappa.model.build import build_model
    from megatron_kappa.optim.optimizer import describe_groups
    from megatron_kappa.optim.schedule import kappa_lr
    from megatron_kappa.parallel.groups import init_distributed

    unsharded = Config(**{**cfg.__dict__, "parallel": ParallelConfig()})
    init_distributed(unsharded.parallel, cfg.train.seed)
    model = build_model(unsharded, meta=True)
    total = cfg.train.steps or count(model, cfg)["steps_for_budget"]
    kappa_peak = max(kappa_lr(step, total, cfg.train, cfg.model) for step in range(total))
    return describe_groups(model, cfg.train, cfg.model, kappa_peak)


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
    ap = argparse.ArgumentParser(prog="python -m megatron_kappa.optim", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="a config file")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides")
    args = ap.parse_args(argv)
    cfg = load_config_for_cli(args.config, args.set)
    return 2 if cfg is None else show(optimizer_groups(cfg), args.json, render_groups)


if __name__ == "__main__":  # python -m megatron_kappa.optim
    from megatron_kappa.entry import run
    run("megatron_kappa.optim.__main__")
