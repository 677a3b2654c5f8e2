"""The SoftMoE router inside megatron-core's MoE layer, against a float64 per-token loop.

The reference recomputes everything from the weights: the LapSum soft top-k by bisection
(test_lapsum.reference), the budget k_l from θ, the truncation and cap per token, κ from the raw
logit of each (token, expert) pair, the Switch-style balancing loss and the z-loss. Layers are
built from the same specs as the model (two layers sharing one budget, so the gradient of every
θ has terms from both layers). Also: the limits (temperature → 0 is the hard top-k; no
truncation and k = E runs every expert), the budget parameterisations, the config errors, the
metrics, and negative controls (megatron's stock alltoall dispatcher; other tokens' logits for κ).
"""
from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.model.build import layer_specs, transformer_config
from megatron_kappa.model.layout import model_layout
from megatron_kappa.model.routers.softmoe import softmoe_stats
from megatron_kappa.model.softmoe import CLAMP, Allocation, link_budgets, softmoe_routers
from tests.support.lapsum_reference import reference as lapsum_reference
from tests.support.moe_reference import expert_grads, layer_weights

f64 = torch.float64
S, B, H, E = 8, 3, 16, 4
AUX, Z = 1e-2, 1e-3
U = 3.0  # κ's range (the config default)
BASE = dict(temperature=0.3, threshold=0.1, max_experts=3, budget=1.5)


def make_cfg(kappa=True, dispatcher="alltoall", grouped=True, layers=2, softmoe=None, **extra):
    sm = {**BASE, **(softmoe or {})}
    sets = ["model.moe.router=softmoe", f"model.moe.dispatcher={dispatcher}",
            f"model.kappa.enabled={str(kappa).lower()}", f"model.moe.grouped_gemm={str(grouped).lower()}",
            f"model.moe.aux_loss={AUX}", f"model.moe.z_loss={Z}", f"model.num_layers={layers}",
            "model.first_dense=0", f"model.hidden_size={H}", "model.num_attention_heads=2",
            "model.ffn_hidden_size=24", f"model.moe.num_experts={E}", "model.seq_length=8"]
    sets += [f"model.moe.softmoe.{k}={v}" for k, v in sm.items()] + [f"{k}={v}" for k, v in extra.items()]
    return load_config(None, sets)


def build_layers(cfg, seed=0, theta=(0.4, -0.3)):
    """The MoE layers of `cfg` (one per model layer), linked to one budget, with θ set, router
    logits of a few units and expert activations of order 1, and nonzero κ parameters."""
    torch.manual_seed(seed)
    tconfig = transformer_config(cfg)
    spec = layer_specs(cfg.model, cfg.precision, model_layout(cfg)).layer_specs[0].submodules.mlp
    layers = torch.nn.ModuleList()
    for i in range(cfg.model.num_layers):
        layer = spec(config=tconfig)
        layer.set_layer_number(i + 1)
        layers.append(layer)
    link_budgets(layers)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer, t in zip(layers, theta):
            layer.router.budget_logit.fill_(t)
            layer.router.weight.mul_(8.0)
            w = layer_weights(layer)
            for fc1, fc2 in zip(w["fc1"], w["fc2"]):
                fc1.mul_(25.0)
                fc2.mul_(10.0)
            for p in (w["alpha"], w["bias"]):
                if p is not None:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return layers


def inputs(n, seed=4):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(S, B, H, generator=gen) for _ in range(n)]


def upstream(shape):
    return torch.arange(shape.numel(), dtype=f64).reshape(shape).sin()


def run(layers, xs):
    """Forward every layer on its input, backward ⟨out, v⟩ (+ the attached aux and z losses)."""
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    xs = [x.clone().requires_grad_() for x in xs]
    outs = [layer(x)[0] for layer, x in zip(layers, xs)]
    sum((o * upstream(o.shape).to(o.dtype)).sum() for o in outs).backward()
    return [o.detach() for o in outs], [x.grad for x in xs]


