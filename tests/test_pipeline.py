"""Pipeline parallelism (parallel.pp) in training: PP2, PP2×EP2 and PP2×DP2 under DeepSpeed ZeRO-1
against one process from the same weights (losses and gradient norms ≤ 1e-5 over 3 steps), an
exact resume from a PP2 checkpoint, consolidation of a PP checkpoint into the full weights, and
what pipeline stages refuse."""
import json
import re
import shutil

import pytest

from megatron_kappa.config import ConfigError, load_config
from tests.support.pipeline_runs import (
    COMMON,
    LAYOUTS,
    STEPS,
    assert_same_run,
    base_sets,
    final_weights,
    launch,
    nanochat_sets,
)
from tests.support.processes import records


@pytest.fixture(scope="module")
def stage_runs(world1, tmp_path_factory):
    """The pipeline runs of this file and their one-process references, {name: (folder, settings)}:
    "base" (PP2 with checkpoints at every step, PP2×EP2, PP2×DP2, PP4), "nanochat" (PP2 and its
    negative control) and "uneven" (5 layers on 2 stages), each with a PP2 × VPP2 run (base: vpp2,
    uneven: vpp_layout). The runs of one process count share a launch (the imports dominate on
    CPU); the PP2 runs are resumed by `resumed`."""
    from megatron_kappa.train.loop import run
    out = {"base": base_sets(tmp_path_factory.mktemp("pipeline")),
           "nanochat": nanochat_sets(tmp_path_factory.mktemp("pipeline_nanochat")),
           "uneven": uneven_sets(tmp_path_factory.mktemp("pipeline_uneven"))}
    for tmp, sets in out.values():
        run(load_config("configs/tiny.yaml", sets + [f"run.dir={tmp / 'ref'}"]), log=lambda *a: None)
    every_step = ["checkpoint.interval=1", "checkpoint.keep=3"]  # the resume tests start from step 1's
    (base, sets), (nano, nano_sets), (uneven, uneven_sets_) = out["base"], out["nanochat"], out["uneven"]
    launch(base, [{"overrides": sets + PP2["base"] + [f"run.dir={base / 'pp2'}", *every_step]},
                  {"overrides": nano_sets + PP2["nanochat"] + [f"run.dir={nano / 'pp2'}", *every_step]},
                  {"overrides": nano_sets + PP2["nanochat"] + [f"run.dir={nano / 'neg'}"],
                   "negative": "x0_not_sent_back"},
                  {"overrides": nano_sets + VPP + [f"run.dir={nano / 'vpp2'}"]},
                  {"overrides": uneven_sets_ + PP2["uneven"] + [f"run.dir={uneven / 'pp2'}", *every_step]},
                  {"overrides": uneven_sets_ + LAYOUT_STRING + [f"run.dir={uneven / 'layout'}"]},
                  {"overrides": sets + VPP + [f"run.dir={base / 'vpp2'}", *every_step]},
                  {"overrides": sets + VPP + [f"run.dir={base / 'vpp2_batched'}"], "negative": "batched_p2p"},
                  {"overrides": uneven_sets_ + VPP_LAYOUT + [f"run.dir={uneven / 'vpp_layout'}"]}], 2)
    launch(base, [{"overrides": sets + LAYOUTS[name][1] + [f"run.dir={base / name}"]}
                  for name in ("pp2_ep2", "pp2_dp2", "pp4", "pp2_vpp2_tp2")], 4)
    return out


@pytest.fixture(scope="module")
def runs(stage_runs):
    return stage_runs["base"]


