"""The κ MoE layer inside megatron-core: vs stock megatron SwiGLU MoE, and vs a naive loop."""
import pytest
import torch

from megatron_kappa.config import load_config
from megatron_kappa.model.build import layer_specs, transformer_config
from megatron_kappa.model.layout import model_layout
from tests.support.moe_reference import expert_grads, layer_weights, naive_moe

S, B, H = 8, 3, 16


def make_cfg(dispatcher="alltoall", router="softmax", kappa=True, aux=0.0, z=0.0, grouped=True, **extra):
    sets = [f"model.moe.dispatcher={dispatcher}", f"model.moe.router={router}",
            f"model.moe.grouped_gemm={str(grouped).lower()}",
            f"model.kappa.enabled={str(kappa).lower()}", f"model.moe.aux_loss={aux}",
            f"model.moe.z_loss={z}", "model.num_layers=1", "model.first_dense=0",
            f"model.hidden_size={H}", "model.num_attention_heads=2", "model.ffn_hidden_size=24",
            "model.moe.num_experts=4", "model.moe.topk=2", "model.seq_length=8"]
    sets += [f"{k}={v}" for k, v in extra.items()]
    return load_config(None, sets)


def build_layer(cfg, seed=0):
    """The layer's weights from `seed` alone, whatever ran before in this process: megatron draws
    the expert weights from its model-parallel RNG tracker, which torch.manual_seed leaves alone."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    tconfig = transformer_config(cfg)
    layer = layer_specs(cfg.model, cfg.precision, model_layout(cfg)).layer_specs[0].submodules.mlp(config=tconfig)
    layer.set_layer_number(1)
    return layer


def randomize_kappa(layer, seed=1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (layer.experts.kappa_alpha, layer.experts.kappa_bias):
            if p is not None:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        if getattr(layer.router, "expert_bias", None) is not None:
            layer.router.expert_bias.copy_(torch.randn(layer.router.expert_bias.shape, generator=gen) * 0.1)
        layer.router.weight.mul_(8.0)  # logits of a few units, so κ moves well away from 1
        for fc1, fc2 in zip(*(layer_weights(layer)[k] for k in ("fc1", "fc2"))):  # activations of order 1
            fc1.mul_(25.0)
            fc2.mul_(10.0)


def run(layer, x):
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    out.backward(torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).sin())
    return out.detach(), x.grad, expert_grads(layer)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather", "sorted"])
def test_kappa_layer_with_zero_alpha_bias_equals_stock_megatron(world1, dispatcher, router, grouped):
    """κ experts (grouped or megatron's loop) at α = b = 0 against stock megatron-core
    (SequentialMLP, TopKRouter, MoELayer)."""
    aux = 1e-2 if router == "softmax" else 0.0
    kappa = build_layer(make_cfg(dispatcher, router, kappa=True, aux=aux, z=1e-3, grouped=grouped))
    stock_dispatcher = "alltoall" if dispatcher == "sorted" else dispatcher  # megatron's own
    stock = build_layer(make_cfg(stock_dispatcher, router, kappa=False, aux=aux, z=1e-3, grouped=False), seed=7)
    missing, unexpected = stock.load_state_dict(kappa.state_dict(), strict=False)
    assert not missing and sorted(unexpected) == ["experts.kappa_alpha", "experts.kappa_bias"]
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(3))
    out_k, dx_k, grads_k = run(kappa, x)
    out_s, dx_s, grads_s = run(stock, x)
    torch.testing.assert_close(out_k, out_s, rtol=0, atol=1e-6)
    torch.testing.assert_close(dx_k, dx_s, rtol=0, atol=1e-6)
    for name, grad in grads_s.items():  # incl. the router weight, which carries aux/z-loss grads
        torch.testing.assert_close(grads_k[name], grad, rtol=0, atol=1e-6, msg=name)


def reference_grads(layer, x, **kw):
    w = {k: (None if v is None else ([t.detach().double().requires_grad_() for t in v]
                                     if isinstance(v, list) else v.detach().double().requires_grad_()))
         for k, v in layer_weights(layer).items()}
    x64 = x.reshape(-1, H).double().requires_grad_()
    out = naive_moe(x64, w, topk=2, **kw)
    out.backward(torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).sin())
    return out.detach(), x64.grad, w


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather", "sorted"])
def test_kappa_layer_matches_naive_per_token_loop(world1, dispatcher, router, grouped):
    route_scale = 1.0 if router == "softmax" else 2.448
    layer = build_layer(make_cfg(dispatcher, router, grouped=grouped, **{"model.moe.route_scale": route_scale}))
    randomize_kappa(layer)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(4))
    out, dx, grads = run(layer, x)
    ref, dx_ref, w = reference_grads(layer, x, router=router, route_scale=route_scale)
    torch.testing.assert_close(out.reshape(-1, H).double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.reshape(-1, H).double(), dx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads["router.weight"].double(), w["router"].grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads["experts.kappa_alpha"].double(), w["alpha"].grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads["experts.kappa_bias"].double(), w["bias"].grad, rtol=1e-5, atol=1e-5)
    for e in range(4):
        for fc in ("fc1", "fc2"):
            got = grads[f"experts.local_experts.{e}.linear_{fc}.weight"].double()
            torch.testing.assert_close(got, w[fc][e].grad, rtol=1e-5, atol=1e-5)
    # Negative control: the same loop fed other tokens' logits must be clearly different.
    perm = torch.roll(torch.arange(S * B), 1)
    wrong, _, _ = reference_grads(layer, x, router=router, route_scale=route_scale, logit_perm=perm)
    assert (wrong - ref).abs().max() > 1e-2 * ref.abs().max()


def test_ablations_and_authors_variant_match_reference(world1):
    for sets, kw in [({"model.kappa.use_alpha": "false"}, {}), ({"model.kappa.use_bias": "false"}, {}),
                     ({"model.kappa.logit_scale": 0.15, "model.kappa.tanh_gain": 2.0},
                      {"logit_scale": 0.15, "tanh_gain": 2.0})]:
        layer = build_layer(make_cfg(**sets))
        randomize_kappa(layer)
        x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(5))
        out, _, _ = run(layer, x)
        ref, _, _ = reference_grads(layer, x, **kw)
        torch.testing.assert_close(out.reshape(-1, H).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grouped", [True, False])
def test_kappa_parameters_are_zero_initialised_expert_parameters(world1, grouped):
    layer = build_layer(make_cfg(grouped=grouped))
    for p in (layer.experts.kappa_alpha, layer.experts.kappa_bias):
        assert p.shape == (4, 24) and not p.any()
        fc1 = layer.experts.fc1_weight if grouped else layer.experts.local_experts[0].linear_fc1.weight
        assert p.allreduce == getattr(fc1, "allreduce", True)
        assert p.tensor_model_parallel and p.partition_dim == 1


def test_flex_dispatcher_is_refused(world1):
    cfg = make_cfg()
    tconfig = transformer_config(cfg)
    tconfig.moe_token_dispatcher_type = "flex"
    with pytest.raises(ValueError, match="alltoall' or 'allgather"):
        layer_specs(cfg.model, cfg.precision, model_layout(cfg)).layer_specs[0].submodules.mlp(config=tconfig)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("variant", ["scaled", "normalized"])
def test_kappa_input_variants_match_authors_formula(world1, variant, grouped):
    """model.kappa.input scaled / normalized through the whole layer (router → dispatch → experts)
    against the naive loop with the authors' formulas (moe_reference.authors_normalized), at a U
    set the way the training loop's U ramp sets it. The router weight's gradient is the sum of the
    routing path (unscaled) and the κ path (× 0.1), so it checks the scale lands on κ's path only."""
    from megatron_kappa.model.experts import set_kappa_U

    layer = build_layer(make_cfg(grouped=grouped, **{"model.kappa.input": variant}))
    randomize_kappa(layer)
    set_kappa_U(layer, 2.5)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(6))
    out, dx, grads = run(layer, x)
    kw = dict(U=2.5, kappa_input=variant, router_grad_scale=0.1)
    if variant == "scaled":
        kw.update(logit_scale=0.15, tanh_gain=2.0)
    ref, dx_ref, w = reference_grads(layer, x, **kw)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.reshape(-1, H).double(), ref, **tol)
    torch.testing.assert_close(dx.reshape(-1, H).double(), dx_ref, **tol)
    torch.testing.assert_close(grads["router.weight"].double(), w["router"].grad, **tol)
    torch.testing.assert_close(grads["experts.kappa_alpha"].double(), w["alpha"].grad, **tol)
    torch.testing.assert_close(grads["experts.kappa_bias"].double(), w["bias"].grad, **tol)
    # Negative controls: against the κ path at full gradient, or (normalized) a normaliser that is
    # not detached, the layer's router gradient fails the same comparison.
    wrong = [dict(kw, router_grad_scale=1.0)] + ([dict(kw, detach_normalizer=False)] if variant == "normalized" else [])
    for bad in wrong:
        _, _, w_bad = reference_grads(layer, x, **bad)
        with pytest.raises(AssertionError):
            torch.testing.assert_close(grads["router.weight"].double(), w_bad["router"].grad, **tol)
