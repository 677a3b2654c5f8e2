"""The planner's step-time estimate against measured step times on this machine (issue 37).

    python bench/plan_calibration.py [--steps 8] [--json out.json]

Trains a small MoE config in 9 layouts of 4 CPU processes (TP, EP, PP, DP and their mixes; one
torchrun launch runs them all, one after another), takes each layout's median step time after the
first two steps, and plans the same layouts (plan at its default rates, one
"node" of 4). The estimate's compute and traffic terms are then fitted to the measurements:
measured ≈ c + a · compute + b · traffic + d · messages (each with its bubble share), all ≥ 0, by
least squares (the CPU
calibration: gloo on one machine is one "link"; c is the per-step work the estimate leaves out:
the optimizer step, Python, launches). Prints each layout's measured and estimated seconds, the
fitted constants (as achieved TFLOP/s, GB/s and µs per message), and Spearman's rank correlation
of the measured step times with the planner's estimate at its default rates and at the fitted
ones, with Kendall's τ beside it and for a leave-one-out fit (each layout predicted by the
constants fitted on the other eight: the held-out agreement). The layouts' order, not their
absolute times, is what the planner's --search uses. `--measured earlier.json` refits without
training again (bench/plan_calibration_measured.json: the measurements docs/plan.md records).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WORLD = 4
SHAPE = ["data.mock=true", "model.hidden_size=128", "model.ffn_hidden_size=512", "model.moe.ffn_hidden_size=256",
         "model.num_layers=4", "model.seq_length=128", "train.micro_batch=2", "train.global_batch=16",
         "log.interval=1", "checkpoint.interval=1000", "eval.valid_every=0", "log.tensorboard=false",
         "precision=fp32"]
LAYOUTS = {  # name: (tp, pp, ep, etp)
    "dp4": (1, 1, 1, 1), "tp2_dp2": (2, 1, 1, 2), "tp4": (4, 1, 1, 4), "ep4": (1, 1, 4, 1),
    "ep2_dp2": (1, 1, 2, 1), "pp2_dp2": (1, 2, 1, 1), "pp4": (1, 4, 1, 1), "pp2_ep2": (1, 2, 2, 1),
    "tp2_ep2": (2, 1, 2, 1)}


def overrides(name: str, run_dir: Path, steps: int) -> list[str]:
    tp, pp, ep, etp = LAYOUTS[name]
    return [*SHAPE, f"train.steps={steps}", f"run.dir={run_dir / name}", f"parallel.tp={tp}", f"parallel.pp={pp}",
            f"parallel.ep={ep}", f"parallel.etp={etp}"]


def worker(plan_path: str):
    """Under torchrun: every layout's training, one after another."""
    from megatron_kappa.config import load_config
    from megatron_kappa.parallel import groups
    from megatron_kappa.parallel.launch_env import exit_process
    from megatron_kappa.train import loop
    for sets in json.loads(Path(plan_path).read_text()):
        loop.run(load_config("configs/tiny.yaml", sets), log=lambda *a, **k: None)
    groups.teardown()
    exit_process(0)


def measured_seconds(run_dir: Path, skip: int = 2) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens = records[0]["tokens_seen"]  # one step's tokens
    return statistics.median(tokens / r["tokens_per_s"] for r in records[skip:])


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for i, j in enumerate(order):
            r[j] = float(i)
        return r
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def kendall(x: list[float], y: list[float]) -> float:
    """Kendall's τ-b of two orderings: (concordant − discordant pairs) over the pairs not tied,
    ties in either counted as Kendall's τ-b does (1: the same order, −1: reversed, 0: unrelated)."""
    concordant = discordant = tied_x = tied_y = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tied_x += 1
            elif dy == 0:
                tied_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    pairs = ((concordant + discordant + tied_x) * (concordant + discordant + tied_y)) ** 0.5
    return (concordant - discordant) / pairs if pairs else float("nan")


def fit(rows: list[dict]) -> dict[str, float]:
    """Non-negative least squares of measured ≈ c + a·compute + b·traffic + d·messages (every
    subset of the columns; the best fit whose coefficients are all ≥ 0)."""
    import itertools

    import numpy as np
    y = np.array([r["measured"] for r in rows])
    cols = {"c": np.ones(len(rows)), **{k: np.array([r[k] for r in rows]) for k in ("compute", "traffic", "messages")}}
    best = None
    for k in range(1, 5):
        for names in itertools.combinations(cols, k):
            x = np.stack([cols[n] for n in names], axis=1)
            coef, *_ = np.linalg.lstsq(x, y, rcond=None)
            if (coef < 0).any():
                continue
            err = float(((x @ coef - y) ** 2).sum())
            if best is None or err < best[0]:
                best = (err, dict(zip(names, map(float, coef))))
    return {k: best[1].get(k, 0.0) for k in cols}