@pytest.fixture(scope="module")
def resumed(stage_runs):
    """Each PP2 run of stage_runs, and the PP2 × VPP2 one, resumed from its step-1 checkpoint (one
    launch), {name: folder}."""
    folders, plan = {}, []
    base, base_sets_ = stage_runs["base"]
    runs = [(name, tmp, "pp2", sets + PP2[name]) for name, (tmp, sets) in stage_runs.items()]
    for name, tmp, run, sets in runs + [("vpp2", base, "vpp2", base_sets_ + VPP)]:
        folders[name] = tmp / f"{run}-resumed"
        shutil.copytree(tmp / run, folders[name])
        for step in range(2, STEPS + 1):
            shutil.rmtree(folders[name] / f"checkpoints/step_{step}")
        plan.append({"overrides": sets + [f"run.dir={folders[name]}"], "log": True})
    out = launch(stage_runs["base"][0], plan, 2)
    for folder in folders.values():
        assert f"resumed from {folder}/checkpoints/step_1" in out
    return folders


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_layout_matches_one_process(runs, name):
    tmp, _ = runs
    ref, got = records(tmp / "ref"), records(tmp / name)
    assert_same_run(ref, got, name)  # validation through the stages' forward-only schedule included
    for r, g in zip(ref, got):
        assert abs(r["aux_loss"] - g["aux_loss"]) <= 1e-6 and abs(r["kappa_l2"] - g["kappa_l2"]) <= 1e-9, (name, r, g)
        assert abs(r["z_loss"] - g["z_loss"]) <= 1e-9, (name, r["z_loss"], g["z_loss"])
    # κ's α and b of every MoE layer, merged from the stages under the full model's layer numbers
    # (the routed-token statistics sample the last micro-batch, which depends on the DP split)
    kappa = [k for k in ref[-1] if k.endswith(("/alpha_abs", "/bias_abs"))]
    assert len(kappa) == 6 and all(got[-1][k] == pytest.approx(ref[-1][k], rel=1e-6) for k in kappa), name


@pytest.mark.slow
def test_negative_control_zero2_with_stages_fails(runs):
    """Why pipeline stages refuse ZeRO-2, and that the comparison above can fail: past the check,
    the same PP2×DP2 run under ZeRO-2 either stops (its gradient hooks miss the schedule's
    backward passes: a KeyError in DeepSpeed 0.19.8) or leaves the one-process losses."""
    tmp, sets = runs
    done = launch(tmp, [{"overrides": sets + LAYOUTS["pp2_dp2"][1] + [f"run.dir={tmp / 'zero2'}", "zero.stage=2"],
                         "negative": "zero2_pipeline"}], 4, check=False)
    if done.returncode == 0:
        ref, got = records(tmp / "ref"), records(tmp / "zero2")
        assert max(abs(r["loss"] - g["loss"]) for r, g in zip(ref, got)) > 1e-4, got
    else:
        assert "KeyError" in done.stdout + done.stderr


@pytest.mark.slow
def test_pipeline_resume_is_exact(runs, resumed):
    tmp, _ = runs
    folder = resumed["base"]
    assert [r["loss"] for r in records(folder)] == [r["loss"] for r in records(tmp / "pp2")]
    assert json.loads((folder / "checkpoints/step_3/meta.json").read_text())["layout"]["pp"] == 2


@pytest.mark.slow
def test_pipeline_checkpoint_consolidates_to_the_full_model(runs):
    """The PP2 checkpoint's rank files, consolidated offline, equal the one-process run's weights
    after the same steps (fp32, same updates), under the full model's layer names."""
    from megatron_kappa.checkpoint.store import Checkpoints
    from megatron_kappa.parallel.sharding import consolidate
    tmp, _ = runs
    full = {}
    for run in ("pp2", "ref"):
        ckpts = Checkpoints(tmp / run)
        step = ckpts.latest()
        assert step == STEPS
        full[run] = consolidate([(f["coords"], f["weights"]) for f in ckpts.rank_files(step)])
    assert full["pp2"].keys() == full["ref"].keys()
    assert any(".layers.3." in k for k in full["pp2"])
    gap = max((full["pp2"][k].float() - full["ref"][k].float()).abs().max().item() for k in full["ref"])
    assert gap < 1e-5, gap


