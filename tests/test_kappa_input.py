"""model.kappa.input, the U ramp and model.kappa.schedule against the authors' code, written out
in float64 (moe_reference.authors_normalized / authors_scale_grad), and against hand-computed
values. Both backends of the op (Triton through its interpreter, TRITON_INTERPRET=1 from conftest).
"""
import inspect
import math

import pytest
import torch

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.kappa import inputs as kappa_inputs
from megatron_kappa.kappa import kappa_swiglu
from megatron_kappa.model.build import kappa_settings
from megatron_kappa.optim import schedule
from megatron_kappa.train import recipe
from tests.support.moe_reference import authors_normalized, authors_scale_grad

T, E, H, F, K = 13, 4, 16, 8, 2


def leaves(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    def r(*shape, mag=1.0):
        return (torch.randn(*shape, generator=gen) * mag).to(dtype).requires_grad_()
    # x · W gives logits of a few units; weights of uneven norms so the normaliser matters
    w = (torch.randn(E, H, generator=gen) * torch.tensor([0.3, 0.6, 1.0, 1.4])[:, None]).to(dtype).requires_grad_()
    return dict(x=r(T, H, mag=2.0), w=w, g=r(T * K, F, mag=2.0), u=r(T * K, F),
                alpha=r(E, F, mag=0.5), bias=r(E, F, mag=0.5))


def routing(logits):
    """Top-k experts per token, and the pairs sorted by expert (the grouped rows' order)."""
    top = logits.detach().topk(K, dim=-1).indices                       # [T, K]
    order = torch.argsort(top.reshape(-1), stable=True)                 # pair → row
    counts = torch.bincount(top.reshape(-1), minlength=E)
    return top, order, counts


def project(p, backend, U, grad_scale=0.1):
    """The project's path: router logits → kappa_input → the op over expert-grouped rows."""
    logits = p["x"] @ p["w"].T
    logits.retain_grad()
    top, order, counts = routing(logits)
    s = kappa_inputs.kappa_input(logits, p["w"], "normalized", grad_scale)
    rows = s.gather(1, top).reshape(-1)[order]
    h = kappa_swiglu(p["g"], p["u"], rows, p["alpha"], p["bias"], U=U, backend=backend,
                     tokens_per_expert=counts)
    return h, logits


def reference(p, U, grad_scale=0.1, detach=True):
    """float64, the authors' order: top-k logits → normalised → scale_grad → κ = exp(ln U ·
    tanh(b + s·α)) → g·σ(g·κ)·u, per (token, expert) pair."""
    q = {k: v.detach().double().requires_grad_() for k, v in p.items()}
    logits = q["x"] @ q["w"].T
    logits.retain_grad()
    top, order, _ = routing(logits)
    top_k_scores = logits.gather(1, top)
    conf = authors_scale_grad(authors_normalized(top_k_scores, q["w"], top, detach=detach), grad_scale)
    e = top.reshape(-1)[order]
    s = conf.reshape(-1)[order]
    kappa = torch.exp(math.log(U) * torch.tanh(torch.addcmul(q["bias"][e], s[:, None], q["alpha"][e])))
    h = q["g"] * torch.sigmoid(q["g"] * kappa) * q["u"]
    return h, logits, q


def weights_for(h):
    return torch.arange(h.numel(), dtype=torch.float64).reshape(h.shape).sin()


def grads_of(h, logits, tensors):
    (h.double() * weights_for(h)).sum().backward()
    return {"logit": logits.grad, **{k: t.grad for k, t in tensors.items()}}


def assert_close_all(got, want, tol):
    for name in want:
        g, w = got[name], want[name]
        g = torch.zeros_like(w) if g is None else g
        peak = max(w.abs().max().item(), 1e-12)
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol * peak, msg=name)


def max_rel_gap(got, want):
    return max(((got[k] if got[k] is not None else 0) - want[k]).abs().max().item()
               / max(want[k].abs().max().item(), 1e-12) for k in want)


# torch runs in float64 here (its math is in the input dtype): agreement to rounding. The Triton
# kernels compute in fp32: the logit's and x's gradients sum over F and the pairs, so their fp32
# rounding reaches ~1.6e-5 of the largest entry (measured); 5e-5 leaves room, 1e-2 is a failure.
TOLERANCE = {("torch", torch.float64): 1e-10, ("triton", torch.float32): 5e-5}


