"""Several hosts: launch/pretrain.py and the evaluation on a real 2-host cluster built from network
namespaces (tests/support/netns_cluster.py: two hosts, their own addresses, hostnames and hosts files,
one slurmd and one sshd each; skipped, saying why, without root, Slurm, sshd/pdsh or namespaces).

Every job runs configs/tiny.yaml on 4 CPU ranks, 2 per host, EP4 (experts and the dense data
parallelism both span the hosts), from the same initial weights, and is compared with one process
trained here. Each host's own name resolves to 127.0.1.1, as on a stock Debian/Ubuntu machine, so
every launch also checks that the ranks bind the interface that reaches the other host."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_kappa.config import load_config
from tests.support.compare import max_gap
from tests.support.netns_cluster import netns_cluster
from tests.support.slurm_cluster import FINAL_STATES
from tests.support.slurm_jobs import job_log, records, wait_for_steps
from tests.support.weights import save_init_weights

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # two hosts; a lost host is named by timing

ROOT = Path(__file__).resolve().parents[1]

STEPS = 12
MODEL = ["model.seq_length=32", "train.micro_batch=2", "train.global_batch=8", "model.kappa.warmup=2",
         "model.kappa.freeze_fraction=0.25", "zero.stage=2"]
COMMON = ["log.interval=1", "eval.valid_every=0", "log.tensorboard=false"]
NODES2 = ["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with netns_cluster(tmp_path_factory.mktemp("hosts"), sshd=True) as c:
        yield c
    # nothing of it is left: no namespace, no daemon, no rank (on either host)
    assert not any(Path("/run/netns", ns).exists() for ns in c.ns.values())
    assert c._marked_pids() == []


@pytest.fixture(scope="module")
def data_settings(sample_shards):
    return ["data.mock=false", f"data.paths=[{','.join(sample_shards['train'])}]",
            f"data.valid_paths=[{','.join(sample_shards['valid'])}]", f"data.tokenizer={sample_shards['tokenizer']}"]


@pytest.fixture(scope="module")
def init_weights(world1, tmp_path_factory):
    return save_init_weights(tmp_path_factory.mktemp("init") / "init.pt", MODEL)


def settings(data_settings, init_weights, run_dir, *more):
    return [*MODEL, *COMMON, *data_settings, f"train.steps={STEPS}", f"train.init_weights={init_weights}",
            f"run.dir={run_dir}", "checkpoint.interval=2", *more]


def job_env(hosts, **extra):
    return {"PYTHON": sys.executable, "PATH": f"{hosts.bin}:{hosts.env['PATH']}", **extra}


@pytest.fixture(scope="module")
def one_process(data_settings, init_weights, tmp_path_factory):
    """The reference: one process, the same weights, data and batches."""
    from megatron_kappa.train.loop import run
    run_dir = tmp_path_factory.mktemp("one") / "run"
    run(load_config("configs/tiny.yaml", settings(data_settings, init_weights, run_dir)), log=lambda *a, **k: None)
    return run_dir


def losses(run_dir):
    recs = records(run_dir)
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1)), recs
    return [r["loss"] for r in recs]


def assert_equal_to_one_process(run_dir, one_process, tol=1e-6):
    got, ref = losses(run_dir), losses(one_process)
    assert len(got) == STEPS
    assert max_gap(ref, got) <= tol, (ref, got)


def submit(hosts, sets, script="launch/slurm/pretrain.sbatch", options=NODES2, **env):
    return hosts.submit(ROOT / script, "--config", "configs/tiny.yaml", "--set", *sets, options=options,
                        cwd=ROOT, env=job_env(hosts, **env))


@pytest.fixture(scope="module")
def straight(hosts, data_settings, init_weights, tmp_path_factory):
    """sbatch --nodes=2: 4 srun tasks, uninterrupted."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    job = submit(hosts, settings(data_settings, init_weights, run_dir, "parallel.ep=4"))
    assert hosts.wait(job, 400) == "COMPLETED", hosts.output(job)[-4000:]
    return job, run_dir


def test_sbatch_two_hosts_equals_one_process(hosts, straight, one_process):
    job, run_dir = straight
    text = job_log(run_dir, job)
    assert "2 node(s) [node[1-2]], 4 task(s)" in text and f"rendezvous node1:{10000 + job % 20000}" in text
    assert_equal_to_one_process(run_dir, one_process)


# Stand-in rank: a gloo all-reduce over the step's tasks, with or without the interface choice.
GLOO = r'''
import gc, os, sys
from datetime import timedelta
import torch, torch.distributed as dist
from megatron_kappa.parallel import launch_env, network
found = launch_env.export_environment()
if sys.argv[1] == "choose":
    network.export_socket_interface(found)
dist.init_process_group("gloo", timeout=timedelta(seconds=20))
t = torch.tensor([float(found.rank + 1)])
dist.all_reduce(t)
os.write(1, f"SUM {found.rank} {t.item()} {os.environ.get('GLOO_SOCKET_IFNAME')}\n".encode())
# leave the group while the interpreter is alive (groups.teardown's reason): left to the exit,
# gloo's threads now and then took a rank down with SIGABRT after the sum was printed
dist.barrier()
dist.destroy_process_group()
gc.collect()
'''