@pytest.mark.slow
def test_evaluation_of_a_pipeline_checkpoint(runs):
    """Evaluation loads a PP2 checkpoint as the whole model (consolidated) and gives the logits of
    the one-process run's checkpoint."""
    import torch

    from megatron_kappa.evaluation.loading import load_model_for_eval
    tmp, _ = runs
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(3))
    logits = {run: load_model_for_eval(tmp / run)[0](tokens) for run in ("pp2", "ref")}
    assert logits["pp2"].shape == (2, 32, 2048)
    assert (logits["pp2"] - logits["ref"]).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def nanochat_runs(stage_runs):
    return stage_runs["nanochat"]


@pytest.mark.slow
def test_nanochat_block_through_pipeline_stages(nanochat_runs):
    tmp, _ = nanochat_runs
    ref, got, neg = records(tmp / "ref"), records(tmp / "pp2"), records(tmp / "neg")
    assert len(got) == len(ref) == STEPS
    pp2 = {key: max(abs(r[key] - g[key]) / abs(r[key]) for r, g in zip(ref, got)) for key in ("loss", "grad_norm")}
    bad = {key: max(abs(r[key] - g[key]) / abs(r[key]) for r, g in zip(ref, neg)) for key in ("loss", "grad_norm")}
    assert pp2["loss"] <= 1e-5 and pp2["grad_norm"] <= 1e-4, (pp2, bad)
    assert abs(ref[-1]["valid_loss"] - got[-1]["valid_loss"]) <= 1e-5
    # with virtual stages x0 crosses every chunk boundary, rank 1 → rank 0 too
    vpp2 = records(tmp / "vpp2")
    assert max(abs(r[key] - g[key]) / abs(r[key]) for r, g in zip(ref, vpp2) for key in ("loss", "grad_norm")) <= 1e-4
    assert max(abs(r["loss"] - g["loss"]) / abs(r["loss"]) for r, g in zip(ref, vpp2)) <= 1e-5
    # the trained weights, consolidated from the stages, are the one process's; negative control:
    # without x0's gradient from stage 2 the input embedding trains otherwise
    weights = {run: final_weights(tmp / run) for run in ("ref", "pp2", "neg")}
    assert weights["pp2"].keys() == weights["ref"].keys()
    gap = max((weights["pp2"][k] - weights["ref"][k]).abs().max().item() for k in weights["ref"])
    embedding = "embedding.word_embeddings.weight"
    wrong = (weights["neg"][embedding] - weights["ref"][embedding]).abs().max().item()
    assert gap < 1e-5 and wrong > 100 * max(gap, 1e-7), (gap, wrong)


@pytest.mark.slow
def test_nanochat_pipeline_resume_is_exact(nanochat_runs, resumed):
    tmp, _ = nanochat_runs
    assert [r["loss"] for r in records(resumed["nanochat"])] == [r["loss"] for r in records(tmp / "pp2")]


def test_uneven_stages_split_as_megatron_does(monkeypatch):
    """ModelLayout.stage_layers (what the specs, the planner and the checks use) against megatron's
    get_transformer_layer_offset for first/last stage counts set, unset or both; the checks refuse
    splits that do not add up."""
    from types import SimpleNamespace

    from megatron.core.transformer import transformer_layer

    from megatron_kappa.model.layout import model_layout
    for layers, pp, first, last in ((5, 2, 3, None), (5, 2, None, 1), (61, 16, 4, 1), (10, 4, 1, 3), (7, 3, 1, None),
                                    (8, 4, None, None)):
        sets = [f"model.num_layers={layers}", f"parallel.pp={pp}", "model.layout=moe", "model.first_dense=1",
                f"parallel.first_stage_layers={first if first else 'null'}",
                f"parallel.last_stage_layers={last if last else 'null'}"]
        shape = model_layout(load_config("configs/tiny.yaml", sets))
        config = SimpleNamespace(pipeline_model_parallel_size=pp, pipeline_model_parallel_layout=None,
                                 num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                                 num_layers=layers, virtual_pipeline_model_parallel_size=None,
                                 account_for_embedding_in_pipeline_split=False,
                                 account_for_loss_in_pipeline_split=False)
        offsets = [transformer_layer.get_transformer_layer_offset(config, pp_rank=r) for r in range(pp)]
        assert [shape.stage_layers(r)[0] for r in range(pp)] == offsets, (layers, pp, first, last)
        assert shape.stage_layers(pp - 1)[1] == layers and sum(shape.stage_counts()) == layers
    for sets in (["model.num_layers=5", "parallel.pp=2", "parallel.first_stage_layers=5"],
                 ["model.num_layers=10", "parallel.pp=4", "parallel.first_stage_layers=2"],
                 ["parallel.first_stage_layers=2"]):
        with pytest.raises(ConfigError, match="parallel.first_stage_layers"):
            load_config("configs/tiny.yaml", sets)


