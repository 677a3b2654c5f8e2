"""Multi-token prediction (model.mtp; issue 36): its loss weight enters the gradient linearly and, at
0, leaves the model's gradients those of the model without MTP (negative control: the MTP modules'
gradient is 0 then, and not otherwise); its modules are counted apart by the summary, as DeepSeek-V3
reports them; in training, TP2×EP2 and PP2×EP2 (the MTP modules and their copy of the input
embedding on the last stage) match one process from the same weights, resume exactly, and
evaluation loads them as one process."""

import pytest
import torch

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.model.build import build_model


def gradients(weight: float | None, state=None):
    """(gradients by name, state dict) of one forward/backward of the tiny model with one MTP depth
    of loss weight `weight` (None: no MTP), from `state` when given."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
    # no router losses: the MTP layer's MoE router adds its own (as megatron's MTP layers do), apart from λ
    sets = ["model.kappa.freeze_fraction=0", "model.moe.aux_loss=0", "model.moe.z_loss=0"] + (
        [] if weight is None else ["model.mtp.num_layers=1",
                                   f"model.mtp.loss_weight={weight}"])
    torch.manual_seed(0)
    model = build_model(load_config("configs/tiny.yaml", sets), "cpu")
    if state is not None:
        model.load_state_dict(state, strict=False)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    ids = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, dims=1)
    model(ids, torch.arange(24).expand(2, -1), None, labels=labels).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, model.state_dict()


def test_the_mtp_loss_weight_enters_the_gradient_linearly(world1):
    g0, state = gradients(0.0)
    g3, _ = gradients(0.3, state)
    g6, _ = gradients(0.6, state)
    plain, _ = gradients(None, state)
    main = [n for n in plain if not n.startswith("mtp.")]
    # weight 0: the model's own gradients, as without MTP; the MTP modules get none
    assert max((g0[n] - plain[n]).abs().max().item() for n in main) <= 1e-6
    assert all(g0.get(n, torch.zeros(1)).abs().max() == 0 for n in g3 if n.startswith("mtp."))
    # weight λ: the MTP part of every gradient (the shared embedding and output layer included) is λ × one
    for n in g3:
        part3, part6 = g3[n] - g0.get(n, 0), g6[n] - g0.get(n, 0)
        assert (part6 - 2 * part3).abs().max() <= 1e-5 * max(1e-3, part6.abs().max().item()), n
    assert (g3["embedding.word_embeddings.weight"] - g0["embedding.word_embeddings.weight"]).abs().max() > 1e-6
    assert any(n.startswith("mtp.") and g3[n].abs().max() > 0 for n in g3)


def test_the_summary_counts_mtp_apart(world1):
    from megatron_kappa.summary import summarize
    plain = summarize(load_config("configs/tiny.yaml"))
    with_mtp = summarize(load_config("configs/tiny.yaml", ["model.mtp.num_layers=2"]))
    assert with_mtp["total_params"] == plain["total_params"] and plain["mtp_params"] == 0
    model = build_model(load_config("configs/tiny.yaml", ["model.mtp.num_layers=2"]), meta=True)
    mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    assert with_mtp["mtp_params"] == mtp > 0
    # per depth: a layer like the last (MoE) one, the [h, 2h] projection and three norms
    last = sum(p.numel() for n, p in model.named_parameters() if n.startswith("decoder.layers.3."))
    assert mtp == 2 * (last + 2 * 64 * 64 + 3 * 64)
    with pytest.raises(ConfigError, match="model.value_embeddings"):
        load_config("configs/tiny.yaml", ["model.mtp.num_layers=1", "model.block=nanochat"])


@pytest.fixture(scope="module")
def mtp_runs(world1, tmp_path_factory):
    from megatron_kappa.train.loop import run
    from tests.support.pipeline_runs import COMMON, LAYOUTS, launch
    from tests.support.weights import save_init_weights
    tmp = tmp_path_factory.mktemp("mtp")
    sets = COMMON + ["model.mtp.num_layers=1", "model.mtp.loss_weight=0.5"]
    init = save_init_weights(tmp / "init.pt", sets)
    sets = sets + [f"train.init_weights={init}"]
    run(load_config("configs/tiny.yaml", sets + [f"run.dir={tmp / 'ref'}"]), log=lambda *a: None)
    layout = ["parallel.tp=2", "parallel.ep=2", "eval.valid_iters=2", "checkpoint.interval=1", "checkpoint.keep=3"]
    launch(tmp, [{"overrides": sets + layout + [f"run.dir={tmp / 'tp2_ep2'}"]},
                 {"overrides": sets + LAYOUTS["pp2_ep2"][1] + [f"run.dir={tmp / 'pp2_ep2'}"]},
                 # virtual stages: the MTP depth and the embedding's copy in rank 1's last chunk
                 {"overrides": sets + LAYOUTS["pp2_ep2"][1] + ["parallel.vpp=2", f"run.dir={tmp / 'pp2_vpp2_ep2'}"]},
                 {"overrides": sets + LAYOUTS["pp2_ep2"][1] + [f"run.dir={tmp / 'unsynced'}"],
                  "negative": "embedding_copy_unsynced"}], 4)
    return tmp, sets + layout


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2_ep2", "pp2_ep2", "pp2_vpp2_ep2"])
def test_mtp_layouts_match_one_process(mtp_runs, name):
    """The losses, mtp_loss and gradient norms of every step and the validation loss. With PP2 the
    last stage's embedding copy must take the first stage's update: left with its own gradient
    (the MTP part only: the negative control), the MTP loss leaves the 1e-5 band."""
    from tests.support.pipeline_runs import assert_same_run
    from tests.support.processes import records
    tmp, _ = mtp_runs
    ref, got = records(tmp / "ref"), records(tmp / name)
    assert_same_run(ref, got, name, keys=("loss", "mtp_loss"))
    # the MTP depth's κ statistics under its own name, not a decoder layer's
    mtp_kappa = [k for k in ref[-1] if k in ("kappa/mtp0/alpha_abs", "kappa/mtp0/bias_abs")]
    assert len(mtp_kappa) == 2 and all(got[-1][k] == pytest.approx(ref[-1][k], rel=1e-5) for k in mtp_kappa)
    if name == "pp2_ep2":
        unsynced = records(tmp / "unsynced")
        assert max(abs(r["mtp_loss"] - u["mtp_loss"]) for r, u in zip(ref, unsynced)) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2_ep2", "pp2_vpp2_ep2"])
def test_the_embedding_copy_stays_the_first_stages(mtp_runs, name):
    """PP2×EP2 (and with virtual stages) after 3 steps: the last stage's copy of the input
    embedding equals the first stage's bit for bit on every rank, and both equal the one-process
    run's embedding."""
    from megatron_kappa.checkpoint.store import Checkpoints
    tmp, _ = mtp_runs
    run = Checkpoints(tmp / name)
    step = run.latest()
    files = run.rank_files(step)
    name = "embedding.word_embeddings.weight"
    copies = {f["coords"]["pp"][0]: f["weights"][name] for f in files if name in f["weights"]}
    assert sorted(copies) == [0, 1] and torch.equal(copies[0], copies[1])
    ref = Checkpoints(tmp / "ref")
    assert (copies[1].float() - ref.weights(ref.latest(), {name})[name].float()).abs().max() <= 1e-5


