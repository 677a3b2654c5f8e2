"""Issue 61's three edges: SIGTERM during an export cleans up and says so, a "nothing to do"
resume changes no file, a fresh unreadable lock is waited on and taken over by the preflight."""
import hashlib
import json
import os
import signal
from pathlib import Path

import pytest

from megatron_kappa.config import ConfigError, load_config

TRAIN = ["data.mock=true", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=2",
         "log.tensorboard=false", "eval.valid_every=0", "log.interval=1", "checkpoint.interval=1"]


def tree(folder: Path) -> dict:
    """Every file under `folder` (but the lock, which a start takes and gives back) with its
    bytes' hash and modification time."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.mark.slow
def test_a_nothing_to_do_resume_changes_no_file(world1, tmp_path):
    """A finished 2-step run started again with train.steps=1: "nothing to do", and every file of
    the run.dir as it was (config.yaml was rewritten to 1 step and config_history gained an entry).
    Negative control: a resume that trains (train.steps=3) records its start."""
    from megatron_kappa.train import loop
    sets = [*TRAIN, f"run.dir={tmp_path}"]
    loop.run(load_config("configs/tiny.yaml", [*sets, "train.steps=2"]), log=lambda *a: None)
    before, lines = tree(tmp_path), []
    loop.run(load_config("configs/tiny.yaml", [*sets, "train.steps=1"]), log=lines.append)
    assert any(line.startswith("nothing to do: the checkpoint is at step 2") for line in lines), lines
    assert tree(tmp_path) == before
    longer = [*sets, "train.steps=3", "train.allow_schedule_change=true"]
    loop.run(load_config("configs/tiny.yaml", longer), log=lambda *a: None)
    assert (tmp_path / "config_history/start_2.yaml").exists() and tree(tmp_path) != before


def test_a_fresh_unreadable_lock_is_waited_on_then_taken_over_by_the_preflight(tmp_path, monkeypatch):
    """The preflight's check of a fresh empty or garbled `.lock` waits until it is UNREADABLE_AFTER_S
    old (a start may be writing it) and then lets the start take it over, as acquire() does (it
    refused at once, "in use by pid None on None"). The wait is counted, not timed: time.sleep
    ages the lock instead. Negative control: a lock of a live process is refused at once."""
    from megatron_kappa.train import run_lock
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        then = os.stat(lock).st_mtime - seconds
        os.utime(lock, (then, then))
    monkeypatch.setattr(run_lock.time, "sleep", sleep)
    lock = tmp_path / ".lock"
    for content in ("", '{"host": "x", "pi'):
        lock.write_text(content)
        slept.clear()
        run_lock.RunLock(tmp_path).check()
        assert len(slept) == 1 and run_lock.UNREADABLE_AFTER_S - 1 < slept[0] <= run_lock.UNREADABLE_AFTER_S + 0.1
        taker = run_lock.RunLock(tmp_path)
        taker.acquire()
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        taker.release()
    import socket
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "job": None}))
    slept.clear()
    with pytest.raises(ConfigError, match=rf"in use by pid {os.getppid()} on "):
        run_lock.RunLock(tmp_path).check()
    assert slept == []


def test_sigterm_during_an_export_removes_its_folder_and_says_so(world1, tmp_path, monkeypatch, capsys):
    """SIGTERM while the export writes its shards: `<output>.tmp` is removed, one line saying so,
    exit status 143 (it died at once, leaving a partial model.safetensors). The signal is sent
    once the folder holds a shard (so it does come mid-export)."""
    from megatron_kappa.export import __main__ as cli
    from megatron_kappa.export import writer
    from megatron_kappa.parallel.launch_env import run_command
    from megatron_kappa.train import loop
    loop.run(load_config("configs/tiny.yaml", [*TRAIN, f"run.dir={tmp_path / 'run'}", "train.steps=1"]),
             log=lambda *a: None)
    output = tmp_path / "hf"
    real_flush, seen = writer.ShardWriter.flush, []

    def flush(self):
        real_flush(self)
        seen.append(sorted(p.name for p in (tmp_path / "hf.tmp").iterdir()))
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(writer.ShardWriter, "flush", flush)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stop:
            run_command(lambda: cli.main(["--checkpoint", str(tmp_path / "run"), "--output", str(output),
                                          "--no-progress"]), "what an interrupt leaves")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen and any(name.endswith(".safetensors") for name in seen[0]), seen
    assert stop.value.code == 143
    assert capsys.readouterr().err == "terminated (SIGTERM): what an interrupt leaves\n"
    assert not (tmp_path / "hf.tmp").exists() and not output.exists()