def terms(cfg, rates) -> dict:
    """The estimate's parts for one layout: compute, traffic (bandwidth only) and the number of
    messages, each with its share of the bubble (the bubble is a fraction of the busy time)."""
    from megatron_kappa import plan as planner

    def step(latency_us):
        r = dataclasses.replace(rates, latency_us=latency_us)
        p = planner.plan(cfg, planner.layout_of(cfg.parallel, WORLD), gpu_mem_gib=1e6, gpus_per_node=WORLD, rates=r)
        return p.speed
    zero, one = step(0.0), step(1e6)  # latency 1 s per message: the count of messages
    t = zero.terms
    gemms = t["compute"] + t["memory"]  # the memory-bound experts' excess is GEMM time too
    busy = gemms + t["tensor"] + t["context"] + t["expert"] + t["pipeline"]
    grow = 1 + t["bubble"] / busy
    def comm(s):
        return sum(s.terms[k] for k in ("tensor", "context", "expert", "pipeline", "data"))
    return {"compute": gemms * grow, "traffic": comm(zero) * grow, "messages": (comm(one) - comm(zero)) * grow,
            "estimated": step(rates.latency_us).seconds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--measured", help="reuse the measured times of an earlier --json instead of training")
    ap.add_argument("--json", help="write the rows and the fit here")
    args = ap.parse_args(argv)
    from megatron_kappa.config import load_config
    from megatron_kappa.parallel.launch_env import free_port
    from megatron_kappa.plan.speed import Rates
    if args.measured:
        measured = {r["layout"]: r["measured"] for r in json.loads(Path(args.measured).read_text())["rows"]}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            plan_path = tmp / "plan.json"
            plan_path.write_text(json.dumps([overrides(n, tmp, args.steps) for n in LAYOUTS]))
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "DS_ACCELERATOR": "cpu",
                   "PYTHONPATH": str(ROOT), "KAPPA_CALIBRATION_WORKER": "1"}
            print(f"training {len(LAYOUTS)} layouts on {WORLD} processes, {args.steps} steps each ...", flush=True)
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
                            f"--master_port={free_port()}", __file__, str(plan_path)], cwd=ROOT, env=env, check=True)
            measured = {name: measured_seconds(tmp / name) for name in LAYOUTS}
    configs = {name: load_config("configs/tiny.yaml", overrides(name, Path("/nonexistent"), args.steps))
               for name in LAYOUTS}
    defaults = Rates()
    rows = [{"layout": name, "measured": measured[name], **terms(configs[name], defaults)} for name in LAYOUTS]
    k = fit(rows)
    # the fitted coefficients as the planner's rates: a·compute at the default TFLOP/s = compute at
    # default / a, and so on; on one machine every group is "in a node" (NVLink's rate is used)
    fitted = Rates(tflops=defaults.tflops / k["compute"] if k["compute"] else 1e9,
                   nvlink_gbs=defaults.nvlink_gbs / k["traffic"] if k["traffic"] else 1e9,
                   ib_gbs=defaults.ib_gbs, latency_us=k["messages"] * 1e6,
                   hbm_tbs=defaults.hbm_tbs / k["compute"] if k["compute"] else 1e9)
    for i, r in enumerate(rows):
        r["fitted"] = linear(k, r)
        r["calibrated"] = terms(configs[r["layout"]], fitted)["estimated"]
        # held out: the constants fitted on the other layouts, this one predicted
        r["held_out"] = linear(fit(rows[:i] + rows[i + 1:]), r)
    measured_s = [r["measured"] for r in rows]
    before = spearman(measured_s, [r["estimated"] for r in rows])
    after = spearman(measured_s, [r["calibrated"] for r in rows])
    tau = {key: kendall(measured_s, [r[key] for r in rows]) for key in ("estimated", "calibrated", "held_out")}
    print(f"{'layout':<10}{'measured s':>12}{'default s':>12}{'calibrated s':>14}{'held out s':>12}"
          f"{'held out/measured':>19}{'messages':>10}")
    for r in rows:
        print(f"{r['layout']:<10}{r['measured']:>12.4f}{r['estimated']:>12.2e}{r['calibrated']:>14.4f}"
              f"{r['held_out']:>12.4f}{r['held_out'] / r['measured']:>19.2f}{r['messages']:>10.0f}")
    print(f"fit (on all {len(rows)} layouts: {', '.join(LAYOUTS)}): {k['c']:.4f} s per step not modelled; compute at "
          f"{fitted.tflops:.4g} TFLOP/s, traffic at {fitted.nvlink_gbs:.4g} GB/s, {fitted.latency_us:.4g} µs per "
          f"message; "
          "held out: each layout predicted by the fit on the other eight")
    print(f"Spearman rank correlation of the measured step times with the planner's estimate: {before:.2f} at its "
          f"default (GPU) rates, {after:.2f} at the fitted CPU rates")
    print(f"Kendall's τ of the measured step times with the estimate: {tau['estimated']:.2f} at the default (GPU) "
          f"rates, {tau['calibrated']:.2f} at the fitted CPU rates (in-sample), {tau['held_out']:.2f} held out")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "fit": k, "rates": dataclasses.asdict(fitted),
                                               "spearman": {"default": before, "fitted": after}, "kendall": tau},
                                              indent=1))
    return 0


def linear(k: dict, row: dict) -> float:
    """The fitted form c + a·compute + b·traffic + d·messages of one layout's terms."""
    return k["c"] + k["compute"] * row["compute"] + k["traffic"] * row["traffic"] + k["messages"] * row["messages"]


if __name__ == "__main__":
    if os.environ.get("KAPPA_CALIBRATION_WORKER") and len(sys.argv) == 2 and sys.argv[1].endswith(".json") \
            and os.environ.get("RANK") is not None:
        worker(sys.argv[1])
    else:
        sys.exit(main())