@pytest.mark.parametrize("backend,dtype", list(TOLERANCE))
@pytest.mark.parametrize("U", [4.0, 2.5])
def test_normalized_input_matches_authors_formula(backend, dtype, U):
    """κ's output and every gradient (gate, up, the router logit with the 0.1 scale, the router
    weight and input through it, α, b) against the authors' formula in float64."""
    tol = TOLERANCE[backend, dtype]
    p = leaves(dtype=dtype)
    h, logits = project(p, backend, U)
    got = grads_of(h, logits, p)
    h_ref, logits_ref, q = reference(p, U)
    want = grads_of(h_ref, logits_ref, q)
    torch.testing.assert_close(h.double(), h_ref, rtol=tol, atol=tol * h_ref.abs().max().item())
    assert_close_all(got, want, tol)
    assert want["w"].abs().max() > 0 and want["logit"].abs().max() > 0
    # Negative controls: without the detached normaliser (the router weight's gradient changes)
    # or without the 0.1 scale (the logit's), the same comparison fails by far.
    for bad in (dict(detach=False), dict(grad_scale=1.0)):
        h_bad, logits_bad, q_bad = reference(p, U, **bad)
        assert max_rel_gap(got, grads_of(h_bad, logits_bad, q_bad)) > 1e-2, bad


def test_kappa_input_forward_is_the_logit_itself_for_logit_and_scaled():
    """Only `normalized` changes the value; the gradient scale never does (bit for bit)."""
    logits = torch.randn(7, E, dtype=torch.float32)
    w = torch.randn(E, H)
    for variant in ("logit", "scaled"):
        assert torch.equal(kappa_inputs.kappa_input(logits, w, variant, 0.1), logits)
    assert not torch.allclose(kappa_inputs.kappa_input(logits, w, "normalized", 1.0), logits)
    with pytest.raises(ValueError, match="model.kappa.input"):
        kappa_inputs.kappa_input(logits, w, "probs", 1.0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_U_one_is_plain_swiglu_with_zero_kappa_gradients(backend):
    """U = 1 (where the U ramp starts): κ ≡ 1, so the output and gate/up gradients are SwiGLU's
    and the logit, α, b gradients are exactly 0 (and finite: ln U = 0 divides nothing)."""
    gen = torch.Generator().manual_seed(3)
    g, u = (torch.randn(9, F, generator=gen).requires_grad_() for _ in range(2))
    s, a, b = (torch.randn(*shape, generator=gen).requires_grad_() for shape in ((9,), (F,), (F,)))
    h = kappa_swiglu(g, u, s, a, b, U=1.0, backend=backend)
    (h * weights_for(h).float()).sum().backward()
    g2, u2 = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    ref = torch.nn.functional.silu(g2) * u2
    (ref * weights_for(ref).float()).sum().backward()
    torch.testing.assert_close(h, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g.grad, g2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(u.grad, u2.grad, rtol=1e-6, atol=1e-6)
    for t in (s, a, b):
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t))


def test_U_reaches_the_kernels_as_a_runtime_scalar():
    """The per-step U enters the Triton kernels as ln U, a plain (non-constexpr) float argument,
    which Triton does not specialise on (triton/runtime/jit.py: "we do not specialize
    non-constexpr floats"): a new U every step compiles nothing new."""
    from megatron_kappa.kappa import triton_op
    kernel = triton_op._kappa_swiglu_kernel
    fn = getattr(kernel, "fn", kernel)
    params = inspect.signature(fn).parameters
    assert "log_u" in params and "constexpr" not in str(params["log_u"].annotation)
    assert "constexpr" in str(params["BLOCK_N"].annotation)  # the check can see a constexpr


def kcfg(*sets):
    return load_config(None, [f"model.kappa.{s}" for s in sets])


def test_U_ramp_follows_the_authors_get_kappa_slope_max_scale():
    """1 until α, b unfreeze, then linear to U over ceil(0.15 · total) steps (hand-computed)."""
    cfg = kcfg("input=normalized", "schedule=authors")
    # total 10000: delay max(200, ceil(500)) = 500, ramp ceil(1500) = 1500, U = 4
    for step, want in ((0, 1.0), (499, 1.0), (500, 1.0), (875, 1.75), (1250, 2.5), (2000, 4.0), (9999, 4.0)):
        assert recipe.kappa_U(step, 10000, cfg.model.kappa) == pytest.approx(want, abs=1e-12), step
    # total 1000: delay max(200, 50) = 200, ramp 150
    assert recipe.kappa_U(275, 1000, cfg.model.kappa) == pytest.approx(2.5)
    # schedule paper: the ramp starts at the paper's unfreeze (10 %), U = 3 for scaled
    paper = kcfg("input=scaled")
    assert recipe.kappa_U(999, 10000, paper.model.kappa) == 1.0
    assert recipe.kappa_U(1750, 10000, paper.model.kappa) == pytest.approx(2.0)
    # input logit (the paper): U constant; explicit keys override the variant's
    assert all(recipe.kappa_U(s, 10000, kcfg().model.kappa) == 3.0 for s in (0, 500, 9999))
    assert recipe.kappa_U(0, 10000, kcfg("input=normalized", "u_warmup=0").model.kappa) == 4.0
    assert recipe.kappa_U(1250, 10000, kcfg("input=normalized", "schedule=authors",
                                            "U=3").model.kappa) == pytest.approx(2.0)


