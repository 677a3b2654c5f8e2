"""The planner's step-time estimate against step times measured on GPUs by others (issue 37):
NVIDIA's throughput-tuned layouts for Qwen3-235B-A22B on 256 H100s and their tuned Mixtral-8x22B
layout (plan.published.TUNED), and their other H100 runs (MEASURED): a fourth
ModelZoo layout, Megatron-Bridge's FP8 presets for Qwen3-235B-A22B and DeepSeek-V3, and one
ModelZoo layout at 16K to 128K tokens (where a source gives tokens/s or megatron's TFLOP/s per
GPU, published.measured_seconds reads them as step times).

    python -m bench.plan_published_measured [--no-rank] [--tflops T] [--fp8-speedup X] [--attention-tflops T]
                                            [--layer-ms MS]

Prints, for each layout, whether it fits, the estimate (default rates: 400 TFLOP/s, NVLink
450 GB/s, InfiniBand 50 GB/s per GPU), the measured step time where the source gives one and the
ratio of the two, Kendall's τ (and Spearman's ρ) of the estimated against the measured step times
over each same-work set (the same model, tokens per sequence, batch and GPUs: the dropless rows,
planned at published.DROPLESS_IMBALANCE, beside the forced ones of their length), and (without
--no-rank) each layout's position among --search's layouts at its world size with its settings
(the long-context rows are not searched); then the long-context runs with dropless routing: the
expert-imbalance margin fitted at 16K, the dropless/forced step ratios that
published.DROPLESS_IMBALANCE (the fit at the default rates) gives at every length against the
measured ones, and the margin Mixtral-8x22B's dropless figure gives. --tflops, --fp8-speedup,
--attention-tflops and --layer-ms plan every row with those rates instead of the defaults (the
planner's flags of the same names).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

from megatron_kappa.entry import start

start()  # first: the known library notices filtered before the imports below can print (megatron_kappa/entry.py)

from megatron_kappa.bench.plan_calibration import kendall, spearman  # noqa: E402
from megatron_kappa.cli_types import non_negative_float, positive_float  # noqa: E402
from megatron_kappa.plan.published import (  # noqa: E402
    DROPLESS_IMBALANCE,
    LONG_CONTEXT,
    LONG_CONTEXT_DROPLESS,
    MEASURED,
    TUNED,
    check_run,
    config_of,
    measured_seconds,
)
from megatron_kappa.plan.speed import Rates  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-rank", action="store_true", help="skip the searches (a few seconds instead of minutes)")
    defaults = Rates()
    ap.add_argument("--tflops", type=positive_float, default=defaults.tflops, help="the GEMMs' bf16 TFLOP/s")
    ap.add_argument("--fp8-speedup", type=positive_float, default=defaults.fp8_speedup, help="fp8 GEMMs over bf16")
    ap.add_argument("--attention-tflops", type=positive_float, default=None, help="the attention cores' TFLOP/s")
    ap.add_argument("--layer-ms", type=non_negative_float, default=0.0, help="ms per layer and micro-batch")
    args = ap.parse_args(argv)
    measured, estimated, ratios = [], [], []
    work, unsearched = same_work(TUNED[0]), {run.name for run in LONG_CONTEXT}
    for run in TUNED + MEASURED:
        t0 = time.monotonic()
        run = rated(run, args)
        ranked = run.name not in unsearched and not args.no_rank
        r = check_run(run, ranked=ranked)
        est, seconds = r.plan.speed.seconds, measured_seconds(run)
        line = f"{run.name}: {r.plan.label}: {r.gib:.1f} GiB, {'fits' if r.fits else 'does NOT fit'}; " \
               f"estimate {est:.2f} s"
        if seconds:
            line += f", measured {seconds:.1f} s (estimate/measured {est / seconds:.2f})"
            ratios.append(est / seconds)
            if same_work(run) == work:
                measured.append(seconds)
                estimated.append(est)
        if ranked:
            line += (f"; search position {r.rank or '-'} of {r.layouts_that_fit}, by its own estimate "
                     f"{r.by_speed} ({r.of_first:.2f}x the first) [{time.monotonic() - t0:.0f} s]")
        print(line, flush=True)
    off = sum(abs(math.log(r)) for r in ratios) / len(ratios)
    print(f"estimate/measured over the {len(ratios)} measured runs: {min(ratios):.2f} to {max(ratios):.2f} "
          f"(mean |log| {off:.3f})")
    print(f"Spearman's rank correlation, estimated vs measured step time of the {len(measured)} Qwen3-235B-A22B "
          f"layouts at 4,096 tokens, batch 2,048, 256 GPUs: {spearman(measured, estimated):.2f}")
    dropless(args)
    rank_agreement(args)
    return 0


def measured_rows(args) -> list[tuple]:
    """(run, estimated s, measured s) of every run with a measured step: the tuned and measured
    groups at forced balance, the dropless rows at published.DROPLESS_IMBALANCE."""
    rows = []
    for run in TUNED + MEASURED + LONG_CONTEXT_DROPLESS:
        seconds = measured_seconds(run)
        if seconds:
            imbalance = DROPLESS_IMBALANCE if run in LONG_CONTEXT_DROPLESS else run.imbalance
            rows.append((run, step_seconds(rated(run, args), imbalance), seconds))
    return rows


def rank_agreement(args) -> None:
    """Kendall's τ (Spearman's ρ beside it) of the estimate's order against the measured one, over
    each set of runs that do the same work; a set of one orders nothing and is named only."""
    sets: dict[tuple, list] = {}
    for run, est, seconds in measured_rows(args):
        sets.setdefault(same_work(run), []).append((run, est, seconds))
    print("rank agreement of the estimated with the measured step times, by same-work set "
          "(model, tokens per sequence, batch, GPUs):")
    for (config, tokens, batch, world), rows in sets.items():
        where = f"{Path(config).stem}, {tokens:,} tokens, batch {batch:,}, {world} GPUs"
        if len(rows) < 2:
            print(f"  {where}: 1 run ({rows[0][0].name}), no order to compare")
            continue
        est, seconds = [r[1] for r in rows], [r[2] for r in rows]
        fitted = " (in-sample: published.DROPLESS_IMBALANCE was fitted on this pair)" \
            if LONG_CONTEXT_DROPLESS and any(r[0] is LONG_CONTEXT_DROPLESS[0] for r in rows) else ""
        print(f"  {where}: {len(rows)} runs, Kendall's τ {kendall(seconds, est):.2f}, Spearman's ρ "
              f"{spearman(seconds, est):.2f} (each estimate over its measured step: "
              f"{', '.join(f'{e / m:.2f}' for e, m in zip(est, seconds))})"
              + fitted)


def rated(run, args):
    """`run` at the command line's rates instead of its own defaults."""
    return dataclasses.replace(run, rates=dataclasses.replace(
        run.rates, tflops=args.tflops, fp8_speedup=args.fp8_speedup, attention_tflops=args.attention_tflops,
        layer_ms=args.layer_ms))