def ref_budget(thetas, settings, experts=E):
    """k_l in float64 from the θ: the softmax one with its clamp, the LapSum one by bisection."""
    theta = torch.stack(thetas)
    L = theta.numel()
    if settings["allocation"] == "softmax":
        return (L * settings["budget"] * torch.softmax(theta, 0)).clamp(CLAMP, experts - CLAMP)
    return experts * lapsum_reference(theta[None], torch.tensor(L * settings["budget"] / experts, dtype=f64),
                                      torch.tensor(1.0, dtype=f64))[0]


def naive_softmoe(x, w, k, s, kappa=True, logit_perm=None):
    """out[t] = Σ_{e kept} weight_e · W2_e (g σ(κ g) u) with p = LapSum(x·W_r; k, α) per token;
    returns (out, balancing loss, z-loss, kept [T, E])."""
    logits = x @ w["router"].T
    p = lapsum_reference(logits, k, torch.tensor(s["temperature"], dtype=f64))
    kappa_logits = logits if logit_perm is None else logits[logit_perm]
    out, kept = torch.zeros_like(x), torch.zeros(p.shape, dtype=torch.bool)
    for t in range(x.shape[0]):
        keep = [e for e in range(E) if s["threshold"] == 0 or p[t, e] >= s["threshold"]]
        keep = sorted(keep, key=lambda e: -p[t, e].item())[: s["max_experts"]]
        weights = p[t, keep]
        if s["normalize"] != "none" and keep:
            weights = weights / weights.sum() * (k if s["normalize"] == "budget" else 1.0)
        weights = weights * s["route_scale"]
        for e, we in zip(keep, weights):
            kept[t, e] = True
            g, u = (w["fc1"][e] @ x[t]).chunk(2)
            kap = U ** torch.tanh(w["alpha"][e] * kappa_logits[t, e] + w["bias"][e]) if kappa else 1.0
            out[t] = out[t] + we * (w["fc2"][e] @ (g * torch.sigmoid(kap * g) * u))
    counts = kept.sum(0).to(f64)
    aux = E * (counts / counts.sum().clamp_min(1.0) * (p / k).mean(0)).sum()  # no pair run: f = 0
    z = torch.logsumexp(logits, -1).square().mean()
    return out, aux, z, kept


def reference(layers, xs, settings, kappa=True, logit_perm=None):
    """Float64 outputs and gradients of the same objective as `run`."""
    ws = [{k: (None if v is None else ([t.detach().double().requires_grad_() for t in v] if isinstance(v, list)
                                       else v.detach().double().requires_grad_()))
           for k, v in layer_weights(layer).items()} for layer in layers]
    thetas = [layer.router.budget_logit.detach().double()[0].requires_grad_() for layer in layers]
    ks = ref_budget(thetas, settings)
    outs, dxs, kept_all, total = [], [], [], 0.0
    for w, x, k in zip(ws, xs, ks):
        x64 = x.reshape(-1, H).double().requires_grad_()
        out, aux, z, kept = naive_softmoe(x64, w, k, settings, kappa, logit_perm)
        total = total + (out * upstream(out.shape)).sum() + AUX * aux + Z * z
        outs.append(out)
        dxs.append(x64)
        kept_all.append(kept)
    total.backward()
    return [o.detach() for o in outs], [x.grad for x in dxs], ws, thetas, ks.detach(), kept_all


def settings_of(cfg):
    sm = cfg.model.moe.softmoe
    return dict(budget=cfg.model.moe.active_experts, allocation=sm.allocation, temperature=sm.temperature,
                threshold=sm.threshold, normalize=sm.normalize, max_experts=sm.max_experts or E,
                route_scale=cfg.model.moe.route_scale)


def close(got, want, what, tol=2e-5):
    """Max error within tol × the largest |want| (the repo's max-relative measure). A gradient
    that never formed (an expert that ran no token) counts as zero."""
    if want is None:
        want = torch.zeros(got.shape, dtype=f64)
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= tol * scale + 1e-12, f"{what}: max error {err:.2e} vs {tol:.0e} × {scale:.2e}"


