"""Divergence stops the run (megatron_kappa.train.divergence): train.nonfinite_steps consecutive
steps with a non-finite loss or gradient norm, or skipped by DeepSpeed for an overflow, end it in
one line with exit status 3 and no checkpoint of them; the last good checkpoint stays the latest."""
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_kappa.config import load_config
from megatron_kappa.train.divergence import BadSteps, TrainingDiverged

ROOT = Path(__file__).resolve().parents[1]
NAN, INF = float("nan"), float("inf")


def counted(limit, steps, reads):
    """Feed (loss, grad norm, skipped count) per step; read after the steps in `reads`."""
    bad, out = BadSteps(limit, "cpu"), []
    for i, (loss, norm, skipped) in enumerate(steps):
        bad.observe(torch.tensor(loss), norm, skipped)
        if i in reads:
            out.append(bad.read())
    return bad, out


def test_consecutive_bad_steps_are_counted_on_the_device():
    steps = [(1.0, 0.5, 0), (NAN, 0.5, 0), (1.0, torch.tensor(INF), 0), (1.0, 0.5, 1), (1.0, 0.5, 1),
             (1.0, None, 1)]
    bad, reads = counted(2, steps, {3, 5})
    assert reads == [(3, 3), (0, 3)]  # steps 1-3 bad (NaN loss, inf norm, a skip): a run of 3, read later too
    assert bad.diverged(2) and not bad.diverged(1)
    # negative control: the same bad steps apart never make a run of 2
    apart = [(NAN, 0.5, 0), (1.0, 0.5, 0), (1.0, INF, 0), (1.0, 0.5, 0), (1.0, 0.5, 1)]
    assert counted(2, apart, {4})[1] == [(1, 1)]
    assert not BadSteps(0, "cpu").diverged(10**6)  # 0: never stops


TRAIN = ["data.mock=true", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=2",
         "log.tensorboard=false", "eval.valid_every=0", "log.interval=5", "checkpoint.interval=5",
         "train.steps=12", "train.lr=1e4", "train.lr_non_matrix=1e4"]


def checkpoints(run_dir):
    return sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("step_*"))


@pytest.mark.slow
def test_a_dead_model_stops_without_a_checkpoint_of_it(world1, tmp_path):
    """train.lr=1e4: gradients overflow from step 6 on and DeepSpeed skips those steps; the run
    stops at the next read (step 10) naming step 5, the last good checkpoint. Negative control:
    train.nonfinite_steps 0 (the check off) trains to the end and saves the dead steps."""
    from megatron_kappa.train import loop
    with pytest.raises(TrainingDiverged, match=r"^step 10: non-finite gradients .* in 5 steps in a row "
                                               r"\(train.nonfinite_steps 1\); stopped without saving, the last "
                                               r"good checkpoint is .*step_5$"):
        loop.run(load_config("configs/tiny.yaml", TRAIN + [f"run.dir={tmp_path / 'a'}"]), log=lambda *a: None)
    assert checkpoints(tmp_path / "a") == ["step_5"]
    loop.run(load_config("configs/tiny.yaml", TRAIN + [f"run.dir={tmp_path / 'b'}", "train.nonfinite_steps=0"]),
             log=lambda *a: None)
    assert checkpoints(tmp_path / "b") == ["step_10", "step_12"]


@pytest.mark.slow
def test_divergence_under_the_deepspeed_launcher_is_one_line_and_exit_3(tmp_path):
    from tests.support.processes import deepspeed_cmd, env, free_port
    run_dir = tmp_path / "run"
    cmd = deepspeed_cmd(ROOT / "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set", *TRAIN,
                        "parallel.ep=2", "train.global_batch=4", f"run.dir={run_dir}", port=free_port())
    done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    errors = [ln for ln in (done.stdout + done.stderr).splitlines() if "error: step" in ln]
    assert len(errors) == 1 and "stopped without saving" in errors[0] and "step_5" in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    assert checkpoints(run_dir) == ["step_5"]
