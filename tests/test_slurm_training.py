"""launch/slurm/pretrain.sbatch running the real launch/pretrain.py on a real one-node Slurm
(tests/support/slurm_cluster.py; skipped, saying why, without Slurm or root): 2 CPU tasks training
configs/tiny.yaml; the time-limit warning, a checkpoint, the requeue and an exact resume; a dead
rank and a hung rank ending the job with the rank named."""
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from megatron_kappa.config import load_config
from tests.support.compare import max_gap
from tests.support.slurm_cluster import FINAL_STATES
from tests.support.slurm_jobs import job_log, rank_pid, records, wait_for_steps
from tests.support.weights import save_init_weights

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # every test runs jobs on the Slurm cluster

ROOT = Path(__file__).resolve().parents[1]

STEPS = 24
SETTINGS = ["data.mock=true", "log.interval=1", "checkpoint.interval=100", "eval.valid_every=0",
            "model.seq_length=32", "train.micro_batch=2", "train.global_batch=4",
            "log.tensorboard=false", "model.kappa.freeze_fraction=0.25", "model.kappa.warmup=2",
            "zero.stage=2"]
CPU_OPTS = ["--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"]


@pytest.fixture(scope="module")
def init_weights(world1, tmp_path_factory):
    """Full-layout initial weights for every run here (random init depends on the layout)."""
    return save_init_weights(tmp_path_factory.mktemp("init") / "init.pt", SETTINGS)


def settings(init_weights, run_dir, *more):
    return SETTINGS + [f"train.steps={STEPS}", f"train.init_weights={init_weights}", f"run.dir={run_dir}",
                       *more]


def submit(cluster, sets, **env):
    return cluster.submit(ROOT / "launch/slurm/pretrain.sbatch", "--config", "configs/tiny.yaml",
                          "--set", *sets, options=CPU_OPTS, cwd=ROOT,
                          env={"PYTHON": sys.executable, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                               "TORCHDYNAMO_DISABLE": "1", **env})


def skip_if_two_hosts(test: str):
    """Where a 2-host cluster can be built, tests/test_multinode.py runs the same job across two
    hosts (a superset of this one-host version): skip the one-host run there."""
    from tests.support.netns_cluster import missing_reason
    if missing_reason(sshd=True) is None:
        pytest.skip(f"covered on two hosts by tests/test_multinode.py::{test}")


@pytest.fixture(scope="module")
def straight(cluster, init_weights, tmp_path_factory):
    """One uninterrupted 2-task job: the reference for the preempted one."""
    skip_if_two_hosts("test_sbatch_two_hosts_equals_one_process")
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    job = submit(cluster, settings(init_weights, run_dir))
    assert cluster.wait(job, 400) == "COMPLETED", cluster.output(job)[-4000:]
    return job, run_dir


def test_pretrain_job_on_two_tasks(cluster, straight, init_weights, tmp_path):
    """The 2-task job trains the whole run (data parallel over 2 ranks, one rendezvous from
    Slurm's variables) and matches one process trained in this test from the same weights."""
    from megatron_kappa.train.loop import run
    job, run_dir = straight
    assert cluster.exit_code(job) == (0, 0)
    recs = records(run_dir)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in recs) and recs[-1]["loss"] < recs[0]["loss"]
    meta = json.loads((run_dir / f"checkpoints/step_{STEPS}/meta.json").read_text())
    assert meta["layout"]["world"] == 2  # not two worlds of one
    text = job_log(run_dir, job)
    assert f"rendezvous {cluster.node}:{10000 + job % 20000}" in text and "exit status 0" in text
    one = tmp_path / "one"
    run(load_config("configs/tiny.yaml", settings(init_weights, one)), log=lambda *a, **k: None)
    assert max_gap([r["loss"] for r in records(one)], [r["loss"] for r in recs]) <= 1e-5