def test_ranks_bind_the_interface_that_reaches_the_other_host(hosts, tmp_path):
    """Each host's name resolves to 127.0.1.1: left alone, gloo binds loopback and the ranks
    cannot connect (the negative control); with network.export_socket_interface they bind eth0."""
    script = tmp_path / "gloo.py"
    script.write_text(GLOO)
    step = ["srun", "--kill-on-bad-exit=1", "-N2", "--ntasks-per-node=2", "--time=2", sys.executable, script]
    ok = hosts.run(*step, "choose", host="ctl", timeout=180, check=False)
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-3000:]
    assert sorted(ok.stdout.split("\n"))[-4:] == [f"SUM {r} 10.0 eth0" for r in range(4)], ok.stdout
    assert "[node2] the ranks bind eth0 (10.77.0.12)" in ok.stderr and "resolves to 127.0.1.1" in ok.stderr
    bad = hosts.run(*step, "plain", host="ctl", timeout=180, check=False)
    assert bad.returncode != 0 and "SUM" not in bad.stdout, bad.stdout
    assert "127.0.1.1" in bad.stderr, bad.stderr[-3000:]


def pretrain_args(sets):
    return ["launch/pretrain.py", "--config", "configs/tiny.yaml", "--set", *sets]


def run_on_hosts(hosts, commands: dict, tmp_path, env, timeout=400):
    """Start one command per host at once; wait for all; {host: (status, output)}."""
    procs = {h: hosts.popen(*cmd, host=h, cwd=ROOT, env=env, log=tmp_path / f"{h}.log") for h, cmd in commands.items()}
    deadline = time.monotonic() + timeout
    for p in procs.values():
        p.wait(max(1, deadline - time.monotonic()))
    return {h: (p.returncode, (tmp_path / f"{h}.log").read_text(errors="replace")) for h, p in procs.items()}


def test_torchrun_two_hosts_equals_one_process(hosts, data_settings, init_weights, one_process, tmp_path):
    """torchrun --nnodes 2 with the c10d rendezvous on node1, started on each host."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "node1:29400", "--rdzv-id", "kappa-test",
           *pretrain_args(settings(data_settings, init_weights, run_dir, "parallel.ep=4"))]
    done = run_on_hosts(hosts, {h: cmd for h in hosts.hosts}, tmp_path, job_env(hosts))
    assert all(rc == 0 for rc, _ in done.values()), {h: out[-3000:] for h, (_, out) in done.items()}
    assert "[node2] the ranks bind eth0" in done["node2"][1]
    assert_equal_to_one_process(run_dir, one_process)


def test_deepspeed_hostfile_two_hosts_equals_one_process(hosts, data_settings, init_weights, one_process,
                                                         tmp_path):
    """deepspeed --hostfile on node1: its pdsh starts both hosts' ranks over ssh; the other host's
    ranks get the environment from DeepSpeed's environment file (DS_ENV_FILE)."""
    run_dir = tmp_path / "run"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=2\nnode2 slots=2\n")
    envfile = tmp_path / "deepspeed_env"
    envfile.write_text("".join(f"{k}={os.environ[k]}\n" for k in
                               ("DS_ACCELERATOR", "MEGATRON_KAPPA_DEVICE", "OMP_NUM_THREADS", "TORCHDYNAMO_DISABLE",
                                "TRITON_INTERPRET")))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", hostfile, "--master_addr", "node1",
           "--master_port", "29600", *pretrain_args(settings(data_settings, init_weights, run_dir, "parallel.ep=4"))]
    done = run_on_hosts(hosts, {"node1": cmd}, tmp_path, job_env(hosts, DS_ENV_FILE=str(envfile)))
    rc, out = done["node1"]
    assert rc == 0, out[-4000:]
    assert "pdsh" in out and "node2: " in out, out[-3000:]
    assert_equal_to_one_process(run_dir, one_process)


def test_sbatch_deepspeed_launcher_two_hosts_equals_one_process(hosts, data_settings, init_weights,
                                                                 one_process, tmp_path):
    """LAUNCHER=deepspeed sbatch --nodes=2: the runner on node1 with a hostfile of the job's nodes,
    pdsh to node2, the environment file written by launch/slurm/common.sh."""
    run_dir = tmp_path / "run"
    job = submit(hosts, settings(data_settings, init_weights, run_dir, "parallel.ep=4"), LAUNCHER="deepspeed")
    assert hosts.wait(job, 400) == "COMPLETED", hosts.output(job)[-4000:]
    text = job_log(run_dir, job)
    assert "node1 slots=2" in text and "node2 slots=2" in text and "DS_ACCELERATOR" in text, text[-3000:]
    assert_equal_to_one_process(run_dir, one_process)