def check_against_reference(cfg, kappa=True, tol=2e-5):
    layers = build_layers(cfg)
    xs = inputs(len(layers))
    outs, dxs = run(layers, xs)
    s = settings_of(cfg)
    ref_outs, ref_dxs, ws, thetas, ks, kept = reference(layers, xs, s, kappa)
    for i, layer in enumerate(layers):
        close(layer.router.active_experts().detach(), ks[i], "k_l", 1e-6)
        close(outs[i].reshape(-1, H), ref_outs[i], f"layer {i} output", tol)
        close(dxs[i].reshape(-1, H), ref_dxs[i], f"layer {i} input grad", tol)
        grads = expert_grads(layer)
        close(grads["router.weight"], ws[i]["router"].grad, f"layer {i} router grad", tol)
        close(grads["router.budget_logit"][0], thetas[i].grad, f"layer {i} θ grad", tol)
        for e in range(E):
            for fc in ("fc1", "fc2"):
                got = grads.get(f"experts.local_experts.{e}.linear_{fc}.weight", torch.zeros_like(ws[i][fc][e]))
                close(got, ws[i][fc][e].grad, f"{fc}[{e}]", tol)
        if kappa:
            close(grads["experts.kappa_alpha"], ws[i]["alpha"].grad, "κ α grad", tol)
            close(grads["experts.kappa_bias"], ws[i]["bias"].grad, "κ b grad", tol)
    return layers, kept


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("kappa", [True, False])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_layers_match_float64_per_token_loop(world1, dispatcher, kappa, grouped):
    layers, kept = check_against_reference(make_cfg(kappa, dispatcher, grouped), kappa)
    ran = torch.cat([k.sum(-1) for k in kept])
    assert len(set(ran.tolist())) >= 3, "the inputs must give tokens different numbers of experts"
    counts = torch.stack([layer.router.pop_counts("cpu") for layer in layers])  # [L, E + 2]
    assert counts[:, E + 1].sum() > 0, "the inputs must hit the cap"
    for c, k in zip(counts, kept):  # the recorded distribution is the reference's
        assert c[: E + 1].tolist() == torch.bincount(k.sum(-1), minlength=E + 1).tolist()


@pytest.mark.parametrize("sm, extra", [
    (dict(normalize="sum"), {"model.moe.route_scale": 2.5}), (dict(normalize="budget", allocation="lapsum"), {}),
    (dict(threshold=0.0, max_experts=4, budget=2.0), {}),
    (dict(threshold=0.3, temperature=0.05, max_experts=1, budget=1.0), {}),
    (dict(threshold=0.4, budget=0.5), {}),  # tokens with no expert; the second layer runs none at all
])
def test_options_match_float64_per_token_loop(world1, sm, extra):
    check_against_reference(make_cfg(softmoe=sm, **extra))


def test_kappa_reads_each_pairs_own_logit(world1):
    """Negative control: the reference fed other tokens' logits for κ is clearly different."""
    cfg = make_cfg()
    layers = build_layers(cfg)
    xs = inputs(len(layers))
    right = reference(layers, xs, settings_of(cfg))[0][0]
    wrong = reference(layers, xs, settings_of(cfg), logit_perm=torch.roll(torch.arange(S * B), 1))[0][0]
    assert (wrong - right).abs().max() > 1e-2 * right.abs().max()


def test_stock_alltoall_dispatcher_is_wrong_for_variable_counts(world1):
    """Negative control: megatron's dropless alltoall (tokens × topk rows) in place of ours. Its
    row count assumes exactly topk experts per token, so with SoftMoE's variable counts the expert
    split cannot match: it fails on exactly that mismatch (not on something else)."""
    cfg = make_cfg(kappa=False)
    layers = build_layers(cfg)
    xs = inputs(len(layers))
    for layer in layers:
        d = layer.token_dispatcher
        layer.token_dispatcher = MoEAlltoAllTokenDispatcher(d.num_local_experts, d.local_expert_indices,
                                                            config=d.config, pg_collection=get_default_pg_collection())
    with pytest.raises(RuntimeError, match=r"split_sizes to sum exactly to (\d+).*got split_sizes") as e:
        run(layers, xs)
    import re
    rows = int(re.search(r"sum exactly to (\d+)", str(e.value)).group(1))
    routed = sum(map(int, re.search(r"split_sizes=\[([\d, ]+)\]", str(e.value)).group(1).split(",")))
    # the stock layout: max_experts rows per token (its top-k); ours: the experts each token really uses
    assert rows == S * B * cfg.model.moe.softmoe.max_experts != routed


