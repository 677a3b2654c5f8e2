"""Every rank enters the same collectives in the same order on every step, logging steps
included: each feature that runs under pipeline stages trains under PP2 with a log line every step
and a short collective timeout, so a rank that skips or reorders a collective fails the launch in
seconds instead of hanging (issue 53: MTP under PP2 hung at its first logging step)."""
import json

import pytest

from tests.support.pipeline_runs import COMMON, launch

GUARD = ["parallel.pp=2", "parallel.timeout_s=20", "train.steps=2", "eval.valid_every=2", "log.interval=1"]
FEATURES = {  # what each run turns on beyond tiny (κ and its L2 penalty, the aux and z losses: always)
    "mtp": ["model.mtp.num_layers=1"],
    "nanochat_block": ["model.block=nanochat"],  # value embeddings, x0 and the λ
    "sigmoid_router": ["model.moe.router=sigmoid", "model.moe.seq_aux_loss=1e-4"],
    "authors_router_losses": ["model.moe.z_loss_form=authors", "model.moe.aux_loss_form=authors"],
}


@pytest.mark.slow
def test_every_pipeline_feature_logs_every_step_under_pp2(tmp_path):
    plan = [{"overrides": COMMON + GUARD + sets + [f"run.dir={tmp_path / name}"]} for name, sets in FEATURES.items()]
    launch(tmp_path, plan, 2)
    for name in FEATURES:
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2], name
        assert all("kappa_l2" in r and "grad_norm" in r for r in records), name
    assert all("mtp_loss" in json.loads(line) for line in (tmp_path / "mtp" / "metrics.jsonl").read_text().splitlines())


@pytest.mark.slow
def test_the_guard_catches_a_stage_that_skips_a_collective(tmp_path):
    """Negative control: the MTP loss as it was (the stage without MTP depths skipped its pipeline
    sum) fails the launch within the timeout: gloo's wait for the stage that never joins."""
    plan = [{"overrides": COMMON + GUARD + FEATURES["mtp"] + [f"run.dir={tmp_path / 'mtp'}"],
             "negative": "mtp_stage_skips"}]
    done = launch(tmp_path, plan, 2, check=False)
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "Timed out waiting 20000ms" in out and "mtp_loss" in out, out[-3000:]
