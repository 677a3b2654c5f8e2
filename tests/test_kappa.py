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


# ---- rows grouped by expert, scaled by their routing probabilities (the experts' torch path) ----

COUNTS = [5, 0, 11, 3, 18]  # an expert with no rows among them


def grouped_inputs(dtype, use_a=True, use_b=True, seed=2, f=24):
    gen = torch.Generator().manual_seed(seed)
    n, e = sum(COUNTS), len(COUNTS)
    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale
    leaves = [r(n, f, scale=2.0), r(n, f), r(n, scale=3.0), r(e, f, scale=0.5) if use_a else None,
              r(e, f, scale=0.5) if use_b else None, torch.rand(n, generator=gen, dtype=torch.float64)]
    routing = torch.float64 if dtype == torch.float64 else torch.float32  # the logit's and p's dtype
    return [None if t is None else t.to(routing if i in (2, 5) else dtype).requires_grad_()
            for i, t in enumerate(leaves)]


def grouped_reference(g, u, s, a, b, p, U, scale, gain):
    """Each row with its own expert's α and b, naively, then · p (autograd gives the gradients)."""
    expert = torch.repeat_interleave(torch.arange(len(COUNTS)), torch.tensor(COUNTS))
    rows = [reference(g[i:i + 1], u[i:i + 1], s[i:i + 1], None if a is None else a[e], None if b is None else b[e],
                      U, scale, gain) for i, e in enumerate(expert.tolist())]
    return torch.cat(rows) * p.unsqueeze(-1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_grouped_rows_scaled_by_probs_match_a_float64_row_by_row_loop(variant, monkeypatch):
    """kappa_swiglu(tokens_per_expert=..., probs=...) in fp32, in one chunk and in chunks of 3
    rows that cross the experts' edges, against the formula row by row in float64: the output and
    the gradients of gate, up, logit, α, b and p. Negative control: the counts of two experts
    swapped (each row then gets another expert's α, b) is far off."""
    from megatron_kappa.kappa import reference as kappa_module
    use_a, use_b, scale, gain = VARIANTS[variant]
    ref_leaves = grouped_inputs(torch.float64, use_a, use_b)
    ref = grouped_reference(*ref_leaves, 3.0, scale, gain)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (ref * w).sum().backward()
    for elements in (1 << 18, 72):
        monkeypatch.setattr(kappa_module, "_CHUNK_ELEMENTS", elements)
        mine = [None if t is None else t.detach().float().requires_grad_() for t in ref_leaves]
        out = kappa_swiglu(*mine[:5], U=3.0, logit_scale=scale, tanh_gain=gain, backend="torch",
                           tokens_per_expert=torch.tensor(COUNTS), probs=mine[5])
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        (out.double() * w).sum().backward()
        for got, want in zip(mine, ref_leaves):
            if got is not None:  # the logit without α gets a zero gradient, autograd gives None
                expected = torch.zeros_like(want) if want.grad is None else want.grad
                torch.testing.assert_close(got.grad.double(), expected, rtol=1e-5, atol=1e-5)
    swapped = torch.tensor([COUNTS[2], 0, COUNTS[0], *COUNTS[3:]])
    wrong = kappa_swiglu(*mine[:5], U=3.0, logit_scale=scale, tanh_gain=gain, backend="torch",
                         tokens_per_expert=swapped, probs=mine[5])
    assert (wrong.double() - ref).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("f", [128, 24])
def test_the_fused_op_gives_what_expert_by_expert_calls_and_autograds_scaling_gave(dtype, f, monkeypatch):
    """The experts' torch path before this op: κ-SwiGLU called expert by expert, then autograd's
    (h · p).to(dtype). With F a multiple of torch's vector loop (128 here; real widths are
    multiples of 64): the output and every gradient equal to the bit, in one chunk and in chunks
    that cut the largest expert's rows (α, b and the logit's gradients are summed over the same
    pieces in the same order). With F = 24, a vectorised loop's scalar tail (where torch's tanh and
    exp round differently in the last place) falls elsewhere in a chunk of several experts' rows:
    within a few units in the last place of the dtype."""
    from megatron_kappa.kappa import reference as kappa_module
    leaves = grouped_inputs(dtype, f=f)
    dy = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    for elements in (1 << 18, 10 * f):  # chunks of 10 rows: two for the 18-row expert, 5 + 0 + 11 > 10
        monkeypatch.setattr(kappa_module, "_CHUNK_ELEMENTS", elements)
        fused = [t.detach().clone().requires_grad_() for t in leaves]
        out = kappa_swiglu(*fused[:5], U=4.0, logit_scale=0.15, tanh_gain=2.0, backend="torch",
                           tokens_per_expert=torch.tensor(COUNTS), probs=fused[5])
        out.backward(dy)
        old = [t.detach().clone().requires_grad_() for t in leaves]
        g, u, s, a, b, p = old
        parts = [kappa_swiglu(gg, uu, ss, a[e], b[e], 4.0, 0.15, 2.0, backend="torch")
                 for e, (gg, uu, ss) in enumerate(zip(g.split(COUNTS), u.split(COUNTS), s.split(COUNTS)))]
        want = (torch.cat(parts) * p.unsqueeze(-1)).to(dtype)
        want.backward(dy)
        assert old[3].grad.abs().sum() > 0 and old[5].grad.abs().sum() > 0  # the gradients are there
        if f % 64 == 0:
            assert torch.equal(out, want)
            for i in range(6):
                assert torch.equal(fused[i].grad, old[i].grad), i
            continue
        tol = 1e-6 if dtype == torch.float32 else 1e-2  # of the largest value (observed 1.1e-7; bf16 3.6e-3)
        def off(x, y):
            return ((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
        assert off(out, want) <= tol
        for i in range(6):
            assert off(fused[i].grad, old[i].grad) <= tol, i


def test_probs_are_refused_where_the_op_does_not_scale_them():
    g, u, s, a, b = inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match="probs are scaled in the op on the torch backend"):
        kappa_swiglu(g, u, s, a, b, backend="triton", probs=torch.rand(g.shape[0]))
