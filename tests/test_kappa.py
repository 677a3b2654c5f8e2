"""kappa_swiglu against a float64 re-computation of the formula, gradcheck, and SwiGLU identity."""
import pytest
import torch
import torch.nn.functional as F

from megatron_kappa.kappa import kappa_swiglu

VARIANTS = {  # name: (use α, use b, logit scale, tanh gain)
    "paper": (True, True, 1.0, 1.0),
    "authors_code": (True, True, 0.15, 2.0),
    "no_alpha": (False, True, 1.0, 1.0),
    "no_bias": (True, False, 1.0, 1.0),
}


def reference(g, u, s, a, b, U, scale, gain):
    """The formula, written out naively (autograd provides its gradients)."""
    z = torch.zeros_like(g)
    if a is not None:
        z = z + a[None, :] * (scale * s)[:, None]
    if b is not None:
        z = z + b[None, :]
    kappa = U ** torch.tanh(gain * z)
    return g * torch.sigmoid(kappa * g) * u


def inputs(n=37, f=24, dtype=torch.float64, seed=0, use_a=True, use_b=True):
    gen = torch.Generator().manual_seed(seed)
    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=dtype) * scale).requires_grad_()
    return (r(n, f, scale=2.0), r(n, f), r(n, scale=3.0),
            r(f, scale=0.5) if use_a else None, r(f, scale=0.5) if use_b else None)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_and_all_gradients_match_float64_formula(variant, dtype, tol):
    use_a, use_b, scale, gain = VARIANTS[variant]
    mine = [None if t is None else t.detach().to(dtype).requires_grad_()
            for t in inputs(use_a=use_a, use_b=use_b)]
    ref_args = [None if t is None else t.detach().double().requires_grad_() for t in mine]
    out = kappa_swiglu(*mine, U=3.0, logit_scale=scale, tanh_gain=gain)
    ref = reference(*ref_args, 3.0, scale, gain)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (out.double() * w).sum().backward()
    (ref * w).sum().backward()
    for got, want in zip(mine, ref_args):
        if got is not None:  # an unused logit (no α) gets a zero gradient, autograd gives None
            expected = torch.zeros_like(want) if want.grad is None else want.grad
            torch.testing.assert_close(got.grad.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradcheck_float64(variant):
    use_a, use_b, scale, gain = VARIANTS[variant]
    args = inputs(n=6, f=5, use_a=use_a, use_b=use_b)
    def fn(*a):
        return kappa_swiglu(*a, U=3.0, logit_scale=scale, tanh_gain=gain)
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7)


def test_alpha_bias_zero_is_plain_swiglu_bit_for_bit():
    g, u, s, _, _ = inputs(dtype=torch.float32)
    zeros = torch.zeros(g.shape[1], requires_grad=True)
    out = kappa_swiglu(g, u, s, zeros, zeros.clone())
    assert torch.equal(out, F.silu(g) * u), (out - F.silu(g) * u).abs().max()
    gk, uk = torch.autograd.grad(out.sum(), (g, u))
    gp, up = torch.autograd.grad((F.silu(g) * u).sum(), (g, u))
    torch.testing.assert_close(gk, gp, rtol=1e-6, atol=1e-7)
    assert torch.equal(uk, up)


def test_chunked_rows_give_the_same_result(monkeypatch):
    """Many chunks (a few rows each) and one chunk agree, forward and backward."""
    from megatron_kappa.kappa import reference as kappa_module

    args = inputs(n=50, f=8, dtype=torch.float64)
    results = []
    for elements in (1 << 18, 24):  # one chunk; chunks of 3 rows with a ragged last one
        monkeypatch.setattr(kappa_module, "_CHUNK_ELEMENTS", elements)
        leaves = [t.detach().clone().requires_grad_() for t in args]
        out = kappa_swiglu(*leaves)
        out.backward(torch.ones_like(out))
        results.append([out.detach()] + [t.grad for t in leaves])
    for x, y in zip(*results):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_negative_control_wrong_logits_change_the_output():
    g, u, s, a, b = inputs(dtype=torch.float32)
    out = kappa_swiglu(g, u, s, a, b)
    shuffled = kappa_swiglu(g, u, s[torch.randperm(len(s), generator=torch.Generator().manual_seed(1))], a, b)
    assert (out - shuffled).abs().max() > 1e-2


def saved_shapes(fn, *args):
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        fn(*args)
    return shapes


def test_backward_saves_only_gate_up_and_small_tensors():
    n, f = 37, 24
    g, u, s, a, b = inputs(n, f, dtype=torch.float32)
    ours = saved_shapes(kappa_swiglu, g, u, s, a, b)
    assert sorted(ours) == sorted([(n, f), (n, f), (n,), (f,), (f,)])
    # Negative control: the same formula through autograd keeps several [N, F] tensors more.
    naive = saved_shapes(reference, g, u, s, a, b, 3.0, 1.0, 1.0)
    assert naive.count((n, f)) > ours.count((n, f)) + 2


def test_bad_shapes_are_one_line_errors():
    g, u, s, a, b = inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match="expected gate/up"):
        kappa_swiglu(g, u[:, :3], s, a, b)
    with pytest.raises(ValueError, match="U must be >= 1"):
        kappa_swiglu(g, u, s, a, b, U=0.9)