def test_authors_schedule_freeze_and_lr_against_hand_computed_values():
    cfg = load_config(None, ["model.kappa.schedule=authors", "model.hidden_size=3072",
                             "model.num_attention_heads=24", "train.lr_decay_style=wsd", "train.warmup=0",
                             "train.min_lr_ratio=0", "train.lr_wsd_decay_fraction=0.5"])
    assert [schedule.kappa_start(t, cfg.model.kappa) for t in (1000, 10000, 10001)] == [200, 500, 501]
    assert schedule.kappa_start(10000, load_config(None, []).model.kappa) == 1000  # paper: 10 %
    # width (3072/768)^-0.5 = 0.5; κ peak 0.12; ramp i/1000 from step 500; main multiplier 1 until
    # step 5000, then (10000 − step)/5000; after the warmup the ramp goes 1 → 0.5 over 8500 steps.
    for step, want in ((499, 0.0), (500, 0.0), (1000, 0.12 * 0.5 * 0.5), (1500, 0.06),
                       (5000, 0.06 * (1 - 0.5 * 3500 / 8500)),
                       (7500, 0.06 * 0.5 * (1 - 0.5 * 6000 / 8500)),
                       (9999, 0.06 * (1 / 5000) * (1 - 0.5 * 8499 / 8500))):
        assert schedule.kappa_lr(step, 10000, cfg.train, cfg.model) == pytest.approx(want, rel=1e-12, abs=1e-15), step
    # Negative control: the paper's schedule at the same steps is different (warmup (i+1)/warmup
    # from step 1000, no width scaling, no main-LR multiplier).
    paper = load_config(None, ["model.hidden_size=3072", "model.num_attention_heads=24"])
    assert schedule.kappa_lr(1000, 10000, paper.train, paper.model) == pytest.approx(0.12 / 1000)
    assert schedule.kappa_lr(7500, 10000, paper.train, paper.model) != pytest.approx(schedule.kappa_lr(7500, 10000,
                                                                                                       cfg.train,
                                                                                                       cfg.model))


def test_variant_settings_and_conflicting_keys():
    assert kappa_settings(kcfg().model.kappa) == kappa_settings(kcfg("input=logit").model.kappa)
    s = kappa_settings(kcfg("input=normalized").model.kappa)
    assert (s.U, s.logit_scale, s.tanh_gain, s.router_grad_scale, s.input) == (4.0, 1.0, 1.0, 0.1, "normalized")
    s = kappa_settings(kcfg("input=scaled").model.kappa)
    assert (s.U, s.logit_scale, s.tanh_gain, s.router_grad_scale) == (3.0, 0.15, 2.0, 0.1)
    s = kappa_settings(kcfg("input=scaled", "router_grad_scale=1", "U=5").model.kappa)
    assert (s.U, s.router_grad_scale) == (5.0, 1.0)
    s = kappa_settings(kcfg("logit_scale=0.15", "tanh_gain=2").model.kappa)  # the input logit takes them freely
    assert (s.logit_scale, s.tanh_gain, s.router_grad_scale) == (0.15, 2.0, 1.0)
    for sets, key in [(("input=scaled", "logit_scale=0.3"), "model.kappa.logit_scale"),
                      (("input=normalized", "tanh_gain=2"), "model.kappa.tanh_gain"),
                      (("u_warmup=1.5",), "model.kappa.u_warmup"),
                      (("router_grad_scale=-1",), "model.kappa.router_grad_scale"),
                      (("input=probs",), "model.kappa.input")]:
        with pytest.raises((ConfigError, ValueError), match=key):
            kcfg(*sets)


