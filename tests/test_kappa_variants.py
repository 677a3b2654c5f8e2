"""The `model.kappa.input` variants own their transform (megatron_kappa.kappa.inputs.VARIANTS): a
variant registered at run time is accepted by the config, applied by the router, followed by the
analysis metrics and trained with, no other module told about it; and for every registered
variant the analysis metrics see what κ sees."""
import dataclasses
import json

import pytest
import torch

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.kappa import inputs as kappa_inputs
from megatron_kappa.metrics import paper_analyses as analysis
from megatron_kappa.model.build import kappa_settings
from megatron_kappa.parallel.groups import init_distributed
from tests.support import analysis_reference as ref
from tests.support import parity

BUILT_IN = list(kappa_inputs.VARIANTS)


def halve(logits, router_weight):
    return logits / 2


# The toy: κ sees s / 2, with U 2.5 (so it equals `logit` with logit_scale 0.5 and U 2.5, exactly:
# halving is exact in floating point, forward and backward)
HALVED = kappa_inputs.Variant(halve, U=2.5, logit_scale=1.0, tanh_gain=1.0, router_grad_scale=1.0,
                              u_warmup=0.0, help="a test's toy: s / 2")


@pytest.fixture
def registry():
    """The registry for one test: what the test registers is gone after it."""
    before = list(kappa_inputs.VARIANTS)
    yield kappa_inputs
    for name in [n for n in kappa_inputs.VARIANTS if n not in before]:
        kappa_inputs.VARIANTS.unregister(name)


def test_built_in_variants():
    assert BUILT_IN == ["logit", "scaled", "normalized"] and kappa_inputs.DEFAULT == "logit"
    assert [kappa_inputs.VARIANTS[n].transform for n in BUILT_IN] == [
        kappa_inputs.identity, kappa_inputs.identity, kappa_inputs.normalized_logit]
    assert [n for n in BUILT_IN if kappa_inputs.VARIANTS[n].config_scales] == ["logit"]
    from megatron_kappa.kappa import DEFAULTS
    paper = kappa_inputs.VARIANTS["logit"]
    assert (DEFAULTS.input, DEFAULTS.U, DEFAULTS.logit_scale, DEFAULTS.tanh_gain, DEFAULTS.router_grad_scale) == \
        ("logit", paper.U, paper.logit_scale, paper.tanh_gain, paper.router_grad_scale)


def test_a_registered_variant_is_accepted_by_the_config_and_applied(registry):
    with pytest.raises(ConfigError, match=r"model.kappa.input: expected one of \['logit', 'scaled', "
                                          r"'normalized'\], got 'halved'"):
        load_config(None, ["model.kappa.input=halved"])
    with pytest.raises(ValueError, match="model.kappa.input"):
        kappa_inputs.kappa_input(torch.ones(2, 4), torch.ones(4, 8), "halved", 1.0)
    registry.register("halved", HALVED)
    cfg = load_config(None, ["model.kappa.input=halved"])  # looked up when validated, not at import
    s = kappa_settings(cfg.model.kappa)
    assert (s.input, s.U, s.logit_scale, s.tanh_gain, s.router_grad_scale) == ("halved", 2.5, 1.0, 1.0, 1.0)
    assert kappa_settings(load_config(None, ["model.kappa.input=halved", "model.kappa.U=3.5"]).model.kappa).U == 3.5
    with pytest.raises(ConfigError, match="model.kappa.logit_scale: must stay 1.0 with model.kappa.input=halved"):
        load_config(None, ["model.kappa.input=halved", "model.kappa.logit_scale=0.5"])
    # the router's function: the toy's value, and the gradient scale on top of it
    logits = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    out = kappa_inputs.kappa_input(logits, torch.randn(4, 8), "halved", 0.1)
    assert torch.equal(out, logits.detach() / 2)
    out.sum().backward()
    torch.testing.assert_close(logits.grad, torch.full_like(logits, 0.05), rtol=1e-15, atol=0)
    # the help texts follow the registry
    assert "halved (a test's toy: s / 2)" in registry.input_help()
    assert registry.null_help("U") == "null: 3; 4 for input normalized; 2.5 for input halved"
    # a name is registered once; config_scales needs the config's defaults
    registry.register("halved", HALVED)  # the same again: nothing happens
    with pytest.raises(ValueError, match="already registered"):
        registry.register("halved", dataclasses.replace(HALVED, U=2.0))
    with pytest.raises(ValueError, match="identifier"):
        registry.register("two words", HALVED)
    with pytest.raises(ValueError, match="config_scales"):
        registry.register("mine", dataclasses.replace(HALVED, config_scales=True, logit_scale=0.5))
    with pytest.raises(TypeError, match="Variant"):
        registry.register("mine", {"transform": halve})