@pytest.mark.slow
def test_mtp_resume_and_evaluation(mtp_runs):
    import shutil

    from megatron_kappa.evaluation.loading import load_model_for_eval
    from tests.support.pipeline_runs import STEPS, launch
    from tests.support.processes import records
    tmp, sets = mtp_runs
    resumed = tmp / "resumed"  # the TP2×EP2 run from its step-1 checkpoint
    shutil.copytree(tmp / "tp2_ep2", resumed)
    for step in range(2, STEPS + 1):
        shutil.rmtree(resumed / f"checkpoints/step_{step}")
    out = launch(tmp, [{"overrides": sets + [f"run.dir={resumed}"], "log": True}], 4)
    assert f"resumed from {resumed}/checkpoints/step_1" in out
    assert [(r["loss"], r["mtp_loss"]) for r in records(resumed)] == \
        [(r["loss"], r["mtp_loss"]) for r in records(tmp / "tp2_ep2")]
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(3))
    logits = {run: load_model_for_eval(tmp / run)[0](tokens) for run in ("tp2_ep2", "pp2_ep2", "ref")}
    assert (logits["tp2_ep2"] - logits["ref"]).abs().max().item() < 1e-4
    assert (logits["pp2_ep2"] - logits["ref"]).abs().max().item() < 1e-4


def test_a_logged_steps_mtp_loss_is_its_own(world1, tmp_path):
    """With log.interval 2 the logged mtp_loss is step 2's alone, as with log.interval 1 (negative
    control of the tracker's per-step clearing: without it step 1's loss would be added in)."""
    from megatron_kappa.train.loop import run
    sets = ["data.mock=true", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=4", "train.steps=2",
            "eval.valid_every=0", "log.tensorboard=false", "model.mtp.num_layers=1", "checkpoint.interval=100"]
    logged = {}
    for interval in (1, 2):
        run(load_config("configs/tiny.yaml", [*sets, f"log.interval={interval}",
                                              f"run.dir={tmp_path / str(interval)}"]),
            log=lambda *a: None)
        from tests.support.processes import records
        logged[interval] = {r["step"]: r["mtp_loss"] for r in records(tmp_path / str(interval))}
    assert list(logged[2]) == [2] and abs(logged[2][2] - logged[1][2]) <= 1e-6, logged
    assert abs(logged[1][1] + logged[1][2] - logged[2][2]) > 1  # what an uncleared tracker would give


@pytest.mark.slow
def test_an_export_leaves_the_mtp_modules_behind(mtp_runs, tmp_path):
    """The PP2×EP2 run exported (kappa_moe): no MTP tensor in it, and its logits are the training
    model's, as evaluation loads it."""
    import json

    from tests.support.export_runs import close, export, hf_logits, tokens, training_logits
    tmp, _ = mtp_runs
    out = tmp_path / "hf"
    export(tmp / "pp2_ep2", out, "--target", "kappa_moe")
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] \
        if (out / "model.safetensors.index.json").exists() else _safetensor_names(out / "model.safetensors")
    assert names and not any("mtp" in n for n in names)
    ids = tokens(json.loads((out / "config.json").read_text())["vocab_size"])
    want = training_logits(tmp / "pp2_ep2", ids)
    got, _ = hf_logits(out, ids)
    assert close(got, want), (got - want).abs().max()


def _safetensor_names(path):
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        return list(f.keys())
