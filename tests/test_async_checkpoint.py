"""checkpoint.async_save: background checkpoints hold what synchronous ones hold, and a failed
or interrupted background save leaves the previous checkpoint `latest` and resumes exactly."""
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_kappa.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["data.mock=true", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=2",
         "log.tensorboard=false", "eval.valid_every=0", "log.interval=1", "checkpoint.interval=1",
         "checkpoint.keep=10"]


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train(run_dir, *sets, log=lambda *a: None):
    from megatron_kappa.train import loop
    return loop.run(load_config("configs/tiny.yaml", [*TRAIN, f"run.dir={run_dir}", *sets]), log=log)


def rank_file(run_dir, step):
    return torch.load(Path(run_dir) / f"checkpoints/step_{step}/rank_0.pt", weights_only=False)


def differences(a, b, where="") -> list[str]:
    """Where two saved states differ (tensors bit for bit, everything else by ==)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a.keys() ^ b.keys())}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if torch.is_tensor(a):
        return [] if torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b) else [where]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    try:
        return [] if a == b else [where]
    except Exception:  # numpy arrays inside the random states
        import numpy as np
        return [] if np.array_equal(a, b) else [where]


@pytest.fixture
def write_after_the_next_step(monkeypatch):
    """Each background write starts only once training has run the next step (its thread waits
    for the next checkpoint step's, or the end's, wait): what it writes must be the snapshot."""
    from megatron_kappa.checkpoint import async_save
    from megatron_kappa.checkpoint.store import Checkpoints
    gate, real_write, real_wait = threading.Event(), Checkpoints._write, async_save.AsyncSaver.wait

    def gated_write(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():  # a background save
            assert gate.wait(300)
        return real_write(self, *args, **kwargs)

    def wait(self, *args, **kwargs):
        gate.set()
        try:
            return real_wait(self, *args, **kwargs)
        finally:
            gate.clear()
    monkeypatch.setattr(Checkpoints, "_write", gated_write)
    monkeypatch.setattr(async_save.AsyncSaver, "wait", wait)


@pytest.mark.slow
def test_async_checkpoints_hold_what_sync_ones_hold(world1, tmp_path, monkeypatch, write_after_the_next_step):
    """Three steps with a checkpoint at each, synchronous and in the background (each write held
    until the next step has trained): the same losses, every saved tensor bit for bit. Negative
    control: without the snapshot's copy the background files hold a later step's weights."""
    from megatron_kappa.checkpoint import async_save
    from megatron_kappa.checkpoint.store import Checkpoints
    lines = []
    train(tmp_path / "sync", "train.steps=3", "checkpoint.async_save=false")
    train(tmp_path / "async", "train.steps=3", "checkpoint.async_save=true", log=lines.append)
    assert losses(tmp_path / "async") == losses(tmp_path / "sync")
    assert Checkpoints(tmp_path / "async").complete() == [1, 2, 3]
    for step in (1, 2, 3):
        assert differences(rank_file(tmp_path / "sync", step), rank_file(tmp_path / "async", step)) == []
    assert differences(rank_file(tmp_path / "sync", 1), rank_file(tmp_path / "sync", 2))  # the steps differ
    assert any("checkpoint: step 2 waited" in line and "save of step 1" in line for line in lines)
    monkeypatch.setattr(async_save.AsyncSaver, "_copy", staticmethod(lambda state: state))
    train(tmp_path / "aliased", "train.steps=3", "checkpoint.async_save=true")
    assert differences(rank_file(tmp_path / "sync", 1), rank_file(tmp_path / "aliased", 1))


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["enospc", "exception"])
def test_a_failed_background_save_keeps_the_previous_and_resumes_exactly(world1, tmp_path, monkeypatch, fault):
    """The background write of step 2 fails (a full disk; any exception in the writer): the run
    stops at its next checkpoint step with one line naming the failure, step 1 stays `latest` and
    loadable, and the resume continues with the uninterrupted run's losses (≤ 1e-5)."""
    from megatron_kappa.checkpoint import store
    from megatron_kappa.checkpoint.listing import CheckpointDir, CheckpointSaveError
    train(tmp_path / "straight", "train.steps=4", "checkpoint.async_save=true")
    real_save = store.torch.save

    def failing(obj, path, *args, **kwargs):
        if "step_2" in str(path):
            if fault == "enospc":
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            raise ValueError("a writer bug\nsecond line")
        return real_save(obj, path, *args, **kwargs)
    monkeypatch.setattr(store.torch, "save", failing)
    with pytest.raises(CheckpointSaveError) as e:
        train(tmp_path / "run", "train.steps=4", "checkpoint.async_save=true")
    said = str(e.value)
    assert "\n" not in said and "step_2: saving failed (rank 0: " in said and "step_1" in said
    assert ("no space left on the device" if fault == "enospc" else "ValueError: a writer bug") in said
    listing = CheckpointDir(tmp_path / "run")
    assert listing.latest() == 1 and listing.complete() == [1] and listing.verify(1) is None
    assert not (tmp_path / "run/checkpoints/.tmp/step_2").exists()
    assert not (tmp_path / "run/.lock").exists()
    monkeypatch.setattr(store.torch, "save", real_save)
    train(tmp_path / "run", "train.steps=4", "checkpoint.async_save=true")
    resumed, straight = losses(tmp_path / "run"), losses(tmp_path / "straight")
    assert len(resumed) == len(straight) == 4
    assert max(abs(a - b) for a, b in zip(resumed, straight)) <= 1e-5
    assert CheckpointDir(tmp_path / "run").complete() == [1, 2, 3, 4]


