"""A disk that fills under a run says so in one line, and leaves nothing half-written that a later
start would read (issue 62): the dataset index cache, and TensorBoard's writer thread."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pretrain_with(patch: str, args: list[str]) -> subprocess.CompletedProcess:
    """launch/pretrain.py's main in a fresh process, after `patch` (Python run first: the fault),
    started as every entry point starts (entry.start: the libraries' known notices filtered)."""
    code = ("import sys; sys.argv[0] = 'launch/pretrain.py'\nfrom megatron_kappa import entry\nentry.start()\n"
            + patch + f"\nfrom megatron_kappa.cli import pretrain\nsys.exit(pretrain.main({args!r}))\n")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_full_disk_while_the_index_cache_is_written_is_one_line(sample_shards, tmp_path):
    """The run folder fills while megatron-core writes the dataset index cache (its second
    numpy.save fails as a full disk does): one line naming the cache folder, exit 1, and none of
    the cache's files left (it was 51 lines, three chained megatron tracebacks, no word of the
    disk); the same command then trains (control)."""
    run = tmp_path / "run"
    args = ["--config", "configs/tiny.yaml", "--set", "data.mock=false", f"data.paths=[{sample_shards['train'][0]}]",
            f"data.valid_paths=[{sample_shards['valid'][0]}]", f"data.tokenizer={sample_shards['tokenizer']}",
            f"run.dir={run}", "model.seq_length=32", "train.steps=1", "train.micro_batch=2", "train.global_batch=2",
            "eval.valid_every=0", "log.tensorboard=false"]
    full = ("import errno, numpy\nreal, saves = numpy.save, []\n"
            "def save(path, *a, **k):\n"
            "    saves.append(path)\n"
            "    if len(saves) == 2:\n"
            "        raise OSError(errno.ENOSPC, 'No space left on device')\n"
            "    return real(path, *a, **k)\n"
            "numpy.save = save\n")
    done = pretrain_with(full, args)
    cache = run / "data_cache"
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(
        f"error: data: the dataset index cache in {cache} could not be written: no space left on the device ("), \
        done.stderr
    assert f"MiB free in {cache})" in done.stderr
    assert not cache.exists() or list(cache.iterdir()) == []
    again = pretrain_with("", args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(list(cache.glob("*.npy"))) >= 3


def test_tensorboard_on_a_full_disk_is_one_warning_and_no_thread_traceback(tmp_path, capsys, monkeypatch):
    """TensorBoard's writer thread finds the disk full: the one warning line, and no traceback of
    that thread (it printed about 25 lines after the project's warnings); metrics.jsonl goes on.
    Negative control: the same failure under Python's own thread hook prints the traceback."""
    import errno
    import threading

    from megatron_kappa.metrics.log import MetricsLog

    def fail_once_full(log):
        """The event file's writes fail as on a full disk; returns TensorBoard's writer thread."""
        writer = log.tb.file_writer.event_writer._async_writer

        def full(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        writer._writer.write = full
        return writer._worker

    log = MetricsLog(tmp_path / "a", tensorboard=True, enabled=True)
    capsys.readouterr()
    thread = fail_once_full(log)
    log.write({"step": 1, "loss": 2.0})
    thread.join(30)
    log.write({"step": 2, "loss": 1.9})
    log.close()
    err = capsys.readouterr().err
    assert err == f"warning: TensorBoard: {tmp_path / 'a' / 'tb'}: [Errno 28] No space left on device; training " \
                  "goes on without it\n", err
    assert [json.loads(line)["step"] for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    from megatron_kappa.metrics import log as metrics_log
    monkeypatch.setattr(metrics_log, "_quiet_tensorboard_thread", lambda: None)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)  # Python's own: the control
    control = MetricsLog(tmp_path / "b", tensorboard=True, enabled=True)
    capsys.readouterr()
    thread = fail_once_full(control)
    control.write({"step": 1, "loss": 2.0})
    thread.join(30)
    control.close()
    assert "Traceback" in capsys.readouterr().err
