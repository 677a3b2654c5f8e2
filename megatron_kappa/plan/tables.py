"""docs/plan.md's tables of the published runs, generated from their plans (`--published`).

    python -m plan.tables            # rewrite the tables in docs/plan.md (ranks each run: minutes)
    python -m plan.tables --print    # print them instead
    python -m plan --published --markdown [--rank]   # the same tables from the planner's command line

Two tables: "report", the runs' own layouts (configs/frontier/published, group report), and
"measured", NVIDIA's runs with the step times they measured (groups tuned, measured and
long_context). Each sits in docs/plan.md between a `<!-- generated: plan.tables NAME -->` line and
`<!-- end generated -->`. The search position, the last column, needs a search per run and so
comes only with `ranked`; tests/test_plan_tables.py regenerates the rest and fails where the
docs' numbers differ.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from megatron_kappa.plan.published import LONG_CONTEXT, MEASURED, RUNS, TUNED, Published, RunPlan, check_run
from megatron_kappa.plan.units import GIB

DOCS = Path(__file__).resolve().parents[2] / "docs" / "plan.md"
START, END = "<!-- generated: plan.tables {} -->", "<!-- end generated -->"


def report_row(run: Published, r: RunPlan) -> list[str]:
    p = r.plan
    cpu = p.most_loaded.cpu_bytes / GIB
    memory = f"{r.gib:.1f} GiB" + (f" (+ {cpu:.1f} GiB of optimizer state in CPU memory)" if cpu else "")
    cells = [run.name, f"{p.label} on {run.layout.world:,}", run.table or "", memory,
             "fits" if r.fits else "does NOT fit", f"{p.speed.tokens_per_s / 1e6:.2f} M tokens/s"]
    if r.ranked:
        at = r.rank or f"{r.by_speed} by its own estimate"
        cells.append(f"{at} of {r.layouts_that_fit} ({r.of_first:.2f}×)")
    return cells


def measured_text(run: Published, seconds: float) -> str:
    shown = f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"
    if run.measured_tflops:
        return f"{shown} ({run.measured_tflops:g} TFLOP/s)"
    if run.measured_tokens_per_gpu_s:
        return f"{shown} ({run.measured_tokens_per_gpu_s:,} tokens/s/GPU)"
    return shown


def measured_row(run: Published, r: RunPlan) -> list[str]:
    est = r.plan.speed.seconds
    cells = [run.table or run.name, f"{r.gib:.1f} GiB, {'fits' if r.fits else 'does NOT fit'}", f"{est:.2f} s",
             measured_text(run, r.measured_s), f"{est / r.measured_s:.2f}"]
    if r.ranked:
        cells.append(f"{r.by_speed} of {r.layouts_that_fit} ({r.of_first:.2f}×)")
    return cells


HEADERS = {
    "report": ["run", "layout on GPUs", "settings (planned only in italics)", "most-loaded rank", "verdict", "estimate",
               "`--search` position"],
    "measured": ["layout (source)", "verdict", "estimate", "measured", "estimate / measured",
                 "position by its estimate"],
}


def markdown(header: list[str], rows: list[list[str]]) -> str:
    header = header[:len(rows[0])]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def tables(ranked: bool = False, progress: bool = False) -> dict[str, str]:
    """Each table's markdown. Without `ranked` the position column is left out; the long-context
    runs are never searched (their position reads "not searched")."""
    report = [report_row(run, check_run(run, ranked=ranked, progress=progress)) for run in RUNS]
    measured = []
    for run in TUNED + MEASURED:
        searched = ranked and run not in LONG_CONTEXT
        cells = measured_row(run, check_run(run, ranked=searched, progress=progress))
        measured.append(cells + ["not searched"] * (ranked and not searched))
    return {"report": markdown(HEADERS["report"], report), "measured": markdown(HEADERS["measured"], measured)}


def blocks(text: str) -> dict[str, str]:
    """The generated tables in `text` (docs/plan.md), by name."""
    pattern = re.escape(START).replace(r"\{\}", r"(\w+)") + r"\n(.*?)\n" + re.escape(END)
    return {m.group(1): m.group(2) for m in re.finditer(pattern, text, re.S)}


def drift(text: str, new: dict[str, str]) -> list[str]:
    """Where `text`'s generated tables differ from `new` (one line each, empty when they agree).
    A table of `new` without the position column (not ranked) is compared with the written one's
    other columns."""
    problems = []
    written = blocks(text)
    for name, table in new.items():
        if name not in written:
            problems.append(f"{name}: no generated table")
            continue
        have, want = written[name].splitlines(), table.splitlines()
        width = want[0].count("|")
        have = ["|".join(line.split("|")[:width]) + "|" for line in have]
        if len(have) != len(want):
            problems.append(f"{name}: {len(have) - 2} rows written, {len(want) - 2} generated")
        problems += [f"{name}: written   {h}\n{' ' * len(name)}  generated {w}" for h, w in zip(have, want) if h != w]
    return problems


def rewrite(text: str, new: dict[str, str]) -> str:
    """`text` with each generated table replaced by `new`'s of the same name."""
    for name, table in new.items():
        start = START.format(name)
        if start not in text:
            raise ValueError(f"{DOCS.name}: no '{start}' line")
        head, rest = text.split(start + "\n", 1)
        text = head + start + "\n" + table + "\n" + END + rest.split(END, 1)[1]
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m plan.tables", description=__doc__.splitlines()[0])
    ap.add_argument("--print", action="store_true", help="print the tables instead of rewriting docs/plan.md")
    ap.add_argument("--no-rank", action="store_true", help="leave out the search positions (seconds, not minutes)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = ap.parse_args(argv)
    new = tables(ranked=not args.no_rank, progress=not args.no_progress)
    if args.print:
        print("\n\n".join(f"{START.format(name)}\n{table}\n{END}" for name, table in new.items()))
    else:
        DOCS.write_text(rewrite(DOCS.read_text(), new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
