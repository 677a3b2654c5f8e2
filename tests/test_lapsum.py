"""lapsum_topk against an independent float64 reference (bisection for the threshold; gradients by
autograd through one Newton step from the bisection root, which is the implicit-function
gradient), gradcheck, invariants, limits, and negative controls for the closed-form VJP."""
import pytest
import torch

from megatron_kappa.model.lapsum import LapSumTopK, lapsum_threshold, lapsum_topk
from tests.support.lapsum_reference import ref_threshold, reference

f64 = torch.float64


def assert_close(actual, expected, tol, what=""):
    """Max error ≤ tol × (largest |expected|, or 1 for "p")."""
    err = (actual.to(f64) - expected.to(f64)).abs().max().item()
    scale = 1.0 if what == "p" else expected.abs().max().item()
    assert err <= tol * scale + 1e-300, f"{what}: max error {err:.3e} vs tol {tol:.1e} × {scale:.3e}"


def error_bounds(r, k, a, v, tol):
    """Per row, the allowed error of grad_r, grad_k, grad_α: tol × the size of the terms each VJP
    adds up, plus the reference's own rounding. Terms (from the reference threshold; φ, q, t as in
    the module doc): (Σφ/α)·max|v| for grad_r, max|v| for grad_k, (Σφ/α)·Σ q_i|v_i||t_i − ⟨q,t⟩|
    for grad_α. Reference rounding: it forms t = (r − b)/α in float64 from r and b, so t carries
    ε·(|b| + max|r|)/α, which is O(1e-12) for α = 1e-4. A gradient can be structurally zero while
    its terms are not (one active entry: grad_r ≡ 0; tied active entries: grad_α ≡ 0), and then
    only that rounding is left, which is why a bound relative to the gradient itself won't do."""
    rows = r.shape[0]
    k = k.detach().to(f64).expand(rows) if k.dim() == 0 else k.detach().to(f64)
    a = (a.detach().to(f64).expand(rows) if a.dim() == 0 else a.detach().to(f64))[:, None]
    r = r.detach().to(f64)
    b = ref_threshold(r, k, a)[:, None]
    t = (r - b) / a
    q = torch.softmax(-t.abs(), -1)
    v = v.abs().to(f64)
    sum_phi_over_a = 0.5 * torch.exp(torch.logsumexp(-t.abs(), -1)) / a[:, 0]
    t_noise = torch.finfo(f64).eps * (b.abs()[:, 0] + r.abs().amax(-1)) / a[:, 0]
    s_r = sum_phi_over_a * v.amax(-1)
    s_a = sum_phi_over_a * (q * v * (t - (q * t).sum(-1, keepdim=True)).abs()).sum(-1)
    return tol * s_r + t_noise * s_r, tol * v.amax(-1) + t_noise * v.amax(-1), tol * s_a + t_noise * s_r


def assert_grads_close(got, ref, r, k, a, v, tol):
    """grad_r, grad_k, grad_α within `error_bounds` row by row (for a scalar k or α, whose gradient
    is the sum of the rows', within the sum of the rows' bounds)."""
    for name, x, y, bound, like in zip(("grad_r", "grad_k", "grad_alpha"), got, ref,
                                       error_bounds(r, k, a, v, tol), (r, k, a)):
        assert x.shape == y.shape == like.shape, name
        err = (x.to(f64) - y.to(f64)).abs()
        if like.dim() == 0:
            err, bound = err.reshape(1), bound.sum().reshape(1)
        elif like.dim() == 2:
            err = err.amax(-1)
        worst = (err / bound).max().item()
        assert (err <= bound).all(), f"{name}: error {worst:.2e} × its bound"


