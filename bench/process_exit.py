"""How long a process takes to end once its work is done: sys.exit against
megatron_kappa.parallel.launch_env.exit_process, after importing what a training process imports.

    python bench/process_exit.py [--reps 3] [--modules megatron.core deepspeed] [--json F]

Each rep starts a fresh process that imports the modules, prints the time and exits one way or
the other; the exit lag is the wall time from that print to the process's end, seen by this
process. Prints the median lag of each way and their ratio (the baseline is sys.exit, measured in
the same run).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = {"sys.exit": "sys.exit(0)",
        "exit_process": "from megatron_kappa.parallel.launch_env import exit_process; exit_process(0)"}


def exit_lag(modules: list[str], way: str) -> float:
    code = f"import sys, time; import {', '.join(modules)}; print(time.time(), flush=True); {WAYS[way]}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    printed = float(proc.stdout.readline())
    proc.wait()
    ended = time.time()
    if proc.returncode:
        raise SystemExit(f"the {way} process failed with status {proc.returncode}")
    return ended - printed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modules", nargs="+", default=["megatron.core", "deepspeed"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    lags = {way: [] for way in WAYS}
    for _ in range(args.reps):
        for way in WAYS:  # interleaved, so that a busy moment hits both ways
            lags[way].append(exit_lag(args.modules, way))
    median = {way: statistics.median(v) for way, v in lags.items()}
    for way, v in lags.items():
        print(f"{way:<14} exit lag median {median[way]:.2f} s  (reps: {', '.join(f'{x:.2f}' for x in v)})")
    ratio = median["exit_process"] / median["sys.exit"]
    print(f"exit_process / sys.exit: {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"modules": args.modules, "lags_s": lags, "median_s": median,
                                         "ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    from megatron_kappa.entry import start
    start()  # first: the known library notices filtered (megatron_kappa/entry.py)
    sys.exit(main())
