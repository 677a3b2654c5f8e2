"""Slurm: launch_env's parsing (no Slurm needed) and the sbatch scripts on a real one-node cluster
(tests/support/slurm_cluster.py; skipped, saying why, where Slurm is not installed or we are not root)."""
import json
import shutil
import sys
from pathlib import Path

import pytest

from megatron_kappa.parallel import launch_env
from megatron_kappa.parallel.launch_env import (
    LaunchEnv,
    LaunchEnvError,
    expand_hostlist,
    export,
    export_environment,
    first_host,
    from_environment,
    slurm_port,
    tasks_on_node,
)
from tests.support.slurm_cluster import slurm_cluster

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.serial  # the session's Slurm cluster (and a second one)


# ---- host lists ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, hosts", [
    ("localhost", ["localhost"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("node[098-101]", ["node098", "node099", "node100", "node101"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("gpu-[1-2]-ib", ["gpu-1-ib", "gpu-2-ib"]),
    ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("x[5]", ["x5"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts
    assert first_host(text, use_scontrol=False) == hosts[0]


@pytest.mark.parametrize("bad", ["node[1-2", "node1-2]", "node[a-b]", "node[3-1]", "", ","])
def test_expand_hostlist_rejects(bad):
    with pytest.raises(LaunchEnvError):
        expand_hostlist(bad)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol not installed")
def test_parser_agrees_with_scontrol(tmp_path, monkeypatch):
    import subprocess
    conf = tmp_path / "slurm.conf"  # scontrol wants a configuration even to expand host lists
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\n"
                    "PartitionName=p Nodes=localhost\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    for text in ("node[01-04,07]", "a1,b[2-3],c", "n[01-02],m[3-4]", "rack[1-2]-n[1,3]", "node[098-101]"):
        out = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True)
        assert out.stdout.split() == expand_hostlist(text), (text, out.stderr)
        assert first_host(text) == expand_hostlist(text)[0]


def test_tasks_on_node_and_port():
    assert [tasks_on_node("4(x2),3", i) for i in range(4)] == [4, 4, 3, None]
    assert tasks_on_node("2", 0) == 2
    assert tasks_on_node("weird", 0) is None
    assert slurm_port("123456") == 10000 + 123456 % 20000 == 13456
    assert 10000 <= slurm_port(2**31 - 1) < 30000


# ---- the environment ---------------------------------------------------------------------------

STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NODEID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_STEP_NODELIST": "gpu[07-08]"}


def test_plain_process_is_none():
    assert from_environment({}) is None
    assert from_environment({"PATH": "/bin"}) is None
    env = {"PATH": "/bin"}
    assert export_environment(env) is None and env == {"PATH": "/bin"}


def test_slurm_batch_shell_is_not_a_step():
    """The batch script has SLURM_PROCID=0 and the job's SLURM_NTASKS but is no srun task."""
    batch = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")}
    batch.update(SLURM_PROCID="0", SLURM_LOCALID="0")
    assert from_environment(batch) is None


def test_slurm_step():
    e = from_environment(STEP, use_scontrol=False)
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.source,
            e.local_world_size) == (5, 8, 1, "gpu07", 14242, "slurm", 4)
    assert e["world_size"] == 8 and dict(e)["rank"] == 5 and "master_port" in e  # mapping access
    # MASTER_ADDR / MASTER_PORT (set by the sbatch script or the user) win
    e = from_environment({**STEP, "MASTER_ADDR": "head", "MASTER_PORT": "23456"}, use_scontrol=False)
    assert (e.master_addr, e.master_port) == ("head", 23456)
    # older Slurm / salloc: no SLURM_STEP_NUM_TASKS or step node list
    old = {k: v for k, v in STEP.items() if k not in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST")}
    e = from_environment(old, use_scontrol=False)
    assert (e.world_size, e.master_addr) == (8, "gpu07")


def test_slurm_step_with_scontrol():
    e = from_environment({**STEP, "SLURM_STEP_NODELIST": "gpu[09,11]"})
    assert e.master_addr == "gpu09"


def test_launcher_variables_win_over_slurm():
    """torchrun / deepspeed inside an allocation: their variables describe the processes."""
    env = {**STEP, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29501", "LOCAL_WORLD_SIZE": "4"}
    e = from_environment(env)
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.source,
            e.local_world_size) == (3, 4, 3, "10.0.0.1", 29501, "launcher", 4)
    e = from_environment({"RANK": "0", "WORLD_SIZE": "1"})  # a world of one needs no address
    assert (e.master_addr, e.master_port, e.local_rank) == ("127.0.0.1", launch_env.DEFAULT_PORT, 0)


@pytest.mark.parametrize("env", [
    {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h"},              # rank >= world
    {"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h"},              # not an integer
    {"RANK": "1", "WORLD_SIZE": "2"},                                  # no rendezvous address
    {**STEP, "SLURM_PROCID": "8"},
    {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0"},                       # no task count
    {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "1"},  # no hosts
])
def test_inconsistent_environment_raises(env):
    with pytest.raises(LaunchEnvError):
        from_environment(env, use_scontrol=False)


def test_export():
    env = dict(STEP)
    e = export_environment(env, use_scontrol=False)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                "LOCAL_WORLD_SIZE")} == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "14242", "LOCAL_WORLD_SIZE": "4"}
    # the exported variables describe the same process (now as a launcher environment)
    assert from_environment(env) == LaunchEnv(5, 8, 1, "gpu07", 14242, "launcher", 4)
    out = {}
    export(e, out)
    assert out == e.as_env()


def test_free_port():
    """Free now, and below the ephemeral range: an outgoing connection cannot take it before the
    launcher binds it (the race that failed a study's evaluation with EADDRINUSE)."""
    import socket
    low, _ = launch_env.ephemeral_ports()
    ports = {launch_env.free_port() for _ in range(20)}
    assert len(ports) > 1 and all(max(1024, low - 8192) <= p < low for p in ports), (ports, low)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


# ---- a real cluster ----------------------------------------------------------------------------

# Stand-in for launch/pretrain.py: launch_env -> gloo group -> all-reduce; optionally waits for
# SIGUSR1 (first run only) and then for the requeue.
STANDIN = r'''
import json, os, signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))   # before the slow imports
from datetime import timedelta
import torch
import torch.distributed as dist
from megatron_kappa.parallel.launch_env import export_environment
def say(text):   # one write per line: the ranks share one pipe
    os.write(1, (text + "\n").encode())
env = export_environment()
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
t = torch.tensor([float(env.rank + 1)])
dist.all_reduce(t)
restart = os.environ.get("SLURM_RESTART_COUNT", "0")
say("RESULT " + json.dumps(dict(rank=env.rank, world=env.world_size, local_rank=env.local_rank,
    addr=env.master_addr, port=env.master_port, source=env.source, sum=t.item(),
    argv=sys.argv[1:], restart=restart, job=os.environ["SLURM_JOB_ID"])))
dist.barrier()
if os.environ.get("HOLD") and restart == "0":
    say(f"READY {env.rank}")
    deadline = time.time() + 180
    while not got and time.time() < deadline:
        time.sleep(0.1)
    say(f"USR1 {env.rank} {bool(got)}")
    time.sleep(600)   # "training on" until the test requeues the job
dist.destroy_process_group()
'''


def job_env(cluster, **extra):
    return {"PYTHON": sys.executable, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
            "TORCHDYNAMO_DISABLE": "1", **extra}


CPU_OPTS = ["--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"]


def results(text):
    return sorted((json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines()
                   if line.startswith("RESULT ")), key=lambda r: (r["restart"], r["rank"]))


@pytest.mark.slow
def test_cluster_runs_and_requeues_a_job(cluster, tmp_path):
    """The helper itself: srun tasks, exit codes, scontrol requeue of a running job."""
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH -n 2 --open-mode=append\n"
                      "echo start $SLURM_RESTART_COUNT\n"
                      "srun bash -c 'echo task $SLURM_PROCID/$SLURM_NTASKS; "
                      "[ \"${SLURM_RESTART_COUNT:-0}\" = 1 ] || sleep 300'\nexit 3\n")
    job = cluster.submit(script)
    out = cluster.wait_output(job, "task 1/2")
    assert cluster.state(job) == "RUNNING" and "task 0/2" in out
    restarts = cluster.requeue(job)
    assert cluster.wait(job, 60, restarts=restarts) == "FAILED"
    assert cluster.exit_code(job) == (3, 0)
    out = cluster.output(job)
    assert "start 1" in out and "DUE TO JOB REQUEUE" in out and out.count("task 1/2") == 2


@pytest.mark.slow
def test_pretrain_sbatch_srun(cluster, tmp_path):
    """pretrain.sbatch's srun path with 2 CPU tasks: ranks from Slurm's variables, a gloo
    all-reduce, SIGUSR1 reaching the ranks but not the batch shell, requeue and the run-dir log."""
    entry = tmp_path / "standin.py"
    entry.write_text(STANDIN)
    run_dir = tmp_path / "run"
    job = cluster.submit(ROOT / "launch/slurm/pretrain.sbatch", "--config", "configs/none.yaml",
                         "--set", f"run.dir={run_dir}", "train.steps=3",
                         options=CPU_OPTS, cwd=ROOT,
                         env=job_env(cluster, ENTRY=str(entry), HOLD="1"))
    cluster.wait_output(job, "READY 1", timeout=180)
    cluster.wait_output(job, "READY 0", timeout=30)
    cluster.signal(job, "USR1")  # as --signal=USR1@T does: the steps' processes
    cluster.wait_output(job, "USR1 1 True", timeout=30)
    assert "USR1 0 True" in cluster.wait_output(job, "USR1 0", timeout=30)
    assert cluster.state(job) == "RUNNING"  # the batch shell did not get it (it would have died)
    restarts = cluster.requeue(job)
    assert cluster.wait(job, 240, restarts=restarts) == "COMPLETED", cluster.output(job)
    assert cluster.exit_code(job) == (0, 0)

    log = run_dir / "logs" / f"slurm-{job}.out"
    assert log.exists(), list(run_dir.rglob("*"))
    text = log.read_text()
    res = results(text)
    assert [(r["restart"], r["rank"], r["local_rank"]) for r in res] == [
        ("0", 0, 0), ("0", 1, 1), ("1", 0, 0), ("1", 1, 1)], text
    for r in res:
        assert (r["world"], r["sum"], r["source"], r["addr"], r["port"]) == (
            2, 3.0, "slurm", cluster.node, 10000 + job % 20000)
        assert r["argv"] == ["--config", "configs/none.yaml", "--set", f"run.dir={run_dir}",
                             "train.steps=3"]
    assert "restart 1" in text and "exit status 0" in text
    assert text.count(f"=== log: {log}") == 2  # appended, not overwritten, by the second run
    assert "RESULT" in cluster.output(job)     # Slurm's own --output has the same text


@pytest.mark.slow
def test_pretrain_sbatch_deepspeed(cluster, tmp_path):
    """LAUNCHER=deepspeed: the deepspeed runner once, with a hostfile from the node list."""
    entry = tmp_path / "standin.py"
    entry.write_text(STANDIN)
    run_dir = tmp_path / "run"
    job = cluster.submit(ROOT / "launch/slurm/pretrain.sbatch", "--set", f"run.dir={run_dir}",
                         options=CPU_OPTS, cwd=ROOT,
                         env=job_env(cluster, ENTRY=str(entry), LAUNCHER="deepspeed"))
    assert cluster.wait(job, 300) == "COMPLETED", cluster.output(job)
    text = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert f"{cluster.node} slots=2" in text
    res = results(text)
    assert [(r["rank"], r["local_rank"]) for r in res] == [(0, 0), (1, 1)], text
    for r in res:
        assert (r["world"], r["sum"], r["source"], r["port"]) == (2, 3.0, "launcher", 10000 + job % 20000)
        assert r["argv"][-2:] == ["--set", f"run.dir={run_dir}"]


@pytest.mark.slow
def test_eval_sbatch(cluster, tmp_path):
    entry = tmp_path / "ev.py"
    entry.write_text("import os, sys\nos.write(1, f\"EVAL {os.environ['SLURM_PROCID']} "
                     "{os.environ['MASTER_ADDR']} {' '.join(sys.argv[1:])}\\n\".encode())\n")
    logs = tmp_path / "logs"
    job = cluster.submit(ROOT / "launch/slurm/eval.sbatch", str(entry), "--checkpoint", "runs/x",
                         options=CPU_OPTS, cwd=ROOT, env=job_env(cluster, LOG_DIR=str(logs)))
    bad = cluster.submit(ROOT / "launch/slurm/eval.sbatch", "nosuch", options=CPU_OPTS, cwd=ROOT,
                         env=job_env(cluster))
    assert cluster.wait(job, 120) == "COMPLETED", cluster.output(job)
    text = (logs / f"slurm-eval-{job}.out").read_text()
    assert f"EVAL 0 {cluster.node} --checkpoint runs/x" in text
    assert f"EVAL 1 {cluster.node} --checkpoint runs/x" in text
    assert cluster.wait(bad, 60) == "FAILED" and cluster.exit_code(bad) == (2, 0)
    assert "nosuch not found" in cluster.output(bad)


@pytest.mark.slow
def test_cleanup_leaves_nothing_and_spares_other_clusters(cluster, tmp_path):
    """A second cluster beside the module's: stopped by an exception with a job running, it
    leaves no process behind, and the first cluster goes on working."""
    script = tmp_path / "sleep.sh"
    script.write_text("#!/bin/bash\n#SBATCH -n 2\nsrun bash -c 'echo up $SLURM_PROCID; sleep 600'\n")
    with pytest.raises(RuntimeError, match="test failure"):
        with slurm_cluster(tmp_path / "second") as second:
            assert second.conf != cluster.conf
            job = second.submit(script)
            second.wait_output(job, "up 1")
            daemons = [p.pid for p in second._procs.values()]
            assert len(second._marked_pids()) >= 4  # slurmctld, slurmd, slurmstepd, tasks ...
            raise RuntimeError("test failure")
    assert second._marked_pids() == []
    for pid in daemons:
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    ok = tmp_path / "ok.sh"
    ok.write_text("#!/bin/bash\nsrun true\n")
    assert cluster.wait(cluster.submit(ok), 60) == "COMPLETED"
