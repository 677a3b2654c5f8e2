"""The main job end to end (`make demo` at a reduced step count), its rerun, and evaluation of
its EP2 checkpoint with 1 and 2 processes."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_kappa.checkpoint.store import Checkpoints
from megatron_kappa.config import load_config
from megatron_kappa.evaluation.loading import load_for_eval, logits_fn_for
from megatron_kappa.model.build import build_model
from megatron_kappa.parallel.groups import current_device
from megatron_kappa.parallel.launch_env import free_port
from megatron_kappa.parallel.sharding import consolidate, load_full_state_dict

pytestmark = pytest.mark.slow  # every test runs or reads the 2-process demo

ROOT = Path(__file__).resolve().parents[1]


def env():
    inherited = {k: v for k, v in os.environ.items()
                 if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**inherited, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": str(ROOT)}


def run(cmd, timeout=900):
    done = subprocess.run([str(c) for c in cmd], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    stdout = run([sys.executable, "launch/demo.py", "--out", out, "--steps", "6", "--max-docs", "1500"])
    return out, stdout


def test_demo_pipeline_runs_and_reports(demo):
    out, stdout = demo
    summary = json.loads((out / "summary.json").read_text())
    valid = json.loads((out / "valid.json").read_text())
    core = json.loads((out / "core.json").read_text())
    records = [json.loads(line) for line in (out / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))  # log.interval = max(1, 6 // 20)
    # The summary reports what the evaluations and the training loop measured, not made-up numbers.
    assert summary["steps"] == 6 and summary["final_train_loss"] == records[-1]["loss"]
    assert summary["final_valid_loss"] == valid["loss"] and summary["valid_bits_per_byte"] == valid["bits_per_byte"]
    assert summary["core"] == core["core"] and len(core["tasks"]) == 7 and -1 <= core["core"] <= 1
    # A model that learned: below the uniform loss over the 2048-piece vocabulary, falling during
    # training, with bits per byte that agree with the loss (a few bytes per token).
    uniform = math.log(2048)
    assert records[0]["loss"] < uniform + 0.5 and valid["loss"] < uniform - 0.2
    assert records[-1]["loss"] < records[0]["loss"]
    assert 1.5 < valid["loss"] / math.log(2) / valid["bits_per_byte"] < 8
    assert valid["tokens"] > 1000 and valid["bytes"] > valid["tokens"]
    for figure in ("overview", "loss", "kappa", "alignment", "gate_bias", "alignment_final"):
        assert (out / f"run/plots/{figure}.png").stat().st_size > 1000, figure
    assert records[-1]["step"] == 6 and "core" in records[-1]  # the training loop's CORE subset
    assert any(k.startswith("kappa/layer") for k in records[-1])
    for word in ("run directory", "metrics", "TensorBoard", "checkpoints", "loss curve", "summary"):
        assert word in stdout


def test_checkpoint_stores_each_weight_once(demo):
    """The EP2 checkpoint: weights once (rank files), plus ZeRO's fp32 master copy and Adam's two
    moments: 4x the fp32 parameter bytes and a little metadata. Before: 5.1x (every rank's file
    held the whole module state on top of DeepSpeed's own model file)."""
    from megatron_kappa.summary import summarize
    out, _ = demo
    cfg = load_config(out / "run/config.yaml", ["parallel.ep=1"])
    fp32_bytes = 4 * summarize(cfg)["total_params"]
    folder = Checkpoints(out / "run").folder(6)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert 3.9 <= size / fp32_bytes <= 4.3, size / fp32_bytes


def test_demo_rerun_reuses_data_and_training(demo):
    out, _ = demo
    shard = out / "data/train_00000.bin"
    before = shard.stat().st_mtime_ns
    steps_before = (out / "run/metrics.jsonl").read_text()
    stdout = run([sys.executable, "launch/demo.py", "--out", out, "--steps", "6", "--max-docs", "1500"])
    assert shard.stat().st_mtime_ns == before
    assert "resumed from" in stdout
    assert (out / "run/metrics.jsonl").read_text() == steps_before


def test_checkpoint_evaluates_the_same_with_one_and_two_processes(demo, tmp_path):
    out, _ = demo
    def port():
        return str(free_port())
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2"]
    run(launcher + ["--master_port", port(), "eval/core.py", "--checkpoint", out / "run", "--bundle",
                    "tests/core_bundle", "--no-progress", "--json", tmp_path / "core2.json"])
    one = json.loads((out / "core.json").read_text())
    two = json.loads((tmp_path / "core2.json").read_text())
    assert [(t["task"], t["n"], t["accuracy"]) for t in one["tasks"]] == \
        [(t["task"], t["n"], t["accuracy"]) for t in two["tasks"]]
    valid = sorted(str(p)[:-4] for p in (out / "data").glob("valid_*.bin"))
    run(launcher + ["--master_port", port(), "eval/loss.py", "--checkpoint", out / "run", "--data", *valid,
                    "--no-progress", "--json", tmp_path / "valid2.json"])
    loss1 = json.loads((out / "valid.json").read_text())["loss"]
    loss2 = json.loads((tmp_path / "valid2.json").read_text())["loss"]
    assert abs(loss1 - loss2) < 1e-5


def test_consolidated_weights_negative_control(demo, world1):
    """Consolidating the EP2 checkpoint with the two expert ranks swapped changes the model."""
    out, _ = demo
    logits_fn, _, _ = load_for_eval(out / "run")
    tokens = torch.arange(64).reshape(2, 32) * 13 % 2000
    right = logits_fn(tokens)
    files = Checkpoints(out / "run").rank_files(6)
    for f in files:
        f["coords"]["ep"][0] = 1 - f["coords"]["ep"][0]
    cfg = load_config(out / "run/config.yaml", ["parallel.ep=1"])
    swapped = build_model(cfg, current_device()).eval()
    load_full_state_dict(swapped, consolidate([(f["coords"], f["weights"]) for f in files]))
    wrong = logits_fn_for(swapped, cfg.model.vocab_size)(tokens)
    assert (right - wrong).abs().max() > 1e-3


def test_tensor_parallel_checkpoint_evaluates_the_same_with_one_and_two_processes(demo, tmp_path):
    """A TP2 (sequence-parallel) checkpoint: the padded, TP-gathered logits in 2 processes and the
    consolidated model in 1 process give the same validation loss."""
    out, _ = demo
    def port():
        return str(free_port())
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2"]
    run_dir = tmp_path / "tp2"
    run(launcher + ["--master_port", port(), "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set",
                    f"run.dir={run_dir}", "train.steps=2", "parallel.tp=2", "data.mock=true",
                    f"data.tokenizer={out / 'data/tokenizer.model'}", "eval.valid_every=0"])
    valid = sorted(str(p)[:-4] for p in (out / "data").glob("valid_*.bin"))
    args = ["eval/loss.py", "--checkpoint", run_dir, "--data", *valid, "--no-progress", "--max-tokens", "3000"]
    run([sys.executable, *args, "--json", tmp_path / "one.json"])
    run(launcher + ["--master_port", port(), *args, "--json", tmp_path / "two.json"])
    one, two = (json.loads((tmp_path / f).read_text())["loss"] for f in ("one.json", "two.json"))
    assert abs(one - two) < 1e-5


def test_consolidate_cli_writes_weights_that_start_a_new_run(demo, tmp_path, world1):
    """launch/consolidate.py → train.init_weights: a one-process model from the EP2 checkpoint's
    consolidated file computes what the checkpoint does."""
    out, _ = demo
    run([sys.executable, "launch/consolidate.py", "--checkpoint", out / "run", "--output", tmp_path / "full.pt"])
    state = torch.load(tmp_path / "full.pt", weights_only=True)
    cfg = load_config(out / "run/config.yaml", ["parallel.ep=1"])
    model = build_model(cfg, current_device()).eval()
    load_full_state_dict(model, state)
    tokens = torch.arange(64).reshape(2, 32) * 7 % 2000
    expected, _, _ = load_for_eval(out / "run")
    torch.testing.assert_close(logits_fn_for(model, cfg.model.vocab_size)(tokens), expected(tokens))
    done = subprocess.run([sys.executable, "launch/consolidate.py", "--checkpoint", tmp_path, "--output",
                           tmp_path / "x.pt"], cwd=ROOT, env=env(), capture_output=True, text=True)
    assert done.returncode == 2 and "no complete checkpoint" in done.stderr
