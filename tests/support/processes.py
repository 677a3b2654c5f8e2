"""Launching training processes from a test: the environment a launched rank gets, DeepSpeed's
launcher command, a free port, and the records a run writes (metrics.jsonl)."""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def env():
    inherited = {k: v for k, v in os.environ.items()
                 if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**inherited, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": str(ROOT)}


def deepspeed_cmd(script, *args, port):
    # kappa-deepspeed: the runner with its one-line Ctrl-C (megatron_kappa/cli/launcher.py)
    return [sys.executable, "-m", "megatron_kappa.cli.launcher", "deepspeed", "--num_gpus", "2", "--master_port",
            str(port), str(script), *args]


def free_port():
    from megatron_kappa.parallel.launch_env import free_port as fp
    return fp()