def make(case, dtype=f64, seed=0, rows=12, n=8):
    """(r, k, α) leaves requiring grad for a named input regime."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(rows, n, generator=g, dtype=f64)
    k, a = 2.5, 1.0
    if case == "ties":
        r = torch.randint(0, 3, (rows, n), generator=g).to(f64)  # many exact ties, at the threshold too
        k = 3.0
    elif case == "ties_tiny_alpha":
        r = torch.tensor([[1.0, 1, 0, 0, -2, 1, 0.5, 0.5]]).repeat(rows, 1)
        k, a = 2.0, 1e-4  # the three tied 1s share k = 2: the threshold sits on a tie
    elif case == "k_small":
        k = 0.01
    elif case == "k_large":
        k = n - 0.01
    elif case == "alpha_tiny":  # mostly one entry within reach of the threshold: grad_r ≡ 0
        k, a = 3.3, 1e-4
    elif case == "alpha_tiny_dense":  # several entries within a few α, far from 0 in units of α
        r = 5 + 3e-4 * r
        k, a = 3.3, 1e-4
    elif case == "alpha_huge":
        k, a = 1.7, 1e4
    elif case == "r_large":
        r = (torch.rand(rows, n, generator=g, dtype=f64) * 2 - 1) * 1e3
        k, a = 4.2, 3.0
    elif case == "per_row":
        k = torch.rand(rows, generator=g, dtype=f64) * (n - 0.2) + 0.1
        a = torch.rand(rows, generator=g, dtype=f64) * 2 + 0.1
    def leaf(x):
        return torch.as_tensor(x, dtype=f64).to(dtype).requires_grad_()
    return leaf(r), leaf(k), leaf(a)


def f64_leaves(*xs):
    """The same values in float64 (fp32 inputs are compared with the exact answer for them)."""
    return [x.detach().to(f64).requires_grad_() for x in xs]


def grads(fn, r, k, a, v):
    p = fn(r, k, a)
    gr, gk, ga = torch.autograd.grad((p * v).sum(), (r, k, a))
    return p, gr, gk, ga


CASES = ["normal", "ties", "ties_tiny_alpha", "k_small", "k_large", "alpha_tiny", "alpha_tiny_dense",
         "alpha_huge", "r_large", "per_row"]


@pytest.mark.parametrize("case", CASES)
def test_matches_float64_reference(case):
    r, k, a = make(case)
    v = torch.randn(r.shape, generator=torch.Generator().manual_seed(1), dtype=f64)
    p, *g = grads(lapsum_topk, r, k, a, v)
    p_ref, *g_ref = grads(reference, r, k, a, v)
    rows = r.shape[0]
    b_ref = ref_threshold(r, k.expand(rows), a.expand(rows)[:, None])
    # the reference's t = (r − b)/α carries ε·(|b| + |r|)/α (see error_bounds), p half of that
    t_noise = torch.finfo(f64).eps * ((b_ref.abs() + r.abs().amax(-1)) / a.detach()).max().item()
    assert_close(p, p_ref, 1e-12 + t_noise, "p")
    assert_grads_close(g, g_ref, r, k, a, v, 1e-9)
    b_err = (lapsum_threshold(r, k, a) - b_ref).abs()
    assert (b_err <= 1e-12 * (b_ref.abs() + a.detach())).all()  # a few ulps of b, or of t = (r − b)/α


@pytest.mark.parametrize("case", CASES)
def test_float32_matches_reference(case):
    r, k, a = make(case, dtype=torch.float32)
    v = torch.randn(r.shape, generator=torch.Generator().manual_seed(2))
    p, *g = grads(lapsum_topk, r, k, a, v)
    assert p.dtype == g[0].dtype == g[1].dtype == g[2].dtype == torch.float32
    r64, k64, a64 = f64_leaves(r, k, a)
    p_ref, *g_ref = grads(reference, r64, k64, a64, v.to(f64))
    assert_close(p, p_ref, 5e-7, "p")
    assert_grads_close(g, g_ref, r64, k64, a64, v, 1e-6)


def test_gradcheck_all_inputs():
    for case in ("normal", "ties", "per_row", "k_small"):
        r, k, a = make(case, rows=4, n=6)
        assert torch.autograd.gradcheck(lapsum_topk, (r, k, a))


def test_sum_and_range():
    for case in CASES:
        for dtype, tol in ((f64, 1e-12), (torch.float32, 2e-6)):
            r, k, a = make(case, dtype=dtype)
            p = lapsum_topk(r, k, a).detach()
            k_rows = k.detach().expand(r.shape[0])
            assert torch.isfinite(p).all()
            assert ((p.to(f64).sum(-1) - k_rows).abs() <= tol * r.shape[1]).all(), case
            assert ((p >= 0) & (p <= 1)).all()
            if case in ("normal", "ties", "k_small", "k_large", "per_row"):  # no underflow to 0/1
                assert ((p > 0) & (p < 1)).all()


def test_shift_and_scale_invariance():
    """p(r + c, α) = p(r, α) per row and p(c·r, c·α) = p(r, α); differentiating these gives
    Σ_j grad_r_j = 0 and ⟨grad_r, r⟩ + α·grad_α = 0 (per row; summed here, α being a scalar)."""
    r, k, a = make("normal")
    g = torch.Generator().manual_seed(7)
    v = torch.randn(r.shape, generator=g, dtype=f64)
    p, gr, gk, ga = grads(lapsum_topk, r, k, a, v)
    shifted = (r.detach() + 100.0 * torch.randn(r.shape[0], 1, generator=g, dtype=f64)).requires_grad_()
    p2, gr2, gk2, ga2 = grads(lapsum_topk, shifted, k, a, v)
    for x, y in ((p, p2), (gr, gr2), (gk, gk2), (ga, ga2)):
        assert_close(x, y, 1e-9)
    assert (gr.sum(-1).abs() <= 1e-12 * gr.abs().max()).all()
    scaled = (r.detach() * 7.5).requires_grad_()
    assert_close(lapsum_topk(scaled, k, a * 7.5), p, 1e-12, "p")
    assert abs((gr * r).sum() + a * ga) <= 1e-12 * (gr * r).abs().sum()


def test_limits():
    p = lapsum_topk(torch.tensor([[3.0, 2, 1, 0, -1]]), 2.0, 0.01)
    assert torch.allclose(p, torch.tensor([[1.0, 1, 0, 0, 0]]), atol=1e-6)
    p = lapsum_topk(torch.tensor([[3.0, 2, 1, 0, -1]]), 2.0, 30.0)
    assert torch.allclose(p, torch.full_like(p, 0.4), atol=0.04)
    g = torch.Generator().manual_seed(3)
    r = torch.stack([torch.randperm(10, generator=g) for _ in range(20)]).to(f64) * 0.5
    for k in (1, 2, 5, 9):
        hard = torch.zeros_like(r).scatter_(-1, r.topk(k, -1).indices, 1.0)
        for dtype in (f64, torch.float32):
            assert_close(lapsum_topk(r.to(dtype), float(k), 1e-3), hard, 1e-12, "p")
        soft = lapsum_topk(torch.randn(20, 10, generator=g, dtype=f64), k + 0.3, 1e7)
        assert_close(soft, torch.full_like(soft, (k + 0.3) / 10), 1e-6, "p")


def test_extremes_are_finite():
    """Ties, k → 0 / n, α from 1e-4 to 1e4, |r| up to 1e3, fp32 and fp64, k exactly 0 or n."""
    g = torch.Generator().manual_seed(4)
    n = 16
    inputs = [torch.randn(8, n, generator=g) * 1e3, torch.randint(0, 2, (8, n), generator=g) * 1e3 - 5e2,
              torch.zeros(8, n), torch.randint(-1, 2, (8, n), generator=g).float()]
    for dtype in (torch.float32, f64):
        for r0 in inputs:
            for k0 in (1e-2, 1.0, 8.0, n - 1.0, n - 1e-2, 0.0, float(n)):
                for a0 in (1e-4, 1.0, 1e4):
                    r = r0.to(dtype).requires_grad_()
                    k = torch.tensor(k0, dtype=dtype, requires_grad=True)
                    a = torch.tensor(a0, dtype=dtype, requires_grad=True)
                    p = lapsum_topk(r, k, a)
                    gr, gk, ga = torch.autograd.grad((p * torch.randn_like(p)).sum(), (r, k, a))
                    ok = all(torch.isfinite(x).all() for x in (p, gr, gk, ga))
                    assert ok, (dtype, k0, a0)
                    if 0 < k0 < n:
                        assert (p.detach().to(f64).sum(-1) - k0).abs().max() < n * 1e-5


def test_batched_equals_row_by_row():
    g = torch.Generator().manual_seed(5)
    rows, n = 40, 12
    r = torch.randn(rows, n, generator=g, dtype=f64).requires_grad_()
    k = (torch.rand(rows, generator=g, dtype=f64) * (n - 0.1) + 0.05).requires_grad_()
    a = torch.tensor(0.7, dtype=f64, requires_grad=True)
    v = torch.randn(rows, n, generator=g, dtype=f64)
    p, gr, gk, ga = grads(lapsum_topk, r, k, a, v)
    ga_sum = torch.zeros((), dtype=f64)
    for i in range(rows):
        pi, gri, gki, gai = grads(lambda r_, k_, a_: lapsum_topk(r_[i:i + 1], k_[i], a_), r, k, a, v[i:i + 1])
        assert_close(pi, p[i:i + 1], 1e-14, "p")
        assert_close(gri[i], gr[i], 1e-13)
        assert_close(gki[i], gk[i], 1e-13)
        ga_sum = ga_sum + gai
    assert_close(ga_sum, ga, 1e-12)  # a scalar α gets the sum of the per-row gradients


def test_low_precision_input():
    r = torch.randn(6, 8, generator=torch.Generator().manual_seed(6)).bfloat16().requires_grad_()
    p = lapsum_topk(r, 3.0, 0.5)
    assert p.dtype == torch.bfloat16
    assert torch.allclose(p.float(), lapsum_topk(r.detach().float(), 3.0, 0.5), atol=4e-3)
    (gr,) = torch.autograd.grad(p.float().pow(2).sum(), r)
    assert gr.dtype == torch.bfloat16 and torch.isfinite(gr.float()).all()


class FlipAlphaSign(LapSumTopK):
    @staticmethod
    def backward(ctx, grad_p):
        gr, gk, ga = LapSumTopK.backward(ctx, grad_p)
        return gr, gk, -ga


class DropKTerm(LapSumTopK):
    """grad_r = (Σφ/α)·q ⊙ v, i.e. without the − grad_k (so Σ grad_r ≠ 0)."""

    @staticmethod
    def backward(ctx, grad_p):
        gr, gk, ga = LapSumTopK.backward(ctx, grad_p)
        t, a_rows = ctx.saved_tensors[:2]
        neg = -t.abs()
        q = torch.softmax(neg, -1)
        scale = 0.5 * torch.exp(torch.logsumexp(neg, -1, keepdim=True)) / a_rows
        return gr + scale * q * (grad_p * q).sum(-1, keepdim=True), gk, ga


@pytest.mark.parametrize("wrong", [FlipAlphaSign, DropKTerm])
def test_wrong_vjp_is_caught(wrong):
    """The comparisons above reject a VJP with one deliberate slip, by far more than their margin."""
    r, k, a = make("normal")
    v = torch.randn(r.shape, generator=torch.Generator().manual_seed(1), dtype=f64)
    _, *g_ref = grads(reference, r, k, a, v)
    _, *g_bad = grads(lambda r_, k_, a_: wrong.apply(r_, k_, a_), r, k, a, v)
    _, *g_good = grads(lambda r_, k_, a_: LapSumTopK.apply(r_, k_, a_), r, k, a, v)
    assert_grads_close(g_good, g_ref, r, k, a, v, 1e-9)
    for tol in (1e-9, 1e-3):  # caught at a million times the tolerance used above
        with pytest.raises(AssertionError, match="grad_alpha" if wrong is FlipAlphaSign else "grad_r"):
            assert_grads_close(g_bad, g_ref, r, k, a, v, tol)
    r, k, a = make("normal", rows=3, n=5)
    assert not torch.autograd.gradcheck(wrong.apply, (r, k, a), raise_exception=False)
