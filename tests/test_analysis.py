"""The paper's analyses as metrics (megatron_kappa.metrics.paper_analyses) against direct computations:
known geometry (a router vector equal to a gate row gives alignment 1, orthogonal gives 0), a
naive float64 loop over routed pairs, megatron's capacity rule, and, in tests/support/analysis_worker.py,
the same numbers from TP / EP / ETP layouts on 4 processes."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_kappa.config import load_config
from megatron_kappa.metrics import paper_analyses as analysis
from megatron_kappa.parallel.groups import init_distributed
from tests.support import analysis_reference as ref
from tests.support import parity

ROOT = Path(__file__).resolve().parents[1]


def model_for(overrides=(), seed=5, reference_weights=True):
    cfg = load_config("configs/tiny.yaml", [f"model.seq_length={parity.SEQ}", *overrides])
    init_distributed(cfg.parallel, seed=seed, device="cpu")
    model = parity.build(cfg, seed)
    if reference_weights:
        parity.init_reference_weights(model)  # α, b ≠ 0 and routers with large logits
    return cfg, model


def forward(model, batch=None):
    tokens = parity.global_batch()[0][:, :-1] if batch is None else batch
    with torch.no_grad():
        model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)


def full_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def set_geometry(model, rows):
    """Router vector of expert e = 3·unit_e; gate row j of expert e = rows(e, j, unit_e)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, layer in ref.moe_layers(model):
            weight = layer.router.weight
            experts, hidden = weight.shape
            unit = torch.eye(hidden)[:experts]
            weight.copy_(3.0 * unit)
            gates = analysis.gate_weights(layer.experts)
            for e in range(experts):
                for j in range(gates.shape[1]):
                    gates[e, j] = rows(e, j, unit[e], torch.randn(hidden, generator=gen))


def orthogonal(u, v):
    return v - (v @ u) * u