def test_keep_removes_only_committed_checkpoints(world1, tmp_path, write_after_the_next_step):
    """checkpoint.keep=1 with a save in flight: the newest committed one stays until the next
    one is committed (the listing seen by each write, before it publishes, still holds it)."""
    from megatron_kappa.checkpoint.listing import CheckpointDir
    from megatron_kappa.checkpoint.store import Checkpoints
    seen, real_write = [], Checkpoints._write

    def watch(self, step, *args, **kwargs):
        seen.append((step, CheckpointDir(self.root.parent).complete()))
        return real_write(self, step, *args, **kwargs)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Checkpoints, "_write", watch)
        train(tmp_path, "train.steps=3", "checkpoint.async_save=true", "checkpoint.keep=1")
    assert seen == [(1, []), (2, [1]), (3, [2])]
    assert CheckpointDir(tmp_path).complete() == [3]


def env(fault: dict | None = None):
    inherited = {k: v for k, v in os.environ.items()
                 if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "KAPPA_TEST_FAULT")}
    return {**inherited, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": str(ROOT), **({"KAPPA_TEST_FAULT": json.dumps(fault)} if fault else {})}


def pretrain(nproc: int, run_dir, *sets) -> list[str]:
    """The command of a run (through tests/support/async_fault_worker.py: KAPPA_TEST_FAULT applies)."""
    args = [str(ROOT / "tests/support/async_fault_worker.py"), "--config", "configs/tiny.yaml", "--set", *TRAIN,
            f"run.dir={run_dir}", "checkpoint.async_save=true", *sets]
    if nproc == 1:
        return [sys.executable, *args]
    # kappa-torchrun: torchrun with its failed-rank report in one line (megatron_kappa/cli/launcher.py)
    return [sys.executable, "-m", "megatron_kappa.cli.launcher", "torchrun", "--standalone", "--nproc_per_node",
            str(nproc), *args]


def wait_for(marker: Path, proc, seconds=600):
    deadline = time.time() + seconds
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists(), proc.communicate()[0][-3000:] if proc.poll() is not None else "no marker"
    time.sleep(0.5)  # its pid is written


def close_to(a, b):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= 1e-5


@pytest.mark.slow
def test_kill_9_of_rank_1_during_the_background_write(tmp_path):
    """2 processes (torchrun, EP2), checkpoints every 2 steps: rank 1 is killed (SIGKILL) while
    its background write of step 4 is under way. The launch fails (nonzero, the failure named),
    step 2 stays `latest` and verifies, and the rerun continues with the uninterrupted run's losses."""
    from megatron_kappa.checkpoint.listing import CheckpointDir
    sets = ["train.steps=6", "checkpoint.interval=2", "train.global_batch=4", "parallel.ep=2"]
    marker = tmp_path / "writing"
    proc = subprocess.Popen(pretrain(2, tmp_path / "run", *sets), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env({"step": 4, "rank": 1, "marker": str(marker), "sleep": 600}))
    wait_for(marker, proc)
    os.kill(int(marker.read_text()), signal.SIGKILL)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode != 0, out[-3000:]
    assert any(line.startswith("error:") and "rank 1" in line for line in out.splitlines()), out[-3000:]
    listing = CheckpointDir(tmp_path / "run")
    assert listing.complete() == [2] and listing.latest() == 2 and listing.verify(2) is None
    outputs = []
    for run in ("run", "straight"):
        done = subprocess.run(pretrain(2, tmp_path / run, *sets), cwd=ROOT, env=env(), capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(done.stdout)
    assert "resumed from" in outputs[0] and "step_2" in outputs[0]
    assert close_to(losses(tmp_path / "run"), losses(tmp_path / "straight"))
    assert CheckpointDir(tmp_path / "run").complete()[-1] == 6


@pytest.mark.slow
def test_sigterm_with_a_save_in_flight_commits_it_and_resumes_exactly(tmp_path):
    """SIGTERM while the background write of step 2 is under way (held 5 s): the run stops at the
    step the ranks agree on with a checkpoint there, having waited for step 2's write (both
    committed), exit 75; the rerun continues with the uninterrupted run's losses. A full disk in the background
    write (ENOSPC) is one line and exit 1, step 2 still latest."""
    from megatron_kappa.checkpoint.listing import CheckpointDir
    sets = ["train.steps=8", "checkpoint.interval=2"]
    marker = tmp_path / "writing"
    proc = subprocess.Popen(pretrain(1, tmp_path / "run", *sets), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=env({"step": 2, "marker": str(marker), "sleep": 5}))
    wait_for(marker, proc)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 75, out[-3000:]
    stopped = CheckpointDir(tmp_path / "run").complete()  # the stop agreement ends the step after the next
    assert stopped[0] == 2 and stopped[-1] < 8 and CheckpointDir(tmp_path / "run").latest() == stopped[-1], out
    assert "waited" in out and "save of step 2" in out and f"stopped at step {stopped[-1]}/8" in out
    for run in ("run", "straight"):
        done = subprocess.run(pretrain(1, tmp_path / run, *sets), cwd=ROOT, env=env(), capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    assert close_to(losses(tmp_path / "run"), losses(tmp_path / "straight"))
    # ENOSPC in the background write of step 4 of a new run: one line, exit 1, step 2 stands
    done = subprocess.run(pretrain(1, tmp_path / "full", *sets), cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=env({"step": 4, "raise": "enospc"}))
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1 and len(errors) == 1, done.stderr[-3000:]
    assert "step_4: saving failed (rank 0: no space left on the device" in errors[0] and "step_2" in errors[0]
    assert CheckpointDir(tmp_path / "full").latest() == 2