def test_the_registry_copy_is_gone_after_a_test():
    assert list(kappa_inputs.VARIANTS) == BUILT_IN


@pytest.mark.parametrize("name", BUILT_IN + ["halved"])
def test_analysis_sees_what_kappa_sees(registry, world1, name):
    """kappa/layerL/alpha_s_abs (megatron_kappa.metrics.paper_analyses) against the logits κ received
    from the router in the same forward, for every variant (and the toy, registered here)."""
    registry.register("halved", HALVED)
    cfg = load_config("configs/tiny.yaml", [f"model.seq_length={parity.SEQ}", f"model.kappa.input={name}"])
    init_distributed(cfg.parallel, seed=5, device="cpu")
    model = parity.build(cfg, 5)
    parity.init_reference_weights(model)  # α ≠ 0, router logits of a few units
    seen = {}
    for index, layer in ref.moe_layers(model):
        def keep(router, args, output, index=index):  # the router hands κ's logits on in slot 1
            seen[index] = (args[0].detach().reshape(-1, args[0].shape[-1]).double(),
                           output[0][..., 1].detach().double(), output[1].detach())
        layer.router.register_forward_hook(keep)
    analysis.watch_routers(model)
    tokens = parity.global_batch()[0][:, :-1]
    with torch.no_grad():
        model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    stats = analysis.analysis_stats(model, cfg.model, torch.device("cpu"), tokens=None, values=None)
    scale = kappa_settings(cfg.model.kappa).logit_scale
    for index, layer in ref.moe_layers(model):
        x, kappa_logits, routing_map = seen[index]
        token, expert = routing_map.reshape(kappa_logits.shape).nonzero(as_tuple=True)
        alpha = layer.experts.kappa_alpha.detach().double()[expert]                 # [P, F]
        def term(s):
            return (alpha * scale * s[token, expert][:, None]).abs().mean().item()
        got = stats[f"kappa/layer{index}/alpha_s_abs"]
        assert got == pytest.approx(term(kappa_logits), rel=1e-5), index
        # Negative control: where the variant changes the logit, the raw logit gives another number
        raw = x @ layer.router.weight.detach().double().T
        changed = not torch.allclose(kappa_logits, raw, rtol=1e-4, atol=1e-5)
        assert changed == (name in ("normalized", "halved"))
        if changed:
            assert abs(got - term(raw)) > 1e-2 * term(raw), index


def test_a_variant_registered_at_run_time_trains(registry, world1, tmp_path):
    """Two steps of the training loop with the toy: its transform runs in the router, and the run
    is the one of `logit` with logit_scale 0.5 and U 2.5 (not the one with logit_scale 1)."""
    from megatron_kappa.train.loop import run
    calls = []

    def counted(logits, router_weight):
        calls.append(logits.requires_grad)  # the router's (with gradient) or the analysis's
        return halve(logits, router_weight)
    registry.register("halved", dataclasses.replace(HALVED, transform=counted))
    common = ["train.steps=2", "log.interval=1", "data.mock=true", "model.seq_length=32", "train.micro_batch=2",
              "train.global_batch=4", "eval.valid_every=0", "log.tensorboard=false", "checkpoint.interval=100",
              "model.kappa.freeze_fraction=0", "model.kappa.warmup=0"]  # α, b move at step 1

    def train(name, *sets):
        run(load_config("configs/tiny.yaml", [*common, f"run.dir={tmp_path / name}", *sets]), log=lambda *a: None)
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    halved = train("halved", "model.kappa.input=halved")
    assert sum(calls) >= 2 * 2 * 3  # steps × micro-batches × MoE layers, in the router
    assert len(calls) - sum(calls) >= 2 * 3  # logged steps × MoE layers, in the analysis
    assert [r["kappa_U"] for r in halved] == [2.5, 2.5]
    same = train("scale-half", "model.kappa.U=2.5", "model.kappa.logit_scale=0.5")
    plain = train("scale-one", "model.kappa.U=2.5")
    # κ's quantiles, from the logits the experts received; |α| after the steps, moved by the
    # gradient through the transform; the loss (at these sizes it barely moves: equal, not a control)
    quantiles = [f"kappa/layer{i}/{q}" for i in (1, 2, 3) for q in ("bottom5", "mean", "top5")]
    alpha = [f"kappa/layer{i}/alpha_abs" for i in (1, 2, 3)]
    def gap(a, b, keys):
        return max(abs(a[-1][k] - b[-1][k]) / abs(b[-1][k]) for k in keys)
    assert gap(halved, same, quantiles + alpha + ["loss"]) < 1e-6
    # negative control: the toy's transform is visible in both
    assert gap(halved, plain, quantiles) > 5e-4 and gap(halved, plain, alpha) > 1e-2