def test_zero_temperature_is_hard_topk(world1):
    """α → 0 with an integer budget: the experts run are the top-k of the logits, with weight 1;
    at α = 1 (the control) they are not."""
    for alpha, hard in ((1e-4, True), (1.0, False)):
        cfg = make_cfg(False, layers=1, softmoe=dict(temperature=alpha, threshold=0.5, budget=2.0, max_experts=4))
        (layer,) = build_layers(cfg, theta=(0.0,))
        x = inputs(1)[0]
        logits = layer.router.gating(x).reshape(-1, E)
        probs, routing_map = layer.router(x)
        top = torch.zeros_like(routing_map).scatter_(-1, logits.topk(2, -1).indices, True)
        if hard:
            assert torch.equal(routing_map, top)
            assert torch.equal(probs, top.float())
        else:
            assert not torch.equal(routing_map, top)


@pytest.mark.parametrize("kappa", [True, False])
def test_no_truncation_and_full_budget_runs_every_expert(world1, kappa):
    cfg = make_cfg(kappa, layers=1, softmoe=dict(threshold=0.0, budget=float(E), max_experts=E))
    (layer,) = build_layers(cfg, theta=(0.0,))
    x = inputs(1)[0]
    probs, routing_map = layer.router(x)
    assert routing_map.all()
    weights = probs[..., 0] if kappa else probs
    assert (weights > 1 - 1e-3).all()  # k = E − 1e-3 (the clamp): every p within 1e-3 of 1
    hidden, _ = layer.token_dispatcher.dispatch_preprocess(x, routing_map, probs)
    assert hidden.shape[0] == S * B * E
    # k = E − 1e-3 is held in fp32 only to ~2e-4 of the 1e-3 gap, and every 1 − p and router
    # gradient scales with that gap: hence the looser tolerance of this limit.
    (layer,), _ = check_against_reference(cfg, kappa, tol=5e-4)
    assert layer.router.pop_counts("cpu").tolist() == [0] * E + [S * B, 0]


def holders(thetas):
    return [SimpleNamespace(budget_logit=t) for t in thetas]


@pytest.mark.parametrize("kind", ["softmax", "lapsum"])
def test_budget_mean_is_exact_and_gradients_match(kind):
    gen = torch.Generator().manual_seed(0)
    for L, budget, spread in ((1, 1.5, 1.0), (5, 2.0, 1.0), (12, 3.7, 0.5), (3, 7.9, 3.0)):
        thetas = [torch.nn.Parameter(torch.randn(1, generator=gen) * spread) for _ in range(L)]
        k = Allocation(holders(thetas), budget, 8, kind).k()
        assert ((k > 0) & (k < 8)).all()
        if kind == "lapsum" or (k < 8 - CLAMP).all():
            assert abs(k.double().mean().item() - budget) <= 1e-6 * budget, (L, budget)
        v = torch.randn(L, generator=gen)
        (k * v).sum().backward()
        t64 = [t.detach().double()[0].requires_grad_() for t in thetas]
        k64 = ref_budget(t64, dict(allocation=kind, budget=budget), experts=8)
        (k64 * v.double()).sum().backward()
        close(k.detach(), k64.detach(), "k", 1e-6)
        close(torch.cat([t.grad for t in thetas]), torch.stack([t.grad for t in t64]), "θ grad", 1e-5)


def test_softmax_clamp_breaks_the_mean_where_lapsum_does_not():
    """The documented limit of the softmax allocation: a layer pushed to E is clamped."""
    thetas = [torch.nn.Parameter(torch.tensor([v])) for v in (5.0, 0.0, 0.0)]
    k_soft = Allocation(holders(thetas), 3.0, 4, "softmax").k()
    k_lap = Allocation(holders(thetas), 3.0, 4, "lapsum").k()
    assert k_soft.max() == 4 - CLAMP and k_soft.mean() < 3.0 - 1e-3
    assert abs(k_lap.mean().item() - 3.0) < 1e-6 and k_lap.max() < 4