def test_warning_signal_checkpoints_requeues_and_resumes_exactly(cluster, straight, init_weights,
                                                                  tmp_path):
    """SIGUSR1 to the ranks mid-run (what --signal=USR1@N sends before the time limit): they stop
    after the same step with a checkpoint, exit 75, the batch script requeues the job, and the
    second run resumes and ends with the losses of the uninterrupted job."""
    run_dir = tmp_path / "run"
    job = submit(cluster, settings(init_weights, run_dir))
    wait_for_steps(cluster, job, run_dir, 2)
    cluster.signal(job, "USR1")  # every task of the job's steps, as Slurm's warning
    deadline = time.monotonic() + 240
    while int(cluster.show(job).get("Restarts", "0")) < 1:  # requeued (or fail without waiting)
        assert cluster.state(job) not in FINAL_STATES and time.monotonic() < deadline, \
            f"job {job} not requeued: {cluster.state(job)}\n{cluster.output(job)[-4000:]}"
        time.sleep(0.3)
    assert cluster.wait(job, 400, restarts=1) == "COMPLETED", cluster.output(job)[-4000:]
    assert cluster.exit_code(job) == (0, 0)
    text = job_log(run_dir, job)
    stops = [line for line in text.splitlines() if "stopped at step" in line]
    assert len(stops) == 1 and "on SIGUSR1" in stops[0], text[-4000:]
    stopped = int(stops[0].split("stopped at step ")[1].split("/")[0])
    assert 2 <= stopped < STEPS, f"the signal came too late to interrupt the run\n{text[-3000:]}"
    assert "exit status 75" in text and f"scontrol requeue {job}" in text
    assert f"resumed from {run_dir}/checkpoints/step_{stopped}" in text and "restart 1" in text
    recs = records(run_dir)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    ref = records(straight[1])
    assert max_gap([r["loss"] for r in ref], [r["loss"] for r in recs]) <= 1e-6


def test_dead_rank_ends_the_job_naming_it(cluster, init_weights, tmp_path):
    """Rank 1 killed (SIGKILL) mid-run: the job fails at once (srun --kill-on-bad-exit; gloo
    sees the closed connection), and the log names the task; not the time limit, not 30 min."""
    skip_if_two_hosts("test_lost_host_ends_the_job_naming_it_and_a_resubmission_resumes")
    run_dir = tmp_path / "run"
    job = submit(cluster, settings(init_weights, run_dir, "train.steps=5000", "parallel.timeout_s=60"))
    wait_for_steps(cluster, job, run_dir, 1)
    os.kill(rank_pid(job, 1), signal.SIGKILL)
    assert cluster.wait(job, 120) == "FAILED", cluster.output(job)[-3000:]  # bounded
    text = job_log(run_dir, job)
    assert f"srun: error: {cluster.node}: task 1: Killed" in text, text[-3000:]
    # rank 0 usually says more before srun ends it ("a collective failed (... Connection reset by
    # peer); ... a rank has died"), but srun's SIGTERM may come first: not asserted


def test_hung_rank_ends_the_job_naming_it(cluster, init_weights, tmp_path):
    """Rank 1 stopped (SIGSTOP: alive, never at the next collective): rank 0's collective times
    out after parallel.timeout_s, it names rank 1 (a monitored barrier on a gloo group of its own) and
    exits, and srun ends the job."""
    run_dir = tmp_path / "run"
    job = submit(cluster, settings(init_weights, run_dir, "train.steps=5000", "parallel.timeout_s=20"))
    wait_for_steps(cluster, job, run_dir, 1)
    os.kill(rank_pid(job, 1), signal.SIGSTOP)
    assert cluster.wait(job, 150) == "FAILED", cluster.output(job)[-3000:]  # bounded: ~2 × 20 s
    text = job_log(run_dir, job)
    assert ("error: rank 0: a collective failed (Timed out waiting 20000ms for"
            in text), text[-3000:]
    assert "[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 20000 ms" in text, text[-3000:]
