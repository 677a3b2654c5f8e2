"""MLA in training (model.mla; issue 36): PP2 and TP2×EP2 (sequence parallelism splits the latents'
tokens, TP the heads) against one process from the same weights (losses and gradient norms ≤ 1e-5
over 3 steps, gradient clipping active), an exact resume from a PP2 checkpoint, consolidation of
the PP2 checkpoint into the one process's weights, evaluation of it as one process, and κ's
experts beside it unchanged (their α, b statistics equal). The gradient-level comparison, with
megatron's own MLASelfAttention as the negative control, is in tests/test_parallel.py."""

import pytest

from megatron_kappa.config import load_config
from tests.support.pipeline_runs import COMMON, assert_same_run, final_weights, launch, resume_from_step_1
from tests.support.processes import records
from tests.support.settings import MLA


@pytest.fixture(scope="module")
def mla_runs(world1, tmp_path_factory):
    from megatron_kappa.train.loop import run
    from tests.support.weights import save_init_weights
    tmp = tmp_path_factory.mktemp("mla")
    init = save_init_weights(tmp / "init.pt", COMMON + MLA)
    sets = COMMON + MLA + [f"train.init_weights={init}"]
    run(load_config("configs/tiny.yaml", sets + [f"run.dir={tmp / 'ref'}"]), log=lambda *a: None)
    launch(tmp, [{"overrides": sets + ["parallel.pp=2", f"run.dir={tmp / 'pp2'}", "checkpoint.interval=1",
                                       "checkpoint.keep=3"]}], 2)
    launch(tmp, [{"overrides": sets + ["parallel.tp=2", "parallel.ep=2", "eval.valid_iters=2",
                                       f"run.dir={tmp / 'tp2_ep2'}"]}], 4)
    return tmp, sets


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2", "tp2_ep2"])
def test_mla_layouts_match_one_process(mla_runs, name):
    tmp, _ = mla_runs
    ref, got = records(tmp / "ref"), records(tmp / name)
    assert_same_run(ref, got, name)
    kappa = [k for k in ref[-1] if k.endswith(("/alpha_abs", "/bias_abs"))]
    assert kappa and all(got[-1][k] == pytest.approx(ref[-1][k], rel=1e-6) for k in kappa)


@pytest.mark.slow
def test_mla_resume_consolidation_and_evaluation(mla_runs):
    import torch

    from megatron_kappa.evaluation.loading import load_model_for_eval
    tmp, sets = mla_runs
    resumed = resume_from_step_1(tmp, sets)
    assert [r["loss"] for r in records(resumed)] == [r["loss"] for r in records(tmp / "pp2")]
    weights = {run: final_weights(tmp / run) for run in ("ref", "pp2")}
    assert weights["pp2"].keys() == weights["ref"].keys()
    assert any("linear_kv_down_proj" in k for k in weights["ref"])
    assert max((weights["pp2"][k] - weights["ref"][k]).abs().max().item() for k in weights["ref"]) < 1e-5
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(3))
    logits = {run: load_model_for_eval(tmp / run)[0](tokens) for run in ("pp2", "ref")}
    assert (logits["pp2"] - logits["ref"]).abs().max().item() < 1e-4