def test_alignment_of_known_geometry(world1):
    cfg, model = model_for(reference_weights=False)
    # even gate rows along the router vector (cos 1), odd rows orthogonal to it (cos 0)
    set_geometry(model, lambda e, j, u, v: 2.0 * u if j % 2 == 0 else orthogonal(u, v))
    layers = ref.moe_layers(model)
    assert [i for i, _ in layers] == [1, 2, 3]  # tiny: first layer dense
    for _, layer in layers:
        table = analysis.expert_table(layer)
        expected = torch.zeros_like(table["cos"])
        expected[:, 0::2] = 1.0
        torch.testing.assert_close(table["cos"], expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(table["proj"], 2.0 * expected, atol=1e-5, rtol=0)
    forward(model)
    stats = analysis.analysis_stats(model, cfg.model, torch.device("cpu"), tokens=None, values=None)
    for i, _ in layers:
        assert stats[f"align/layer{i}/mean"] == pytest.approx(0.5, abs=1e-6)
        assert stats[f"align/layer{i}/bottom5"] == pytest.approx(0.0, abs=1e-6)
        assert stats[f"align/layer{i}/top5"] == pytest.approx(1.0, abs=1e-6)
    # negative controls: all rows orthogonal → 0; all rows opposite → −1
    set_geometry(model, lambda e, j, u, v: orthogonal(u, v))
    stats = analysis.analysis_stats(model, cfg.model, torch.device("cpu"), tokens=None, values=None)
    assert all(abs(stats[f"align/layer{i}/{k}"]) < 1e-6 for i, _ in layers for k in ("mean", "bottom5", "top5"))
    set_geometry(model, lambda e, j, u, v: -u)
    stats = analysis.analysis_stats(model, cfg.model, torch.device("cpu"), tokens=None, values=None)
    assert stats["align/layer1/mean"] == pytest.approx(-1.0, abs=1e-6)


def test_gate_bias_of_known_geometry(world1):
    """Gate rows 2·r̂ (and orthogonal): the bias of a routed token is 2·x_e (and 0), x_e being its
    coordinate along r̂_e = unit_e; its cosine with r_e is x_e / |x|."""
    cfg, model = model_for(reference_weights=False)
    set_geometry(model, lambda e, j, u, v: 2.0 * u if j % 2 == 0 else orthogonal(u, v))
    seen = ref.capture_routing(model)
    analysis.watch_routers(model)
    forward(model)
    for index, layer in ref.moe_layers(model):
        x, routed = seen[index]
        got_x, expert = analysis.routed_sample(layer, None, torch.Generator())
        token, expected_expert = routed.nonzero(as_tuple=True)
        assert torch.equal(expert, expected_expert)
        torch.testing.assert_close(got_x.double(), x[token], rtol=0, atol=0)
        coordinate = x[token, expected_expert]
        bias = analysis.expert_table(layer)["proj"][expert].double() * coordinate[:, None]
        torch.testing.assert_close(bias[:, 0::2], 2.0 * coordinate[:, None].expand(-1, bias.shape[1] // 2), atol=1e-5,
                                   rtol=1e-5)
        assert bias[:, 1::2].abs().max() < 1e-5


@pytest.mark.parametrize("variant", ["kappa", "kappa-sequential", "swiglu", "kappa-no-alpha", "authors-scale",
                                     "softmoe"])
def test_metrics_match_naive_loops(world1, variant):
    overrides = {"kappa": [], "kappa-sequential": ["model.moe.grouped_gemm=false"],
                 "swiglu": ["model.kappa.enabled=false"], "kappa-no-alpha": ["model.kappa.use_alpha=false"],
                 "authors-scale": ["model.kappa.logit_scale=0.15"],
                 "softmoe": ["model.moe.router=softmoe"]}[variant]  # variable experts per token
    cfg, model = model_for(overrides)
    seen = ref.capture_routing(model)
    analysis.watch_routers(model)
    forward(model)
    stats = analysis.analysis_stats(model, cfg.model, torch.device("cpu"), tokens=None, values=None)
    state = full_state(model)
    expected = {}
    for index, _ in ref.moe_layers(model):
        expected.update(ref.layer_reference(state, index, *seen[index], topk=cfg.model.moe.topk,
                                            logit_scale=cfg.model.kappa.logit_scale))
    ref.assert_close_stats(stats, expected, rel=1e-5, abs_=1e-6)
    assert set(stats) == set(expected)  # nothing extra, nothing missing (α-metrics only with α)
    assert ("kappa/layer1/alpha_s_abs" in stats) == (variant in ("kappa", "kappa-sequential", "authors-scale",
                                                                 "softmoe"))
    # Negative control: pairing each expert with its neighbour's router vector is caught.
    shifted = {}
    for index, _ in ref.moe_layers(model):
        shifted.update(ref.layer_reference(state, index, *seen[index], topk=cfg.model.moe.topk,
                                           logit_scale=cfg.model.kappa.logit_scale, expert_shift=1))
    assert ref.max_rel_gap(stats, shifted) > 1e-2


def test_load_and_dropped_tokens_follow_the_capacity_rule(world1):
    cfg, model = model_for(["model.moe.capacity_factor=0.5"])
    seen = ref.capture_routing(model)
    analysis.watch_routers(model)
    forward(model)
    stats = analysis.analysis_stats(model, cfg.model, torch.device("cpu"), tokens=None, values=None)
    state, topk = full_state(model), cfg.model.moe.topk
    for index, _ in ref.moe_layers(model):
        x, routed = seen[index]
        ref.assert_close_stats(stats, ref.layer_reference(state, index, x, routed, topk=topk, capacity_factor=0.5),
                               rel=1e-5, abs_=1e-6)
        # megatron's rule, recomputed: capacity ceil(T·k/E·cf) per expert; the rest of its demand
        # (top-k of the logits) is dropped
        logits = x @ state[f"decoder.layers.{index}.mlp.router.weight"].double().T
        demand = torch.zeros(logits.shape[1])
        for row in logits.topk(topk, dim=-1).indices:
            demand[row] += 1
        capacity = math.ceil(x.shape[0] * topk / logits.shape[1] * 0.5)
        dropped = (demand - capacity).clamp_min(0).sum().item()
        assert dropped > 0
        assert stats[f"load/layer{index}/dropped_frac"] == pytest.approx(dropped / (topk * x.shape[0]), abs=1e-12)
        assert stats[f"load/layer{index}/max"] <= capacity
    # without a capacity nothing is dropped and no dropped_frac is logged
    cfg, model = model_for()
    analysis.watch_routers(model)
    forward(model)
    stats = analysis.analysis_stats(model, cfg.model, torch.device("cpu"))
    assert not any(k.endswith("dropped_frac") for k in stats) and "load/layer1/cv" in stats


def test_sampling_bounds(world1):
    cfg, model = model_for()
    analysis.watch_routers(model)
    forward(model)
    layer = ref.moe_layers(model)[0][1]
    x, expert = analysis.routed_sample(layer, 8, torch.Generator().manual_seed(0))
    assert x.shape[0] == expert.shape[0] == 8 * cfg.model.moe.topk  # 8 tokens, each routed top-k times
    assert analysis._subsample(torch.arange(10_000.0), 1000, torch.Generator()).numel() == 1000
    sampled = analysis.analysis_stats(model, cfg.model, torch.device("cpu"), tokens=8, values=1000)
    exact = analysis.analysis_stats(model, cfg.model, torch.device("cpu"), tokens=None, values=None)
    assert sampled.keys() == exact.keys()
    assert sampled["align/layer1/mean"] == exact["align/layer1/mean"]  # the weights are not sampled
    assert sampled["load/layer1/cv"] == exact["load/layer1/cv"]        # nor are the loads


def test_watch_keeps_references_not_copies(world1):
    cfg, model = model_for()
    analysis.watch_routers(model)
    analysis.watch_routers(model)  # idempotent: one hook per router
    inputs = {}
    for index, layer in ref.moe_layers(model):
        layer.router.register_forward_pre_hook(lambda m, args, i=index: inputs.__setitem__(i, args[0]))
    forward(model)
    for index, layer in ref.moe_layers(model):
        x, routing_map = layer.router.last_routing
        assert x.data_ptr() == inputs[index].data_ptr() and not x.requires_grad
        assert routing_map.dtype == torch.bool
        assert len(layer.router._forward_hooks) == 1


@pytest.fixture(scope="module")
def parallel_runs(world1, tmp_path_factory):
    """All layouts in one 4-process torchrun launch (tests/support/analysis_worker.py); references here."""
    tmp = tmp_path_factory.mktemp("analysis")
    plan, refs = [], {}
    for name, kw in CASES.items():
        cfg, model = model_for([f"model.kappa.enabled={str(kw['kappa']).lower()}",
                                f"model.moe.grouped_gemm={str(kw.get('grouped', True)).lower()}"])
        analysis.watch_routers(model)
        forward(model)
        refs[name] = {"stats": analysis.analysis_stats(model, cfg.model, torch.device("cpu"), tokens=None, values=None),
                      "table": analysis.expert_table(ref.moe_layers(model)[0][1])}
        plan.append({"name": name, **kw, "weights": full_state(model)})
    torch.save(plan, tmp / "plan.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                           str(ROOT / "tests/support/analysis_worker.py"), str(tmp / "plan.pt"), str(tmp / "out.pt")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return refs, torch.load(tmp / "out.pt", weights_only=False)


CASES = {  # tp, ep, etp on 4 ranks (DP = 4 / tp)
    "tp2": dict(tp=2, ep=1, etp=None, kappa=True), "ep2": dict(tp=1, ep=2, etp=None, kappa=True),
    "ep4": dict(tp=1, ep=4, etp=None, kappa=True),
    "tp2ep2_etp1": dict(tp=2, ep=2, etp=1, kappa=True), "tp2ep2_etp2": dict(tp=2, ep=2, etp=2, kappa=True),
    "tp2ep2_etp2-swiglu": dict(tp=2, ep=2, etp=2, kappa=False),
    "tp2ep2_etp2-sequential": dict(tp=2, ep=2, etp=2, kappa=True, grouped=False),
    "ep2-NEG-bad_expert_map": dict(tp=1, ep=2, etp=None, kappa=True, negative="bad_expert_map"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CASES if "NEG" not in n])
def test_parallel_layouts_give_the_single_process_metrics(parallel_runs, name):
    refs, got = parallel_runs
    expected, result = refs[name], got[name]
    for rank_stats in result["stats"]:  # every rank returns the same numbers
        ref.assert_close_stats(rank_stats, expected["stats"], rel=1e-5, abs_=1e-6)
        assert set(rank_stats) == set(expected["stats"])
    for key in ("cos", "proj", "alpha", "bias"):  # the gathered per-(expert, row) table, entry by entry
        if expected["table"][key] is None:
            assert result["table"][key] is None
        else:
            torch.testing.assert_close(result["table"][key], expected["table"][key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_parallel_negative_control_is_caught(parallel_runs):
    refs, got = parallel_runs
    name = "ep2-NEG-bad_expert_map"
    assert ref.max_rel_gap(got[name]["stats"][0], refs[name]["stats"]) > 1e-2


@pytest.mark.slow
def test_training_run_logs_the_analyses(world1, tmp_path):
    """Through the training loop: the first logged step already has every analysis metric."""
    from megatron_kappa.train.loop import run
    cfg = load_config("configs/tiny.yaml", [f"run.dir={tmp_path}", "train.steps=2", "log.interval=1",
                                            "data.mock=true", "model.seq_length=32", "eval.valid_every=0",
                                            "log.tensorboard=false", "model.moe.capacity_factor=1.0"])
    run(cfg, log=lambda *a: None)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first, last = json.loads(lines[0]), json.loads(lines[-1])
    for i in (1, 2, 3):
        for key in ("align/layer{}/mean", "gate_bias/layer{}/top5", "gate_bias/layer{}/bottom5",
                    "token_cos/layer{}/mean", "load/layer{}/cv", "load/layer{}/dropped_frac",
                    "kappa/layer{}/top5", "kappa/layer{}/alpha_pos_mean", "kappa/layer{}/alpha_s_abs"):
            assert math.isfinite(first[key.format(i)]), key.format(i)
    # The figures: every one written; the checkpoint's alignment (analysis/plots.py's own
    # computation from the consolidated weights) is what the last step logged.
    from megatron_kappa.analysis import plots
    from megatron_kappa.evaluation.loading import consolidated_state
    written = {p.name for p in plots.make_plots(tmp_path)}
    assert written == {"overview.png", "loss.png", "kappa.png", "alpha_b.png", "alignment.png", "gate_bias.png",
                       "token_cos.png", "load.png", "dropped.png", "alignment_final.png", "kappa_params_final.png"}
    # every axis labelled with its unit, tokens beside steps, no path in a title
    from tests.support.figure_checks import problems
    for name, fig in plots.build_figures(tmp_path).items():
        assert problems(fig) == [], name
        plots.plt.close(fig)
    assert all((tmp_path / "plots" / name).stat().st_size > 1000 for name in written)
    tables = plots.final_tables(consolidated_state(tmp_path))
    assert sorted(tables) == [1, 2, 3]
    for i, table in tables.items():
        assert table["cos"].double().mean().item() == pytest.approx(last[f"align/layer{i}/mean"], abs=1e-6)
        assert table["alpha"].shape == (4, 256) and table["bias"].shape == (4, 256)
    assert plots.main([str(tmp_path / "nowhere")]) == 2


def test_kappa_range_reads_the_last_logged_quantiles(tmp_path, capsys):
    """analysis.kappa_range: per layer, the last logged 5 %/95 % κ quantiles and the band verdict;
    a run without κ statistics is an error (status 1), not an empty table."""
    from megatron_kappa.analysis import kappa_range
    run = tmp_path / "study/runs/kappa-seed1"
    run.mkdir(parents=True)
    rows = [{"step": 10, "kappa/layer1/bottom5": 0.99, "kappa/layer1/top5": 1.01,
             "kappa/layer2/bottom5": 0.5, "kappa/layer2/top5": 1.5},
            {"step": 20, "loss": 3.0},
            {"step": 30, "kappa/layer1/bottom5": 0.8, "kappa/layer1/top5": 1.3,
             "kappa/layer2/bottom5": 0.95, "kappa/layer2/top5": 1.2}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert kappa_range.final_range(run) == {1: (0.8, 1.3), 2: (0.95, 1.2)}
    assert kappa_range.main([str(tmp_path / "study"), "--json", str(tmp_path / "k.json")]) == 0
    out = capsys.readouterr().out
    assert "| kappa-seed1 | 1 | 0.8000 | 1.3000 | yes |" in out
    assert "| kappa-seed1 | 2 | 0.9500 | 1.2000 | one side |" in out
    assert json.loads((tmp_path / "k.json").read_text()) == {"kappa-seed1": {"1": [0.8, 1.3], "2": [0.95, 1.2]}}
    (tmp_path / "study/runs/kappa-seed2").mkdir()
    (tmp_path / "study/runs/kappa-seed2/metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert kappa_range.main([str(tmp_path / "study")]) == 1
