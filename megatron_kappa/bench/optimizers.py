"""AdamW vs Muon vs Aurora at the demo's scale: losses and step time, as ratios against AdamW.

    python bench/optimizers.py [--steps 300] [--out runs/bench_optimizers] [--reuse] [--rounds 40]

1. Losses: the same job as `make demo` (configs/tiny.yaml on the bundled sample, κ-SwiGLU, EP2
   over 2 CPU processes through the deepspeed launcher, ZeRO-2, the same shards and the same
   steps), trained three times: `train.optimizer` adamw (the config's own settings: lr 3e-3, clip
   1.0), muon and aurora (train.muon defaults: lr 0.01, no clipping). These runs also log their
   step time (median over the logging windows after the first). On a shared machine that
   number moves with whatever else runs, so it is reported but not used for the ratio.
2. Step time: one process builds the three engines (same model, ZeRO-2, world of 1, one
   micro-batch of 4 × 128 tokens) and times full steps (forward, backward, optimizer) in
   interleaved rounds, so load from other jobs hits the three alike. It reports the median of
   each after `--warmup` rounds, and the ratio against AdamW.
--reuse keeps finished runs of step 1 instead of training again.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# after the environment above, which must be set before torch is first imported
from megatron_kappa.parallel.launch_env import free_port  # noqa: E402

METHODS = ("adamw", "muon", "aurora")


def method_overrides(method: str) -> list[str]:
    return [f"train.optimizer={method}"] + (["train.grad_clip=0"] if method != "adamw" else [])


def sh(cmd):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    subprocess.run([str(c) for c in cmd], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)


def prepare(data: Path):
    """The demo's data step (data prep reuses finished shards)."""
    sh([sys.executable, "data_prep/fineweb_edu.py", "--input", "data_prep/sample", "--output", data,
        "--train-tokenizer", "--vocab-size", "2048", "--language", "en", "--workers", "2",
        "--shard-tokens", "500000", "--valid-fraction", "0.02"])
    prefixes = json.loads((data / "manifest.json").read_text())["prefixes"]
    return ([p if os.path.isabs(p) else str(data / p) for p in prefixes[k]] for k in ("train", "valid"))


def train(method: str, run_dir: Path, data: Path, train_p, valid_p, steps: int, reuse: bool) -> list[dict]:
    metrics = run_dir / "metrics.jsonl"
    if reuse and metrics.exists() and json.loads(metrics.read_text().splitlines()[-1])["step"] == steps:
        return [json.loads(line) for line in metrics.read_text().splitlines()]
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resumed one
    sets = [f"run.dir={run_dir}", "data.mock=false", f"data.paths=[{','.join(train_p)}]",
            f"data.valid_paths=[{','.join(valid_p)}]", f"data.tokenizer={data / 'tokenizer.model'}",
            f"train.steps={steps}", "parallel.ep=2", "zero.stage=2", *method_overrides(method),
            f"log.interval={max(1, steps // 20)}", f"checkpoint.interval={steps}",
            f"eval.valid_every={max(1, steps // 4)}", "log.tensorboard=false"]
    sh([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", free_port(),
        "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set", *sets])
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def summarize(records: list[dict]) -> dict:
    tokens_per_step = records[0]["tokens_seen"] / records[0]["step"]
    step_ms = [1000 * tokens_per_step / r["tokens_per_s"] for r in records[1:]]
    return {"final_loss": statistics.mean(r["loss"] for r in records[-3:]),
            "valid": [(r["step"], r["valid_loss"]) for r in records if "valid_loss" in r],
            "run_step_ms": statistics.median(step_ms)}


def interleaved_step_ms(rounds: int, warmup: int) -> dict:
    """Full training steps of the three optimizers, timed in alternation in one process."""
    import torch
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_kappa.config import ParallelConfig, load_config
    from megatron_kappa.model.build import build_model
    from megatron_kappa.optim import muon, schedule
    from megatron_kappa.optim import optimizer as optim
    from megatron_kappa.parallel import engine as ds_engine
    from megatron_kappa.parallel.groups import init_distributed
    from megatron_kappa.train.loop import lm_loss

    device = init_distributed(ParallelConfig(), seed=1)
    engines, updates = {}, {}
    for method in METHODS:
        cfg = load_config("configs/tiny.yaml", method_overrides(method) + ["train.micro_batch=4",
                                                                           "train.global_batch=4"])
        torch.manual_seed(0)
        model = build_model(cfg, device)
        engine_settings = ds_engine.EngineSettings.of(cfg.train, cfg.zero, cfg.parallel, cfg.precision)
        engine, opt = ds_engine.initialize(model, optim.param_groups(model, cfg.train, cfg.model), engine_settings, 1,
                                           lambda groups: optim.build_optimizer(groups, cfg.train))
        schedule.set_learning_rates(opt, 10, 300, cfg.train, cfg.model)
        engines[method] = engine
        updates[method] = muon.update_fn(cfg.train) if method != "adamw" else None
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=device))
    tokens = torch.randint(0, 2048, (4, 129), generator=torch.Generator().manual_seed(0)).to(device)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(4, 128, device=device)}
    pos = torch.arange(128, device=device).expand(4, -1)
    times = {m: [] for m in METHODS}
    for r in range(warmup + rounds):
        for method in METHODS[r % 3:] + METHODS[:r % 3]:  # rotate the order every round
            if updates[method] is not None:
                muon.install(updates[method])  # process-wide: the method of the engine stepping
            start = time.perf_counter()
            engines[method].backward(lm_loss(engines[method], batch, pos))
            engines[method].step()
            if r >= warmup:
                times[method].append(1000 * (time.perf_counter() - start))
            get_moe_metrics_tracker().clear()
    muon.uninstall()
    return {m: statistics.median(t) for m, t in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="runs/bench_optimizers")
    ap.add_argument("--reuse", action="store_true", help="keep finished training runs")
    ap.add_argument("--rounds", type=int, default=40, help="timed rounds of interleaved steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed rounds first")
    args = ap.parse_args(argv)
    out = (ROOT / args.out).resolve()
    train_p, valid_p = prepare(out / "data")
    results = {}
    for method in METHODS:
        records = train(method, out / method, out / "data", train_p, valid_p, args.steps, args.reuse)
        results[method] = summarize(records)
        print(method, json.dumps(results[method]), flush=True)
    step_ms = interleaved_step_ms(args.rounds, args.warmup)
    print("interleaved step ms:", json.dumps(step_ms), flush=True)
    base, steps_logged = results["adamw"], [s for s, _ in results["adamw"]["valid"]]
    print("\n| optimizer | train loss (last 3 logs) | " + " | ".join(f"valid @{s}" for s in steps_logged)
          + " | valid vs AdamW | step ms (interleaved) | step time vs AdamW | step ms in the EP2 run |")
    print("|---|---|" + "---|" * len(steps_logged) + "---|---|---|---|")
    for method, r in results.items():
        print(f"| {method} | {r['final_loss']:.4f} | " + " | ".join(f"{v:.4f}" for _, v in r["valid"])
              + f" | {r['valid'][-1][1] - base['valid'][-1][1]:+.4f} | {step_ms[method]:.0f} | "
              f"{step_ms[method] / step_ms['adamw']:.2f} | {r['run_step_ms']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
