"""The main command and evaluation on CUDA, against the same on the CPU from the same weights.

Marked `gpu`: skipped without CUDA (never faked; tests/test_device.py covers device placement
without a GPU). Each run is its own process on its own device: the CPU runs pin the CPU
(MEGATRON_KAPPA_DEVICE=cpu, DeepSpeed's CPU accelerator), the CUDA runs the GPU.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.compare import max_gap

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["data.mock=true", "model.seq_length=64", "train.micro_batch=2", "train.global_batch=4",
          "log.interval=1", "eval.valid_every=0", "log.tensorboard=false", "train.grad_clip=1.0",
          "model.kappa.freeze_fraction=0.25", "model.kappa.warmup=2", "train.deterministic=true"]


def env(device: str) -> dict:
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TRITON_INTERPRET")}
    path = os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**base, "PYTHONPATH": path, "MEGATRON_KAPPA_DEVICE": device,
            "DS_ACCELERATOR": "cpu" if device == "cpu" else "cuda", "OMP_NUM_THREADS": "1"}


def pretrain(run_dir, device, *sets, timeout=900):
    cmd = [sys.executable, "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set",
           f"run.dir={run_dir}", *COMMON, *sets]
    done = subprocess.run(cmd, cwd=ROOT, env=env(device), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def init_weights(tmp_path_factory):
    """Full weights shared by the CPU and CUDA runs (random init differs between devices)."""
    path = tmp_path_factory.mktemp("init") / "init.pt"
    code = ("import sys; sys.path.insert(0, 'tests'); from megatron_kappa.config import load_config; "
            "from megatron_kappa.parallel.groups import init_distributed; from weights import save_init_weights; "
            "cfg = load_config('configs/tiny.yaml', sys.argv[2:]); "
            "init_distributed(cfg.parallel, 3, cfg.model.moe.num_experts, device='cpu'); "
            "save_init_weights(sys.argv[1], sys.argv[2:])")
    done = subprocess.run([sys.executable, "-c", code, str(path), *COMMON], cwd=ROOT, env=env("cpu"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return path


def test_bf16_training_on_cuda_matches_cpu(init_weights, tmp_path):
    sets = ["train.steps=6", "precision=bf16", f"train.init_weights={init_weights}"]
    pretrain(tmp_path / "cpu", "cpu", *sets)
    pretrain(tmp_path / "cuda", "cuda", *sets)
    cpu, cuda = losses(tmp_path / "cpu"), losses(tmp_path / "cuda")
    assert len(cpu) == 6
    assert max_gap(cpu, cuda) <= 3e-2, (cpu, cuda)  # bf16 rounds differently on each device
    assert cuda[-1] < cuda[0]


def test_resume_on_cuda_is_exact(init_weights, tmp_path):
    sets = ["train.steps=6", "checkpoint.interval=2", f"train.init_weights={init_weights}"]
    cmd = [sys.executable, "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set",
           f"run.dir={tmp_path / 'killed'}", *COMMON, *sets]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env("cuda"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    marker = tmp_path / "killed/checkpoints/step_2/meta.json"
    deadline = time.time() + 600
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists()
    assert "resumed from" in pretrain(tmp_path / "killed", "cuda", *sets)
    pretrain(tmp_path / "straight", "cuda", *sets)
    assert losses(tmp_path / "killed") == losses(tmp_path / "straight")


def test_evaluation_on_cuda_matches_cpu(init_weights, tmp_path):
    run_dir = tmp_path / "run"
    pretrain(run_dir, "cpu", "train.steps=2", f"train.init_weights={init_weights}")
    tokens = [[5 + (i * 7 + j) % 2000 for j in range(150)] + [2] for i in range(8)]
    code = ("import json, sys, torch; from megatron_kappa.evaluation.loading import load_model_for_eval; "
            "from megatron_kappa.evaluation.lm_loss import validation_loss; "
            "fn, cfg = load_model_for_eval(sys.argv[1]); "
            "class Tok: bos, eod, pad = 1, 2, 3\n"
            "Tok.token_byte_lengths = lambda self: [0] * 4 + [2] * (cfg.model.vocab_size - 4)\n"
            "print(json.dumps(validation_loss(fn, json.loads(sys.argv[2]), Tok(), 64)))")
    results = {}
    for device in ("cpu", "cuda"):
        done = subprocess.run([sys.executable, "-c", code, str(run_dir), json.dumps(tokens)], cwd=ROOT,
                              env=env(device), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results[device] = json.loads(done.stdout.strip().splitlines()[-1])
    assert results["cpu"]["tokens"] == results["cuda"]["tokens"] > 1000
    assert abs(results["cpu"]["loss"] - results["cuda"]["loss"]) <= 1e-3 * results["cpu"]["loss"]
