"""Helpers for tests that run launch/pretrain.py as Slurm jobs (one host or several)."""
import json
import time
from pathlib import Path


def records(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def job_log(run_dir, job):
    return (Path(run_dir) / "logs" / f"slurm-{job}.out").read_text(errors="replace")


def wait_for_steps(cluster, job, run_dir, n, timeout=240):
    deadline = time.monotonic() + timeout
    while len(records(run_dir)) < n:
        assert time.monotonic() < deadline and cluster.state(job) in ("PENDING", "RUNNING"), \
            f"job {job}: {len(records(run_dir))} steps logged, state {cluster.state(job)}\n" \
            f"{cluster.output(job)[-3000:]}"
        time.sleep(0.2)


def rank_pid(job, rank) -> int:
    """The pid of srun task `rank` of `job` (launch/pretrain.py), from its environment."""
    want = {f"SLURM_JOB_ID={job}".encode(), f"SLURM_PROCID={rank}".encode(), b"SLURM_STEP_ID=0"}
    for d in Path("/proc").iterdir():
        try:
            env = set((d / "environ").read_bytes().split(b"\0"))
            if d.name.isdigit() and want <= env and b"pretrain.py" in (d / "cmdline").read_bytes():
                return int(d.name)
        except OSError:
            continue
    raise AssertionError(f"no process of job {job} with SLURM_PROCID={rank}")