def step_seconds(run, imbalance: float) -> float:
    return check_run(dataclasses.replace(run, imbalance=imbalance), ranked=False).plan.speed.seconds


def fit_imbalance(forced, dropless_run, lo: float = 1.0, hi: float = 4.0) -> float:
    """The expert-imbalance margin at which the estimate's dropless/forced step ratio equals the
    measured one (the same FLOPs: the ratio of the two TFLOP/s), by bisection: the step grows with
    the margin."""
    want, base = forced.measured_tflops / dropless_run.measured_tflops, step_seconds(forced, 1.0)
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step_seconds(forced, mid) / base < want else (lo, mid)
    return (lo + hi) / 2


def dropless(args) -> None:
    """ModelZoo's long-context runs with dropless routing: the margin fitted at 16K, the measured
    and estimated dropless/forced ratios at every length, and each dropless row's estimate."""
    pairs = [(rated(f, args), rated(d, args)) for f, d in zip(LONG_CONTEXT, LONG_CONTEXT_DROPLESS)]
    fitted = fit_imbalance(*pairs[0])
    print(f"dropless routing (ModelZoo's long-context runs): the expert-imbalance margin that gives the 16K "
          f"runs' measured dropless/forced ratio: {fitted:.3f} (published.DROPLESS_IMBALANCE: {DROPLESS_IMBALANCE}; "
          f"fitted on the 16K pair, held out: the "
          f"{', '.join(f'{config_of(d).model.seq_length // 1024}K' for _, d in pairs[1:])} "
          "pairs)")
    for forced, drop in pairs:
        est = step_seconds(drop, DROPLESS_IMBALANCE)
        ratio = est / step_seconds(forced, 1.0)
        print(f"{drop.name}: measured dropless/forced {forced.measured_tflops / drop.measured_tflops:.3f}, "
              f"estimated at {DROPLESS_IMBALANCE} {ratio:.3f}; estimate {est:.2f} s, measured "
              f"{measured_seconds(drop):.1f} s (estimate/measured {est / measured_seconds(drop):.2f})", flush=True)
    mixtral = rated(TUNED[3], args)
    routed = mixtral.measured_tflops_dropless  # the source's dropless figure (its YAML file)
    margin = fit_imbalance(mixtral, dataclasses.replace(mixtral, measured_tflops=routed))
    print(f"{mixtral.name}: measured dropless/forced {mixtral.measured_tflops / routed:.3f}, "
          f"the margin that gives it: {margin:.3f}")


def same_work(run) -> tuple:
    """What makes two runs' step times comparable: the model, tokens per sequence, batch, GPUs."""
    cfg = config_of(run)
    return run.config, cfg.model.seq_length, cfg.train.global_batch, run.layout.world


if __name__ == "__main__":
    sys.exit(main())