def test_unlinked_router_refuses_to_route(world1):
    cfg = make_cfg(layers=1)
    tconfig = transformer_config(cfg)
    layer = layer_specs(cfg.model, cfg.precision, model_layout(cfg)).layer_specs[0].submodules.mlp(config=tconfig)
    with pytest.raises(RuntimeError, match="link_budgets"):
        layer(inputs(1)[0])


def test_metrics_report_budget_and_active_experts(world1):
    cfg = make_cfg()
    layers = build_layers(cfg)
    run(layers, inputs(2))
    stats = softmoe_stats(layers, torch.device("cpu"))
    ks = Allocation([layer.router for layer in layers], 1.5, E, "softmax").k()
    for (index, router), k in zip(softmoe_routers(layers), ks):
        assert stats[f"softmoe/layer{index}/k"] == pytest.approx(k.item(), abs=1e-6)
        hist = stats[f"softmoe/layer{index}/active_hist"]
        assert len(hist) == E + 1 and sum(hist) == pytest.approx(1.0, abs=1e-5)
        assert stats[f"softmoe/layer{index}/active_mean"] == pytest.approx(
            sum(i * h for i, h in enumerate(hist)), abs=1e-4)
        assert 0 <= stats[f"softmoe/layer{index}/cap_hits"] < 1
    assert sum(stats[f"softmoe/layer{i}/cap_hits"] for i, _ in softmoe_routers(layers)) > 0
    assert stats["softmoe/k_mean"] == pytest.approx(1.5, abs=1e-6)
    again = softmoe_stats(layers, torch.device("cpu"))  # the window was reset
    assert all(sum(again[f"softmoe/layer{i}/active_hist"]) == 0 for i, _ in softmoe_routers(layers))
    with torch.no_grad():  # forwards without grad (validation) are not counted
        layers[0](inputs(1)[0])
    assert layers[0].router.pop_counts("cpu").sum() == 0


@pytest.mark.parametrize("sets, key", [
    (["model.moe.softmoe.budget=0"], "model.moe.softmoe.budget"),
    (["model.moe.softmoe.budget=4.5"], "model.moe.softmoe.budget"),
    (["model.moe.softmoe.max_experts=2", "model.moe.softmoe.budget=2.5"], "model.moe.softmoe.budget"),
    (["model.moe.softmoe.max_experts=5"], "model.moe.softmoe.max_experts"),
    (["model.moe.softmoe.temperature=0"], "model.moe.softmoe.temperature"),
    (["model.moe.softmoe.threshold=1.0"], "model.moe.softmoe.threshold"),
    (["model.moe.softmoe.normalize=mean"], "model.moe.softmoe.normalize"),
    (["model.moe.softmoe.allocation=penalty"], "model.moe.softmoe.allocation"),
    (["model.moe.capacity_factor=1.25"], "model.moe.capacity_factor"),
    (["model.moe.softmoe.temp=1"], "model.moe.softmoe.temp"),
])
def test_bad_config_is_one_line_naming_the_key(sets, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_config(None, ["model.moe.router=softmoe", "model.moe.num_experts=4", *sets])
    assert "\n" not in str(e.value)


def test_budget_defaults_to_topk_and_sets_the_summary():
    cfg = load_config(None, ["model.moe.router=softmoe", "model.moe.topk=3"])
    assert cfg.model.moe.active_experts == 3
    cfg = load_config(None, ["model.moe.router=softmoe", "model.moe.softmoe.budget=1.25"])
    assert cfg.model.moe.active_experts == 1.25
    from megatron_kappa.summary import summarize
    assert summarize(cfg)["topk"] == 1.25


def test_budget_follows_replaced_parameters(world1):
    """Code that swaps a module's Parameter objects (tests/simulated_device.on_device, loading with
    assign=True) must not leave the budget reading the old ones."""
    layers = build_layers(make_cfg())
    new = torch.nn.Parameter(torch.tensor([2.0]))
    layers[0].router.budget_logit = new
    k = layers[0].router.active_experts()
    assert k.item() == pytest.approx(3.0 * torch.softmax(torch.tensor([2.0, -0.3]), 0)[0].item(), rel=1e-6)
    k.backward()
    assert new.grad is not None and new.grad.abs().item() > 0
