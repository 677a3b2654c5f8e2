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