def test_variants_bring_their_kappa_learning_rates_and_l2_alpha(world1):
    """normalized (02b8de3): κ LR 0.3 → 0.15 (--kappa-bias-lr-scale 1.0, final 0.5, × the embedding
    rate 0.3) and λ_α 1e-2; logit and scaled: the paper's / 14c9b04's 0.12 → 0.06 and 2e-2; a key
    set explicitly wins. The schedule and the penalty read them."""
    from megatron_kappa.kappa import inputs
    for name, want in (("logit", (0.12, 0.06, 2e-2)), ("scaled", (0.12, 0.06, 2e-2)),
                       ("normalized", (0.3, 0.15, 1e-2))):
        v = inputs.resolve(kcfg(f"input={name}").model.kappa)
        assert (v.lr, v.lr_end, v.l2_alpha) == want, name
    v = inputs.resolve(kcfg("input=normalized", "lr=0.5", "lr_end=0.1", "l2_alpha=0.03").model.kappa)
    assert (v.lr, v.lr_end, v.l2_alpha) == (0.5, 0.1, 0.03)
    # the paper schedule's peak after the warmup is the variant's lr; at the last step its lr_end
    cfg = kcfg("input=normalized", "freeze_fraction=0.1", "warmup=10")
    assert schedule.kappa_lr(10 + 9, 100, cfg.train, cfg.model) == pytest.approx(0.3)
    assert schedule.kappa_lr(99, 100, cfg.train, cfg.model) == pytest.approx(0.15)
    # the penalty: λ_α 1e-2 under normalized equals an explicit l2_alpha=0.01 with input logit
    from megatron_kappa.model.build import build_model
    sets = ["model.kappa.l2_reduction=sum", "model.kappa.l2_bias=0"]
    model = build_model(load_config("configs/tiny.yaml", sets), "cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(0))
    def penalty(*s):
        cfg = load_config("configs/tiny.yaml", [*sets, *s])
        return recipe.kappa_l2(model, cfg.model.kappa, cfg.parallel, torch.device("cpu"))
    assert penalty("model.kappa.input=normalized").item() == pytest.approx(
        penalty("model.kappa.l2_alpha=0.01").item(), rel=1e-12)
    assert penalty("model.kappa.input=normalized").item() == pytest.approx(  # negative control: 2e-2
        0.5 * penalty().item(), rel=1e-12)


def test_kappa_lr_batch_scaling():
    """model.kappa.batch_lr_scaling: κ's rate × √(tokens per step / 2¹⁹) under both schedules, as the
    authors' κ group takes the batch-scaled embedding rate as its base (02b8de3 scripts/base_train.py
    939 → nanochat/gpt.py 2812)."""
    for schedule_name in ("paper", "authors"):
        base = [f"model.kappa.schedule={schedule_name}", "train.global_batch=32", "model.seq_length=4096"]
        plain = load_config(None, [*base, "model.kappa.freeze_fraction=0.1"])
        scaled = load_config(None, [*base, "model.kappa.freeze_fraction=0.1", "model.kappa.batch_lr_scaling=true"])
        factor = (32 * 4096 / 2 ** 19) ** 0.5  # 2^17 tokens: 0.5
        for step in (50, 500, 3000, 9999):
            assert schedule.kappa_lr(step, 10000, scaled.train, scaled.model) == pytest.approx(
                factor * schedule.kappa_lr(step, 10000, plain.train, plain.model), rel=1e-12), (schedule_name, step)
        assert schedule.kappa_lr(3000, 10000, plain.train, plain.model) > 0


def test_paper_configs_train_kappa_as_the_paper_time_code():
    """configs/base/paper.yaml: κ input scaled, the authors' schedule, the LR batch-scaled (14c9b04);
    the paper's prose stays reachable by keys."""
    cfg = load_config("configs/moe8.yaml", [])
    k = cfg.model.kappa
    assert (k.input, k.schedule, k.batch_lr_scaling, k.lr, k.lr_end) == ("scaled", "authors", True, None, None)
    s = kappa_settings(cfg.model.kappa)
    assert (s.U, s.logit_scale, s.tanh_gain, s.router_grad_scale) == (3.0, 0.15, 2.0, 0.1)
    # moe8: 128 × 2048 tokens per step, width 768: the κ peak is 0.12 × √(2^18 / 2^19)
    total = 10000
    peak = max(schedule.kappa_lr(step, total, cfg.train, cfg.model) for step in range(0, total, 7))
    assert peak == pytest.approx(0.12 * 0.5 ** 0.5, rel=1e-3)
    prose = load_config("configs/moe8.yaml", ["model.kappa.input=logit", "model.kappa.schedule=paper",
                                              "model.kappa.batch_lr_scaling=false"])
    assert max(schedule.kappa_lr(step, total, prose.train, prose.model) for step in range(total)) == pytest.approx(0.12)