def test_layout_strings_split_as_megatron_does():
    """parallel.layout (megatron's pipeline_model_parallel_layout): ModelLayout's stages against
    megatron's own parse of the string (PipelineParallelLayerLayout: each stage's offset and layer
    count), repeats and groups included, and stages without a decoder layer (the planner's; the
    trainer's preflight refuses them: tests/test_preflight.py); the checks refuse what megatron
    does not run, each in one line naming the key."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from megatron_kappa.model.layout import model_layout
    for layers, pp, mtp, text in ((5, 2, 0, "Et*3|ttL"), (5, 2, 0, "Ett|t*3L"), (10, 4, 0, "Et|(t*3|)*2t*3L"),
                                  (61, 16, 1, "Et*3|(t*4|)*14t*2mL"), (7, 3, 1, "Et,t|ttt|ttmL"),
                                  (5, 3, 0, "E|t*5|L"), (7, 3, 1, "Et|t*6|mL")):  # stages without a decoder layer
        cfg = load_config("configs/tiny.yaml", [f"model.num_layers={layers}", f"parallel.pp={pp}",
                                                f"model.mtp.num_layers={mtp}", f"parallel.layout={text}"])
        shape, theirs = model_layout(cfg), PipelineParallelLayerLayout(text, pp)
        assert theirs.validate_layer_layout(layers, mtp or None) is False  # megatron accepts it too
        for r in range(pp):
            start, stop = shape.stage_layers(r)
            assert start == theirs.get_layer_offset(vp_stage=0, pp_rank=r), (text, r)
            assert stop - start == theirs.get_num_layers_to_build(vp_stage=0, pp_rank=r), (text, r)
    refused = {"t*5|L": "E (the embedding) must open the first stage",
               "Et*3|tt": "L (the loss) must close the last stage",
               "Et*3|t*3L": "places 6 decoder layers (t); model.num_layers is 5",
               "Et*2|t*2|tL": "has 3 entries for parallel.pp=2 × parallel.vpp=1",
               "Et*3|ttxL": "unknown layer 'x'",
               "Et*3|tmtL": "MTP layers (m) before L"}
    for text, message in refused.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config("configs/tiny.yaml", ["model.num_layers=5", "parallel.pp=2", f"parallel.layout={text}",
                                              "model.mtp.num_layers=1" if "m" in text else "model.mtp.num_layers=0"])
    with pytest.raises(ConfigError, match="parallel.layout: set with parallel.first_stage_layers"):
        load_config("configs/tiny.yaml", ["model.num_layers=5", "parallel.pp=2", "parallel.layout=Et*3|ttL",
                                          "parallel.first_stage_layers=3"])
    with pytest.raises(ConfigError, match="parallel.layout: needs parallel.pp > 1"):
        load_config("configs/tiny.yaml", ["parallel.layout=Et*4L"])


# 5 layers on 2 stages, 3 on the first (the layer numbers, the MoE pattern and the checkpoint
# coordinates follow megatron's uneven split)
UNEVEN = ["model.num_layers=5", "parallel.pp=2", "parallel.first_stage_layers=3"]
PP2 = {"base": LAYOUTS["pp2"][1], "nanochat": ["parallel.pp=2"], "uneven": UNEVEN[1:]}  # stage_runs' PP2 runs
LAYOUT_STRING = ["parallel.pp=2", "parallel.layout=Ett|t*3L"]  # the same 5 layers split 2 + 3 by megatron's string
# virtual stages: 4 layers in 4 chunks of one (rank 0 holds layers 0 and 2); 5 layers by a string
# of pp × vpp entries, chunk c on rank c mod 2 (rank 0: layers 0, 2; rank 1: layers 1, 3, 4)
VPP = ["parallel.pp=2", "parallel.vpp=2"]
VPP_LAYOUT = ["parallel.pp=2", "parallel.vpp=2", "parallel.layout=Et|t|t|ttL"]


def uneven_sets(tmp):
    from tests.support.weights import save_init_weights
    init = save_init_weights(tmp / "init.pt", COMMON + UNEVEN[:1])
    return tmp, COMMON + UNEVEN[:1] + [f"train.init_weights={init}"]


@pytest.fixture(scope="module")
def uneven_runs(stage_runs):
    tmp, sets = stage_runs["uneven"]
    return tmp, sets + UNEVEN[2:]


@pytest.mark.slow
def test_uneven_stages_match_one_process_resume_and_consolidate(uneven_runs, resumed):
    tmp, _ = uneven_runs
    assert_same_run(records(tmp / "ref"), records(tmp / "pp2"), "uneven pp2")
    assert [r["loss"] for r in records(resumed["uneven"])] == [r["loss"] for r in records(tmp / "pp2")]
    weights = assert_consolidates_and_evaluates_as_one_process(tmp, "pp2")
    assert any(".layers.4." in k for k in weights)


def assert_consolidates_and_evaluates_as_one_process(tmp, run) -> dict:
    """The run's last checkpoint, consolidated, has the one-process run's (tmp/ref) weights
    (< 1e-5) and evaluates to its logits (< 1e-4); returns the consolidated weights."""
    import torch

    from megatron_kappa.evaluation.loading import load_model_for_eval
    weights = {name: final_weights(tmp / name) for name in ("ref", run)}
    assert weights[run].keys() == weights["ref"].keys()
    assert max((weights[run][k] - weights["ref"][k]).abs().max().item() for k in weights["ref"]) < 1e-5
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(3))
    logits = {name: load_model_for_eval(tmp / name)[0](tokens) for name in (run, "ref")}
    assert (logits[run] - logits["ref"]).abs().max().item() < 1e-4
    return weights[run]


@pytest.mark.slow
def test_a_layout_string_splits_the_stages_and_matches_one_process(uneven_runs):
    """parallel.layout=Ett|t*3L: 2 layers on the first stage, 3 on the second (the checkpoint's
    coordinates and weights say so; first_stage_layers=3 puts 3 first), trained as one process."""
    from megatron_kappa.checkpoint.store import Checkpoints
    tmp, _ = uneven_runs
    assert_same_run(records(tmp / "ref"), records(tmp / "layout"), "layout string")
    ckpts = Checkpoints(tmp / "layout")
    files = ckpts.rank_files(ckpts.latest())
    assert [f["coords"]["layer_offset"] for f in files] == [0, 2]
    layers = [{int(k.split(".")[2]) for k in f["weights"] if k.startswith("decoder.layers.")} for f in files]
    assert layers == [{0, 1}, {0, 1, 2}]  # each stage numbers its own layers from 0
    assert final_weights(tmp / "layout").keys() == final_weights(tmp / "ref").keys()


def test_pipeline_refusals():
    for setting, message in (("zero.stage=2", "zero.stage: 2 with parallel.pp=2: ZeRO-2"),
                             ("eval.core_every=10", "eval.core_every"),
                             ("model.moe.router=softmoe", "softmoe")):
        with pytest.raises(ConfigError, match=message):
            load_config("configs/tiny.yaml", ["parallel.pp=2", setting])
        load_config("configs/tiny.yaml", ["parallel.pp=1", setting])  # each is fine without stages
    load_config("configs/tiny.yaml", ["parallel.pp=2"])
    with pytest.raises(ConfigError, match="num_layers=4 is not divisible by pp=3"):
        load_config("configs/tiny.yaml", ["parallel.pp=3"])


def test_layer_names_shift_by_the_stage_offset():
    from types import SimpleNamespace

    from megatron_kappa.model.layout import global_layer_index, layer_label, shift_layers
    assert shift_layers("decoder.layers.0.mlp.experts.fc1_weight", 2) == "decoder.layers.2.mlp.experts.fc1_weight"
    assert shift_layers("decoder.layers.1.self_attention.linear_qkv.weight", 0) == \
        "decoder.layers.1.self_attention.linear_qkv.weight"
    assert shift_layers("embedding.word_embeddings.weight", 2) == "embedding.word_embeddings.weight"
    # only the first `layers.<i>.` is the decoder's (a module could hold layers of its own)
    assert shift_layers("decoder.layers.1.mlp.layers.0.w", 2) == "decoder.layers.3.mlp.layers.0.w"
    # an MTP module's depth is not a decoder layer (it sits on the last stage, whatever its offset)
    assert shift_layers("mtp.layers.0.transformer_layer.mlp.router.weight", 2) == \
        "mtp.layers.0.transformer_layer.mlp.router.weight"
    stage = SimpleNamespace(decoder=SimpleNamespace(layers=[SimpleNamespace(layer_number=3)]))  # first layer 2
    assert global_layer_index(stage, "decoder.layers.1.mlp.experts") == 3
    assert global_layer_index(stage, "module.decoder.layers.0.mlp") == 2
    assert layer_label(stage, "decoder.layers.1.mlp") == "layer3"
    assert layer_label(stage, "mtp.layers.0.transformer_layer.mlp") == "mtp0"


def stage_layers(run_dir) -> list[set[int]]:
    """The decoder layers each rank file of the run's latest checkpoint holds, by name."""
    from megatron_kappa.checkpoint.store import Checkpoints
    ckpts = Checkpoints(run_dir)
    return [{int(k.split(".")[2]) for k in f["weights"] if k.startswith("decoder.layers.")}
            for f in ckpts.rank_files(ckpts.latest())]


