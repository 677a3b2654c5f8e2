"""κ's spread at the end of each run of a study: per MoE layer, the 5 % and 95 % quantiles of κ
over the routed (token, unit) pairs as the run logged them last (kappa/layerN/bottom5, top5 in
metrics.jsonl), and whether they left a band around 1.

    python -m analysis.kappa_range runs/study_cpu [--band 0.1] [--variant kappa] [--json out.json]

Each run folder under STUDY/runs whose name starts with --variant is read; exit status 1 when a
run has no κ statistics (not a κ run, or no log step yet).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_kappa.analysis.plots import layers_of, read_metrics


def final_range(run_dir: Path) -> dict[int, tuple[float, float]]:
    """layer → (bottom 5 %, top 5 %) of κ at the last step that logged them."""
    records = read_metrics(run_dir)
    out = {}
    for layer in layers_of(records, "kappa"):
        logged = [r for r in records if f"kappa/layer{layer}/bottom5" in r]
        if logged:
            last = logged[-1]
            out[layer] = (last[f"kappa/layer{layer}/bottom5"], last[f"kappa/layer{layer}/top5"])
    return out


def table(ranges: dict[str, dict[int, tuple[float, float]]], band: float) -> str:
    lines = [f"| run | layer | κ 5 % | κ 95 % | outside 1 ± {band:g} |", "|---|---|---|---|---|"]
    for run, layers in ranges.items():
        for layer, (low, high) in layers.items():
            outside = "yes" if low < 1 - band and high > 1 + band else (
                "one side" if low < 1 - band or high > 1 + band else "no")
            lines.append(f"| {run} | {layer} | {low:.4f} | {high:.4f} | {outside} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path, help="a launch/study.py --dir (its runs/ are read)")
    ap.add_argument("--variant", default="kappa", help="run-name prefix to read (default kappa)")
    ap.add_argument("--band", type=float, default=0.1, help="half-width of the band around 1 (default 0.1)")
    ap.add_argument("--json", type=Path, help="also write {run: {layer: [q5, q95]}} here")
    args = ap.parse_args(argv)
    runs = sorted(d for d in (args.study / "runs").glob(f"{args.variant}-*") if d.is_dir())
    if not runs:
        print(f"error: {args.study}/runs: no run named {args.variant}-*", file=sys.stderr)
        return 2
    ranges = {d.name: final_range(d) for d in runs}
    print(table(ranges, args.band))
    if args.json:
        args.json.write_text(json.dumps({r: {str(k): v for k, v in ls.items()} for r, ls in ranges.items()},
                                        indent=1) + "\n")
    empty = [r for r, ls in ranges.items() if not ls]
    if empty:
        print(f"error: no κ statistics in {', '.join(empty)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
