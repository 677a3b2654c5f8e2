"""Activation recomputation changes memory, not the numbers: losses and gradients bit-exact on CPU."""
import pytest
import torch

from tests.support import parity
from tests.support.settings import MLA  # the tiny MLA settings


def train(recompute, kappa, grouped, state=None, extra=()):
    cfg = parity.make_cfg(kappa=kappa, grouped=grouped, overrides=(f"model.recompute={recompute}", *extra))
    from megatron_kappa.parallel.groups import init_distributed
    init_distributed(cfg.parallel, seed=5, device="cpu")
    model = parity.build(cfg)
    if state is None:
        parity.init_reference_weights(model)
        state = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    model.load_state_dict(state)
    model.train()
    losses, grads = parity.train(model, cfg, parity.split_for_reference(parity.global_batch(), 2))
    return losses, grads, state, model


@pytest.mark.parametrize("kappa,grouped", [(True, True), (False, True), (True, False)])
def test_recompute_settings_give_identical_losses(world1, kappa, grouped):
    losses, grads, state, _ = train("none", kappa, grouped)
    for mode in ("selective", "full"):
        got, got_grads, _, model = train(mode, kappa, grouped, state)
        assert got == losses, (mode, got, losses)  # bit for bit
        assert all(torch.equal(got_grads[k], g) for k, g in grads.items()), mode
        if mode == "selective":
            assert model.config.recompute_granularity == "selective"
            experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
            assert all(getattr(e, "recompute_activation", False) == grouped for e in experts)
        else:
            assert model.config.recompute_granularity == "full"


MTP = ("model.mtp.num_layers=1", "model.mtp.loss_weight=0.5")


@pytest.mark.parametrize("extra", [MLA, MTP], ids=["mla", "mtp"])
def test_recompute_with_mla_or_mtp_gives_identical_losses(world1, extra):
    """model.mla under selective (its core attention) and full recompute, and model.mtp under full
    recompute (megatron checkpoints each MTP depth like a layer): the same numbers."""
    losses, grads, state, _ = train("none", True, True, extra=extra)
    if extra is MTP:  # the MTP modules are trained (their gradients are compared too)
        assert any(k.startswith("mtp.") and g.abs().max() > 0 for k, g in grads.items())
    for mode in ("selective", "full"):
        got, got_grads, _, model = train(mode, True, True, state, extra=extra)
        assert got == losses, (mode, got, losses)
        assert all(torch.equal(got_grads[k], g) for k, g in grads.items()), mode
        assert model.config.recompute_granularity == mode


SHARED = ("model.moe.shared_ffn_hidden_size=32",)


def saved_bytes(model) -> int:
    """Bytes autograd keeps for backward in one forward of the tiny model (test_plan_saved's
    count): what recomputation trades for compute."""
    from tests.support.saved_memory import saved_bytes as kept
    return kept(model, parity.global_batch()[0][:, :-1])


@pytest.mark.parametrize("modules,extra", [
    (["mlp"], ()), (["moe"], SHARED), (["shared_experts"], SHARED), (["moe_act", "core_attn"], ()),
    (["mla_up_proj"], MLA), (["core_attn", "mlp", "shared_experts"], SHARED)],
    ids=["mlp", "moe", "shared_experts", "moe_act+core_attn", "mla_up_proj", "three"])
def test_recompute_modules_give_identical_losses_and_keep_less(world1, modules, extra):
    """model.recompute_modules: each of megatron's modules that runs here gives the same losses and
    gradients bit for bit, and keeps fewer bytes for backward than no recompute (so it is
    recomputed, not silently ignored: none of these lists holds selective's default alone)."""
    losses, grads, state, plain = train("none", True, True, extra=extra)
    listed = f"model.recompute_modules=[{','.join(modules)}]"
    got, got_grads, _, model = train("selective", True, True, state, extra=(*extra, listed))
    assert got == losses
    assert all(torch.equal(got_grads[k], g) for k, g in grads.items())
    assert model.config.recompute_granularity == "selective" and model.config.recompute_modules == modules
    assert saved_bytes(model) < saved_bytes(plain)


def test_layernorm_recompute_is_refused_in_one_line():
    """megatron's layernorm recompute needs Transformer Engine's FP8 state (a NameError here)."""
    from megatron_kappa.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"model.recompute_modules: expected a non-empty list .*layernorm"):
        load_config("configs/tiny.yaml", ["model.recompute=selective", "model.recompute_modules=[layernorm]"])
    with pytest.raises(ConfigError, match=r"model.recompute_modules: applies to model.recompute: selective"):
        load_config("configs/tiny.yaml", ["model.recompute_modules=[mlp]"])


def test_recomputing_the_first_layers_only(world1):
    """model.recompute_layers: full recompute of the stage's first N layers (megatron's block
    method): the same numbers; it keeps more than recomputing every layer and less than none."""
    losses, grads, state, plain = train("none", True, True)
    got, got_grads, _, two = train("full", True, True, state, extra=("model.recompute_layers=2",))
    assert got == losses and all(torch.equal(got_grads[k], g) for k, g in grads.items())
    assert (two.config.recompute_method, two.config.recompute_num_layers) == ("block", 2)
    _, _, _, every = train("full", True, True, state)
    assert saved_bytes(every) < saved_bytes(two) < saved_bytes(plain)