@pytest.mark.slow
def test_virtual_stages_match_one_process_resume_consolidate_and_evaluate(runs, resumed):
    """PP2 × VPP2 (megatron's interleaved 1F1B over 4 chunks of one layer) against one process from
    the same weights: losses, gradient norms (clipping active) and the validation loss ≤ 1e-5, κ's
    statistics by global layer; an exact resume from step 1; the checkpoint holds each rank's
    interleaved layers under the full model's numbers, consolidates to the one process's weights
    and evaluates to its logits."""
    tmp, _ = runs
    ref, got = records(tmp / "ref"), records(tmp / "vpp2")
    assert_same_run(ref, got, "pp2 x vpp2")
    # negative control: megatron's batched p2p ops (its default) on gloo swap the activation and
    # the gradient that both go to the one other rank (model/build.py: batch_p2p_comm)
    bad = records(tmp / "vpp2_batched")
    assert max(abs(r["loss"] - b["loss"]) for r, b in zip(ref, bad)) > 1e-4, bad
    kappa = [k for k in ref[-1] if k.endswith(("/alpha_abs", "/bias_abs"))]
    assert len(kappa) == 6 and all(got[-1][k] == pytest.approx(ref[-1][k], rel=1e-6) for k in kappa)
    assert [r["loss"] for r in records(resumed["vpp2"])] == [r["loss"] for r in got]
    assert stage_layers(tmp / "vpp2") == [{0, 2}, {1, 3}]  # interleaved, not contiguous
    assert_consolidates_and_evaluates_as_one_process(tmp, "vpp2")


