"""The run lock, checksummed checkpoints and the crash-proof metrics file under the deepspeed
launcher with 2 ranks (issue 53), not only in one process: a held run.dir is refused in one line,
and a resume over a flipped byte in rank 1's file and torn metrics records takes the checkpoint
before it and drops the records, one line each for the whole launch. (Divergence under the same
launcher: tests/test_divergence.py; Ctrl-C: tests/test_preemption.py, tests/test_launcher_exit.py.)"""
import json
import socket
import subprocess
from pathlib import Path

import pytest

from tests.support.checkpoint_files import flip_one_byte
from tests.support.processes import deepspeed_cmd, env, free_port

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["data.mock=true", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=4", "parallel.ep=2",
         "log.tensorboard=false", "eval.valid_every=0", "log.interval=1", "checkpoint.interval=1",
         "checkpoint.keep=3", "train.allow_schedule_change=true"]  # the resumes run one step more


def launch(run_dir, steps):
    cmd = deepspeed_cmd(ROOT / "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set", *TRAIN,
                        f"train.steps={steps}", f"run.dir={run_dir}", port=free_port())
    done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    return done.returncode, done.stdout + done.stderr


def lines_with(out, text):
    return [line for line in out.splitlines() if text in line]


@pytest.mark.slow
def test_lock_checksums_and_torn_metrics_under_two_ranks(tmp_path):
    from megatron_kappa.checkpoint.listing import CheckpointDir
    from megatron_kappa.metrics.log import read_records
    run = tmp_path / "run"
    code, out = launch(run, 3)
    assert code == 0, out[-3000:]
    listing = CheckpointDir(run)
    assert listing.complete() == [1, 2, 3] and set(listing.meta(3)["checksums"]) == {"rank_0.pt", "rank_1.pt"}
    # the damage: one byte of rank 1's newest file (its size unchanged: the sizes alone would take
    # it), and two records of metrics.jsonl half-written (the first, and the last as a kill leaves it)
    victim = run / "checkpoints/step_3/rank_1.pt"
    flip_one_byte(victim)
    assert listing.verify(3, content=False) is None and listing.verify(3) is not None
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines(True)
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    metrics.write_text(lines[0][:30] + "\n" + lines[1] + lines[2][:40])
    # a live holder of the run.dir: the launch is refused, in one line, and nothing is touched
    holder = subprocess.Popen(["sleep", "300"])
    try:
        (run / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid, "started": "now"}))
        before = metrics.read_bytes()
        code, out = launch(run, 4)
        refusals = lines_with(out, f"is in use by pid {holder.pid}")
        assert code != 0 and len(refusals) == 1 and "Traceback" not in out, out[-3000:]
        assert metrics.read_bytes() == before and listing.complete() == [1, 2, 3]
    finally:
        holder.kill()
        holder.wait()
    # the holder gone (negative control of the refusal): the resume takes step 2, drops the torn records
    code, out = launch(run, 4)
    assert code == 0 and "Traceback" not in out, out[-3000:]
    damaged = lines_with(out, "is damaged")
    assert len(damaged) == 1 and str(victim) in damaged[0] and "checksum" in damaged[0], out[-3000:]
    torn = lines_with(out, "torn record")
    assert len(torn) == 1 and "dropped 2 torn records (line 1, 3)" in torn[0], out[-3000:]
    assert len(lines_with(out, f"resumed from {run}/checkpoints/step_2")) == 1, out[-3000:]
    records, left = read_records(metrics)
    assert left == [] and [r["step"] for r in records] == [2, 3, 4]
    assert all(r["loss"] == r["loss"] for r in records)  # finite: the damaged weights were never loaded
    assert listing.complete()[-1] == 4 and listing.verify(3) is None  # step 3 trained and saved again
