"""A study's table (launch/study.py): per variant, mean ± sd over seeds of the final validation
loss, bits per byte and centered CORE, the paired per-seed difference to the SwiGLU baseline, and
tokens/s — as in the paper's tables (3 seeds, mean ± sd).

    python analysis/study_table.py STUDY_DIR     (rebuild table.md / table.json from the runs)

Inputs: STUDY_DIR/runs/<variant>-seed<seed>/result.json, one per finished run. sd is the sample
standard deviation (n − 1). The paired comparison takes, for each seed both runs have, the
difference variant − baseline: its mean ± sd, the paired t statistic and its two-sided p-value
(Student's t with n − 1 degrees of freedom), and on how many seeds the variant is better.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
from pathlib import Path

BASELINE = "swiglu"
# key in result.json, column title, +1 if higher is better, scale for display
METRICS = (("valid_loss", "valid loss", -1, 1.0, 4), ("bits_per_byte", "bits/byte", -1, 1.0, 4),
           ("core", "CORE ×100", +1, 100.0, 2))


def student_t_two_sided_p(t: float, df: int) -> float:
    """P(|T| ≥ |t|) for Student's t with integer df ≥ 1, in closed form (Abramowitz & Stegun
    26.7.3–4): with θ = atan(|t| / √df), P(|T| < |t|) is a finite series in sin θ and cos θ."""
    if df < 1:
        raise ValueError("df must be ≥ 1")
    if math.isinf(t):
        return 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2:  # odd: (2/π)[θ + sin θ (cos θ + (2/3)cos³θ + ... )]
        term, total = c, 0.0
        for k in range(1, (df - 1) // 2 + 1):
            if k > 1:
                term *= c * c * (2 * k - 2) / (2 * k - 1)
            total += term
        inside = 2 / math.pi * (theta + s * total) if df > 1 else 2 * theta / math.pi
    else:  # even: sin θ [1 + (1/2)cos²θ + (1·3)/(2·4)cos⁴θ + ...]
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c * c * (2 * k - 1) / (2 * k)
            total += term
        inside = s * total
    return min(1.0, max(0.0, 1.0 - inside))


def _mean_sd(values: list[float]) -> dict:
    return {"n": len(values), "mean": statistics.fmean(values) if values else None,
            "sd": statistics.stdev(values) if len(values) > 1 else None}


def load_results(study_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((Path(study_dir) / "runs").glob("*/result.json"))]


def summarize(results: list[dict], variants: list[str], seeds: list[int], baseline: str = BASELINE) -> dict:
    """The table's numbers for the requested variants × seeds (missing runs are listed)."""
    by = {(r["variant"], r["seed"]): r for r in results if r["variant"] in variants and r["seed"] in seeds}
    table = {"variants": [], "baseline": baseline if baseline in variants else None,
             "missing": [f"{v}-seed{s}" for v in variants for s in seeds if (v, s) not in by]}
    for v in variants:
        runs = [by[(v, s)] for s in seeds if (v, s) in by]
        row = {"variant": v, "seeds": [r["seed"] for r in runs],
               "tokens_per_s": _mean_sd([r["tokens_per_s"] for r in runs if r.get("tokens_per_s") is not None])}
        for key, *_ in METRICS:
            values = [r[key] for r in runs if r.get(key) is not None]
            row[key] = {**_mean_sd(values), "per_seed": {r["seed"]: r[key] for r in runs if r.get(key) is not None}}
        if table["baseline"] and v != baseline:
            row["vs_baseline"] = {}
            for key, _, sign, *_ in METRICS:
                pairs = [(by[(v, s)][key], by[(baseline, s)][key]) for s in seeds
                         if (v, s) in by and (baseline, s) in by
                         and by[(v, s)].get(key) is not None and by[(baseline, s)].get(key) is not None]
                diffs = [a - b for a, b in pairs]
                stat = {**_mean_sd(diffs), "per_seed": diffs, "t": None, "p": None,
                        "better": sum(1 for d in diffs if sign * d > 0)}
                if len(diffs) > 1 and stat["sd"] > 0:
                    stat["t"] = stat["mean"] / (stat["sd"] / math.sqrt(len(diffs)))
                    stat["p"] = student_t_two_sided_p(stat["t"], len(diffs) - 1)
                row["vs_baseline"][key] = stat
        table["variants"].append(row)
    return table


def _pm(stat: dict, scale: float = 1.0, digits: int = 4, signed: bool = False) -> str:
    if not stat or stat.get("mean") is None:
        return "—"
    mean = f"{stat['mean'] * scale:{'+' if signed else ''}.{digits}f}"
    return mean if stat.get("sd") is None else f"{mean} ± {stat['sd'] * scale:.{digits}f}"


def markdown(table: dict, title: str = "") -> str:
    lines = [f"## {title}" if title else "## Study", ""]
    head = ["variant", "seeds"] + [m[1] for m in METRICS] + ["tokens/s"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table["variants"]:
        cells = [row["variant"], ",".join(map(str, row["seeds"])) or "—"]
        cells += [_pm(row[key], scale, digits) for key, _, _, scale, digits in METRICS]
        cells.append(_pm(row["tokens_per_s"], 1.0, 0))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "mean ± sd over seeds (sd: sample standard deviation, n − 1)."]
    if table["baseline"]:
        lines += ["", f"### Difference to {table['baseline']} (paired by seed: variant − {table['baseline']})", "",
                  "| variant | metric | Δ mean ± sd | per seed | t | p (two-sided) | better on |",
                  "|---|---|---|---|---|---|---|"]
        for row in table["variants"]:
            for key, name, sign, scale, digits in METRICS:
                stat = row.get("vs_baseline", {}).get(key)
                if not stat or not stat["n"]:
                    continue
                per_seed = ", ".join(f"{d * scale:+.{digits}f}" for d in stat["per_seed"])
                t = "—" if stat["t"] is None else f"{stat['t']:.2f}"
                p = "—" if stat["p"] is None else f"{stat['p']:.3f}"
                lines.append(f"| {row['variant']} | {name} ({'higher' if sign > 0 else 'lower'} is better) | "
                             f"{_pm(stat, scale, digits, signed=True)} | {per_seed} | {t} | {p} | "
                             f"{stat['better']}/{stat['n']} seeds |")
    if table["missing"]:
        lines += ["", "Not finished (not in the table): " + ", ".join(table["missing"])]
    return "\n".join(lines) + "\n"


def _atomic_write(path: Path, text: str):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_table(study_dir: Path, variants: list[str], seeds: list[int], title: str = "") -> dict:
    study_dir = Path(study_dir)
    table = summarize(load_results(study_dir), variants, seeds)
    table["title"] = title
    _atomic_write(study_dir / "table.json", json.dumps(table, indent=1) + "\n")
    _atomic_write(study_dir / "table.md", markdown(table, title))
    return table


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python analysis/study_table.py STUDY_DIR", file=sys.stderr)
        return 2
    study_dir = Path(argv[0])
    plan = study_dir / "study.json"
    if not plan.is_file():
        print(f"error: {plan}: no such file (expected a launch/study.py directory)", file=sys.stderr)
        return 2
    spec = json.loads(plan.read_text())
    table = write_table(study_dir, spec["variants"], spec["seeds"], spec.get("title", ""))
    print(markdown(table, table["title"]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