@pytest.mark.slow
def test_a_virtual_layout_string_splits_the_chunks_and_matches_one_process(uneven_runs):
    """parallel.layout=Et|t|t|ttL with vpp=2: 5 layers in 4 chunks, the last holding 2 and the loss;
    chunk c on rank c mod 2, trained as one process."""
    tmp, _ = uneven_runs
    assert_same_run(records(tmp / "ref"), records(tmp / "vpp_layout"), "virtual layout string")
    assert stage_layers(tmp / "vpp_layout") == [{0, 2}, {1, 3, 4}]
    assert final_weights(tmp / "vpp_layout").keys() == final_weights(tmp / "ref").keys()


def test_virtual_stages_split_as_megatron_does(monkeypatch):
    """parallel.vpp: each model chunk's layers (ModelLayout.stage_layers(stage, vp_stage)) against
    megatron's get_transformer_layer_offset for an even split and its own parse of layout strings
    with pp × vpp entries; the checks refuse what interleaved 1F1B cannot run, in one line each."""
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps
    from megatron.core.transformer import transformer_layer
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from megatron_kappa.model.layout import model_layout
    for layers, pp, vpp in ((4, 2, 2), (12, 2, 3), (16, 4, 2)):
        monkeypatch.setattr(ps, "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", vpp)
        shape = model_layout(load_config("configs/tiny.yaml", [f"model.num_layers={layers}", f"parallel.pp={pp}",
                                                               f"parallel.vpp={vpp}"]))
        config = SimpleNamespace(pipeline_model_parallel_size=pp, pipeline_model_parallel_layout=None,
                                 num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
                                 num_layers=layers, virtual_pipeline_model_parallel_size=vpp,
                                 account_for_embedding_in_pipeline_split=False,
                                 account_for_loss_in_pipeline_split=False)
        for r in range(pp):
            for v in range(vpp):
                start, stop = shape.stage_layers(r, v)
                assert start == transformer_layer.get_transformer_layer_offset(config, vp_stage=v, pp_rank=r)
                assert stop - start == layers // (pp * vpp)
        assert shape.stage_counts() == [layers // pp] * pp
    for layers, pp, vpp, text in ((5, 2, 2, "Et|t|t|ttL"), (8, 2, 2, "Ett|t|ttt|ttL"), (8, 3, 2, "Et|t|t|tt|t|ttL")):
        monkeypatch.setattr(ps, "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", vpp)
        shape = model_layout(load_config("configs/tiny.yaml", [f"model.num_layers={layers}", f"parallel.pp={pp}",
                                                               f"parallel.vpp={vpp}", f"parallel.layout={text}"]))
        theirs = PipelineParallelLayerLayout(text, pp)
        assert theirs.virtual_pipeline_model_parallel_size == vpp
        for r in range(pp):
            for v in range(vpp):
                start, stop = shape.stage_layers(r, v)
                assert start == theirs.get_layer_offset(vp_stage=v, pp_rank=r), (text, r, v)
                assert stop - start == theirs.get_num_layers_to_build(vp_stage=v, pp_rank=r), (text, r, v)
        assert sum(shape.stage_counts()) == layers
    refused = {("parallel.pp=1", "parallel.vpp=2"): "parallel.vpp: 2 needs parallel.pp > 1",
               ("parallel.pp=2", "parallel.vpp=3"): "not divisible by pp × vpp = 6",
               ("parallel.pp=2", "parallel.vpp=2",
                "parallel.first_stage_layers=2"): "give uneven chunks as parallel.layout",
               ("parallel.pp=2", "parallel.vpp=2",
                "parallel.layout=Et|t|ttL"): "3 entries for parallel.pp=2 × parallel.vpp=2",
               ("parallel.pp=2", "parallel.vpp=2", "model.num_layers=5", "model.mtp.num_layers=1",
                "parallel.layout=Et|t|tm|ttL"): "MTP layers (m) before L"}
    for sets, message in refused.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config("configs/tiny.yaml", list(sets))


def test_virtual_stage_micro_batches_come_in_groups_of_pp():
    """megatron's interleaved schedule runs a rank's micro-batches in groups of pp: the preflight
    refuses other counts before anything starts, naming the key."""
    from megatron_kappa.preflight import check_parallel
    sets = ["parallel.pp=2", "parallel.vpp=2", "train.micro_batch=2"]
    check_parallel(load_config("configs/tiny.yaml", sets + ["train.global_batch=8", "eval.valid_iters=4"]), 2)
    with pytest.raises(ConfigError, match=re.escape("train.global_batch: 3 micro-batches per rank")):
        check_parallel(load_config("configs/tiny.yaml", sets + ["train.global_batch=6", "eval.valid_iters=4"]), 2)
    with pytest.raises(ConfigError, match=re.escape("eval.valid_iters: 3 micro-batches per rank")):
        check_parallel(load_config("configs/tiny.yaml", sets + ["train.global_batch=8", "eval.valid_iters=3"]), 2)
    check_parallel(load_config("configs/tiny.yaml", ["parallel.pp=2", "train.micro_batch=2", "train.global_batch=6",
                                                     "eval.valid_iters=3"]), 2)  # fine without virtual stages
    check_parallel(load_config("configs/tiny.yaml", sets + ["train.global_batch=8", "eval.valid_iters=3",
                                                            "eval.valid_every=0"]), 2)  # no validation: not checked


def test_a_rank_s_chunks_are_one_module_under_the_full_model_s_names():
    """VirtualStages names each chunk's layers by their global index and its own parts where the
    chunk holds them; every parameter appears once; a part held twice or left unnamed is refused."""
    import torch
    from torch import nn

    from megatron_kappa.model.layout import global_layer_index, layer_offset
    from megatron_kappa.model.virtual_stages import VirtualStages, chunks_of

    class Layer(nn.Module):
        def __init__(self, number):
            super().__init__()
            self.layer_number, self.w = number, nn.Parameter(torch.full((2,), float(number)))

    def chunk(numbers, pre=False, post=False):
        c = nn.Module()
        c.config, c.pre_process, c.post_process = None, pre, post
        c.decoder = nn.Module()
        c.decoder.layers = nn.ModuleList(Layer(n) for n in numbers)
        c.decoder.final_layernorm = nn.LayerNorm(2) if post else None
        c.embedding = nn.Embedding(3, 2) if pre else None
        c.output_layer = nn.Linear(2, 3) if post else None
        c.rotary_pos_emb = nn.Identity()  # no parameters: stays with its chunk
        return c

    first, second = chunk([1, 2], pre=True), chunk([5, 6], post=True)  # rank 0 of PP2 × VPP2, 8 layers
    view = VirtualStages([first, second])
    names = [n for n, _ in view.named_parameters()]
    assert names == ["decoder.layers.0.w", "decoder.layers.1.w", "decoder.layers.4.w", "decoder.layers.5.w",
                     "decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "embedding.weight",
                     "output_layer.weight", "output_layer.bias"]
    assert len(names) == len({id(p) for c in (first, second) for p in c.parameters()})
    assert view.pre_process and view.post_process and chunks_of(view) == [first, second]
    assert layer_offset(view) == 0 and global_layer_index(view, "decoder.layers.4.w") == 4
    view.eval()
    assert not first.training and not second.training and not first.decoder.layers[0].training
    with pytest.raises(ValueError, match="two model chunks of this rank hold 'embedding'"):
        VirtualStages([chunk([1], pre=True), chunk([3], pre=True)])
    odd = chunk([1])
    odd.scale = nn.Parameter(torch.ones(1))  # held by the chunk itself, in no part the view places
    with pytest.raises(ValueError, match="'' of a model chunk has no name in the rank's view"):
        VirtualStages([odd])


def test_the_stage_split_is_part_of_the_recorded_layout():
    """A checkpoint's layout record (meta.json) names virtual stages and an uneven split, so a
    resume in another split is a layout change (weights through the full model's names, no RNG
    states restored); an even PP2 split records as before."""
    from megatron_kappa.parallel.layout import layout_record
    def record(sets):
        return layout_record(load_config("configs/tiny.yaml", ["parallel.pp=2", *sets]).parallel, 2)

    assert record([]) == {"world": 2, "tp": 1, "ep": 1, "etp": 1, "pp": 2}
    splits = [["parallel.vpp=2"], ["parallel.first_stage_layers=1"], ["parallel.last_stage_layers=1"],
              ["parallel.layout=Et|tttL"], ["parallel.layout=Ett|ttL"]]
    records = [record(sets) for sets in splits]
    assert all(r != record([]) for r in records) and len({str(r) for r in records}) == len(records)
