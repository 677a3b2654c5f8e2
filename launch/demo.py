"""The main job on the embedded default, on CPU (`make demo`):

  1. prepare the bundled FineWeb-Edu-shaped sample into Megatron shards, training a small
     SentencePiece tokenizer (data_prep/fineweb_edu.py);
  2. train configs/tiny.yaml with κ-SwiGLU and expert parallelism over 2 CPU processes through
     the `deepspeed` launcher, ZeRO-2, logging a quick CORE subset (launch/pretrain.py);
  3. evaluate validation loss / bits per byte and the small CORE-format bundle (eval/);
  4. write a summary (final numbers, κ statistics) and the run's figures (analysis/plots.py: the
     loss curve beside κ's spread, κ dynamics, router-gate alignment, ...) and print where
     everything is.

Every stage reuses finished work: a second run reuses the shards, resumes training from its last
checkpoint (or skips it when done) and only re-evaluates.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_kappa.entry import start

ROOT = Path(__file__).resolve().parents[1]

start()  # first: the known library notices filtered before the imports below can print (megatron_kappa/entry.py)

from megatron_kappa.analysis.plots import make_plots  # noqa: E402
from megatron_kappa.cli_types import positive_int  # noqa: E402
from megatron_kappa.metrics.log import read_records  # noqa: E402
from megatron_kappa.parallel.launch_env import free_port  # noqa: E402

BUNDLE = ROOT / "tests" / "core_bundle"


def stage(title: str):
    print(f"\n== {title}", flush=True)


def sh(cmd: list[str], **kw):
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    subprocess.run([str(c) for c in cmd], cwd=ROOT, env=env, check=True, **kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/demo", help="where data, run and summary go")
    ap.add_argument("--steps", type=positive_int, default=300, help="training steps")
    ap.add_argument("--max-docs", type=positive_int, default=None, help="use only this many documents")
    args = ap.parse_args(argv)
    out = (ROOT / args.out).resolve()
    data, run_dir = out / "data", out / "run"
    started = time.time()
    py = sys.executable

    stage("1/4 data: bundled sample → SentencePiece (vocab 2048) → Megatron shards")
    prep = [py, "data_prep/fineweb_edu.py", "--input", "data_prep/sample", "--output", data,
            "--train-tokenizer", "--vocab-size", "2048", "--language", "en", "--workers", "2",
            "--shard-tokens", "500000", "--valid-fraction", "0.02"]
    if args.max_docs:
        prep += ["--max-docs", str(args.max_docs)]
    sh(prep)
    manifest = json.loads((data / "manifest.json").read_text())
    train_prefixes, valid_prefixes = manifest["prefixes"]["train"], manifest["prefixes"]["valid"]
    def resolve(p):
        return str(data / p) if not os.path.isabs(p) else p
    train_prefixes = [resolve(p) for p in train_prefixes]
    valid_prefixes = [resolve(p) for p in valid_prefixes]

    stage(f"2/4 train: configs/tiny.yaml, κ-SwiGLU, EP2 × 2 CPU processes, ZeRO-2, {args.steps} steps "
          f"(κ: frozen for 10 %, then a {max(1, args.steps // 10)}-step warmup)")
    sets = [f"run.dir={run_dir}", "run.name=demo", "data.mock=false", f"data.paths=[{','.join(train_prefixes)}]",
            f"data.valid_paths=[{','.join(valid_prefixes)}]", f"data.tokenizer={data / 'tokenizer.model'}",
            f"train.steps={args.steps}", "parallel.ep=2", "zero.stage=2",
            # κ's schedule scaled to the run: the recipe's 1000-iteration κ warmup would outlast it
            # (the L2 penalty is the paper's λ on the per-layer mean, as the authors compute it)
            f"model.kappa.warmup={max(1, args.steps // 10)}",
            f"log.interval={max(1, args.steps // 20)}", f"checkpoint.interval={max(1, args.steps // 4)}",
            f"eval.valid_every={max(1, args.steps // 4)}", f"eval.core_every={args.steps}",
            f"eval.core_bundle={BUNDLE}", "eval.core_max_per_task=20"]
    # kappa-deepspeed: the runner at --log_level warning (its INFO lines: world info, each rank's full
    # command; the command is above), its known notices dropped, Ctrl-C in one line
    sh([py, "-m", "megatron_kappa.cli.launcher", "deepspeed", "--num_gpus", "2",
        "--master_port", str(free_port()),
        "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set", *sets])

    stage("3/4 evaluate: validation loss / bits per byte, CORE bundle (one process, weights consolidated)")
    sh([py, "eval/loss.py", "--checkpoint", run_dir, "--data", *valid_prefixes, "--no-progress",
        "--json", out / "valid.json"])
    sh([py, "eval/core.py", "--checkpoint", run_dir, "--bundle", BUNDLE, "--no-progress",
        "--json", out / "core.json"])

    stage("4/4 summary")
    records, _ = read_records(run_dir / "metrics.jsonl")
    plots = make_plots(run_dir)  # overview.png: the loss curve beside κ's spread; one PNG per figure
    valid, core = json.loads((out / "valid.json").read_text()), json.loads((out / "core.json").read_text())
    last = records[-1]
    summary = {
        "steps": last["step"], "final_train_loss": last["loss"], "final_valid_loss": valid["loss"],
        "valid_bits_per_byte": valid["bits_per_byte"], "core": core["core"],
        "core_no_boolq": core["core_no_boolq"], "tokens_per_s": last["tokens_per_s"],
        "tokens_seen": last["tokens_seen"], "kappa": {k: v for k, v in last.items() if k.startswith("kappa")},
        "wall_s": round(time.time() - started, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    layers = sorted({k.split("/")[1] for k in summary["kappa"] if k.startswith("kappa/layer")})
    spread = "  ".join(f"{layer} {last[f'kappa/{layer}/bottom5']:.2f}–{last[f'kappa/{layer}/top5']:.2f}"
                       for layer in layers if f"kappa/{layer}/bottom5" in last)
    print(f"""step {summary['steps']}: train loss {summary['final_train_loss']:.4f}, \
{summary['tokens_seen']:,} tokens at {summary['tokens_per_s']:.0f} tokens/s
valid loss {valid['loss']:.4f} over the whole validation split ({valid['tokens']:,} tokens; \
the step line's valid is a sample), {valid['bits_per_byte']:.4f} bits/byte
CORE {core['core']:.4f} ({len(core['tasks'])} tasks; without BoolQ {core['core_no_boolq']:.4f})
κ 5–95 % per MoE layer  {spread}

run directory   {run_dir}
metrics         {run_dir / 'metrics.jsonl'}
TensorBoard     tensorboard --logdir {run_dir / 'tb'}
checkpoints     {run_dir / 'checkpoints'}
loss curve + κ  {run_dir / 'plots/overview.png'}
plots           {run_dir / 'plots'} ({', '.join(p.name for p in plots)})
summary         {out / 'summary.json'}
(done in {summary['wall_s']} s)""", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