def test_warning_signal_on_two_hosts_requeues_and_resumes_exactly(hosts, straight, data_settings,
                                                                   init_weights, tmp_path):
    """SIGUSR1 to every rank on both hosts mid-run (what --signal=USR1@N sends): they stop after
    the same step with a checkpoint, the job is requeued and its second run ends with the
    uninterrupted job's losses."""
    run_dir = tmp_path / "run"
    job = submit(hosts, settings(data_settings, init_weights, run_dir, "parallel.ep=4"))
    wait_for_steps(hosts, job, run_dir, 2)
    hosts.signal(job, "USR1")
    deadline = time.monotonic() + 240
    while int(hosts.show(job).get("Restarts", "0")) < 1:
        assert hosts.state(job) not in FINAL_STATES and time.monotonic() < deadline, hosts.output(job)[-4000:]
        time.sleep(0.3)
    assert hosts.wait(job, 400, restarts=1) == "COMPLETED", hosts.output(job)[-4000:]
    text = job_log(run_dir, job)
    stops = [line for line in text.splitlines() if "stopped at step" in line]
    assert len(stops) == 1 and "on SIGUSR1" in stops[0], text[-4000:]
    stopped = int(stops[0].split("stopped at step ")[1].split("/")[0])
    assert 2 <= stopped < STEPS, text[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step_{stopped}" in text and "restart 1" in text
    assert max_gap(losses(straight[1]), losses(run_dir)) <= 1e-6


def pretrain_pids(hosts, host):
    return [p for p in hosts.host_pids(host)
            if b"launch/pretrain.py" in Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")]


def test_lost_host_ends_the_job_naming_it_and_a_resubmission_resumes(hosts, straight, data_settings,
                                                                      init_weights, tmp_path):
    """A host whose ranks are killed, then (in the resubmitted job) a host whose link goes down:
    each job ends within a bound, naming node2, the checkpoints already written stay, and the
    third submission of the same command resumes and ends with the uninterrupted job's losses."""
    run_dir = tmp_path / "run"
    sets = settings(data_settings, init_weights, run_dir, "parallel.ep=4", "parallel.timeout_s=15")
    opts = [*NODES2, "--no-requeue"]  # resubmitted by hand here (with --requeue Slurm requeues it)

    job = submit(hosts, sets, options=opts)
    wait_for_steps(hosts, job, run_dir, 3)
    t0 = time.monotonic()
    for pid in pretrain_pids(hosts, "node2"):
        os.kill(pid, signal.SIGKILL)
    assert hosts.wait(job, 120) == "FAILED", hosts.output(job)[-3000:]
    took = time.monotonic() - t0
    text = job_log(run_dir, job)
    # srun's own report ("node2: tasks 2-3: Killed", or task by task) or the survivors' roll call,
    # whichever reached the log first: the first host named is the lost one, never node1
    first = re.search(r"srun: error: (node\d): tasks? [\d-]+: Killed|gone \(on (node\d)", text)
    assert first and "node2" in first.groups(), text[-3000:]
    kept = sorted((run_dir / "checkpoints").glob("step_*"))
    assert kept, "no checkpoint before the failure"

    job = submit(hosts, sets, options=opts)
    resumed = f"resumed from {kept[-1]}"
    hosts.wait_output(job, resumed, timeout=240)
    wait_for_steps(hosts, job, run_dir, int(kept[-1].name.split("_")[1]) + 1)
    t1 = time.monotonic()
    hosts.link("node2", up=False)
    try:
        state = hosts.wait(job, 150)
        took_link = time.monotonic() - t1
    finally:
        hosts.link("node2", up=True)
    text = job_log(run_dir, job) + hosts.output(job)
    assert state in ("FAILED", "NODE_FAIL"), text[-3000:]
    after = text.split(resumed, 1)[1]  # Slurm's node timeout or rank 0's barrier, whichever is first
    assert "Node failure on node2" in after or "(on node2: ranks 2, 3)" in after, after[-3000:]
    assert all(k.exists() for k in kept)

    hosts.wait_idle()
    job = submit(hosts, sets, options=opts)
    assert hosts.wait(job, 400) == "COMPLETED", hosts.output(job)[-4000:]
    assert "resumed from" in job_log(run_dir, job)
    assert max_gap(losses(straight[1]), losses(run_dir)) <= 1e-6
    print(f"killed ranks: job ended after {took:.1f} s; link down: after {took_link:.1f} s")


def test_eval_sbatch_two_hosts_equals_one_process(hosts, straight, sample_shards, tmp_path):
    """launch/slurm/eval.sbatch loss on 4 ranks over the 2 hosts: the batches split over the
    ranks give the loss one process computes on the same checkpoint."""
    _, run_dir = straight
    args = ["--checkpoint", run_dir, "--data", *sample_shards["valid"], "--max-tokens", "3000", "--no-progress"]
    job = hosts.submit(ROOT / "launch/slurm/eval.sbatch", "loss", *args, "--json", tmp_path / "hosts.json",
                       options=NODES2, cwd=ROOT, env=job_env(hosts))
    assert hosts.wait(job, 300) == "COMPLETED", hosts.output(job)[-4000:]
    one = subprocess.run([sys.executable, "eval/loss.py", *map(str, args), "--json", tmp_path / "one.json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("hosts", "one"))
    assert a["tokens"] == b["tokens"] > 0
    assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"]), (a, b)
