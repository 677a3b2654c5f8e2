"""The fused Triton κ-SwiGLU kernels against the formula in float64 (on CPU through Triton's
interpreter, TRITON_INTERPRET=1 from conftest), plus determinism, the public entry point and a
negative control. Small tiles (SMALL) make tiny shapes span many programs with ragged edges."""
import pytest
import torch
from conftest import gpu

from megatron_kappa.kappa import kappa_swiglu
from megatron_kappa.kappa.triton_op import kappa_swiglu_triton

U = 3.0
SMALL = dict(block_n=4, block_f=8, chunk_rows=12)  # rows 37 → chunks of 12, tiles of 4: all ragged
VARIANTS = {  # name: (use α, use b, logit scale, tanh gain)
    "paper": (True, True, 1.0, 1.0),
    "authors_code": (True, True, 0.15, 2.0),
    "no_alpha": (False, True, 1.0, 1.0),
    "no_bias": (True, False, 1.0, 1.0),
    "kappa_one": (False, False, 1.0, 1.0),
}


def formula(g, u, s, a, b, scale, gain, counts=None):
    """The math written naively (autograd gives the reference gradients); per-row α, b by expert."""
    rows = (lambda p: p[None, :]) if counts is None else (
        lambda p: p[torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))])
    z = torch.zeros_like(g)
    if a is not None:
        z = z + rows(a) * (scale * s)[:, None]
    if b is not None:
        z = z + rows(b)
    kappa = U ** torch.tanh(gain * z)
    return g * torch.sigmoid(kappa * g) * u


def make(n, f, counts=None, use_a=True, use_b=True, dtype=torch.float32, seed=0, logit_mag=3.0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape, mag=1.0: (torch.randn(*shape, generator=gen) * mag).to(dtype).requires_grad_()  # noqa: E731
    pshape = (f,) if counts is None else (len(counts), f)
    return [r(n, f, mag=2.0), r(n, f), r(n, mag=logit_mag),
            r(*pshape, mag=0.5) if use_a else None, r(*pshape, mag=0.5) if use_b else None]


def run(fn, leaves, w):
    """Output and the gradients of all five inputs (None where absent or unused)."""
    out = fn(*leaves)
    (out.double() * w).sum().backward()
    return out, [None if t is None else t.grad for t in leaves]


def close(got, want, tol):
    assert (got is None) == (want is None), (got, want)
    if want is not None:
        assert got.shape == want.shape
        peak = want.abs().max().item() if want.numel() else 0.0
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * max(1.0, peak))


def check(n, f, counts=None, variant="paper", dtype=torch.float32, tol=1e-5, logit_mag=3.0,
          kernel_args=None, ref_logit=None, ref_alpha=None, **blocks):
    """Triton output and gradients against float64 autograd of the formula on the same inputs.
    kernel_args, ref_logit, ref_alpha: tamper with one side (negative controls)."""
    use_a, use_b, scale, gain = VARIANTS[variant]
    leaves = make(n, f, counts, use_a, use_b, dtype, logit_mag=logit_mag)
    refs = [None if t is None else t.detach().double().requires_grad_() for t in leaves]
    if ref_logit is not None:
        refs[2] = ref_logit(refs[2].detach()).requires_grad_()
    if ref_alpha is not None:
        refs[3] = ref_alpha(refs[3].detach()).requires_grad_()
    tpe = None if counts is None else torch.tensor(counts)
    w = torch.randn(n, f, generator=torch.Generator().manual_seed(5)).to(dtype).double()
    out, grads = run(lambda *a: kappa_swiglu_triton(*a, U, scale, gain, tpe, **blocks), leaves, w)
    ref, ref_grads = run(lambda *a: formula(*a, scale, gain, counts), refs, w)
    assert out.dtype == dtype and out.shape == (n, f)
    close(out, ref, tol)
    for name, got, want, leaf in zip("g u s α b".split(), grads, ref_grads, leaves):
        if leaf is not None:
            assert got is None or got.dtype == leaf.dtype, name
        close(got, want, tol)


@pytest.mark.parametrize("grouped", [False, True], ids=["one_expert", "grouped"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_formula(variant, grouped):
    check(37, 24, [9, 0, 14, 1, 13] if grouped else None, variant, **SMALL)


@pytest.mark.parametrize("n,f,blocks", [
    (0, 24, SMALL), (1, 24, SMALL), (70, 40, SMALL), (37, 5, SMALL),  # F < block, not a power of 2
    (37, 24, dict(block_n=8, block_f=16, chunk_rows=7)),  # chunks not a multiple of the tile
    (37, 24, {}),  # the default tiles and chunking
], ids=["n0", "n1", "n70_f40", "f5", "chunk7", "defaults"])
def test_shapes(n, f, blocks):
    check(n, f, **blocks)


def test_grouped_empty_experts_and_chunk_boundaries():
    """Empty experts first, last, and exactly on chunk boundaries (12, 24); a chunk with 3 experts."""
    check(37, 24, [0, 12, 0, 12, 5, 0, 2, 6, 0], **SMALL)
    check(0, 24, [0, 0, 0], **SMALL)  # N = 0 grouped: zero α, b gradients


def test_saturated_kappa_large_logits():
    check(40, 16, logit_mag=50.0, **SMALL)
    check(40, 16, [20, 0, 20], logit_mag=50.0, variant="authors_code", **SMALL)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_half_precision_io(dtype, tol):
    check(37, 24, [20, 0, 17], dtype=dtype, tol=tol, **SMALL)


def test_gradients_are_deterministic():
    counts = torch.tensor([9, 0, 14, 1, 13])
    grads = []
    for _ in range(2):
        leaves = make(37, 24, counts.tolist())
        out = kappa_swiglu_triton(*leaves, U, 0.15, 2.0, counts, **SMALL)
        out.backward(torch.ones_like(out))
        grads.append([out] + [t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("grouped", [False, True], ids=["one_expert", "grouped"])
def test_public_entry_point_matches_torch_backend(grouped):
    counts = [9, 0, 14, 1, 13] if grouped else None
    tpe = None if counts is None else torch.tensor(counts)
    results = []
    for backend in ("triton", "torch"):
        leaves = make(37, 24, counts)
        out = kappa_swiglu(*leaves, U=U, logit_scale=0.15, tanh_gain=2.0, backend=backend,
                           tokens_per_expert=tpe)
        out.backward(torch.ones_like(out))
        results.append([out] + [t.grad for t in leaves])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_strided_inputs_and_frozen_params():
    """gate, up as the two halves of one fc1 output [N, 2F] (a row stride of 2F), or transposed;
    α, b frozen (no gradient asked for them)."""
    leaves = make(37, 24)
    fc1 = torch.cat([leaves[0], leaves[1]], 1).detach().requires_grad_()
    gate, up = fc1.chunk(2, dim=1)
    a, b = leaves[3].detach(), leaves[4].detach()
    out = kappa_swiglu_triton(gate, up, leaves[2], a, b, U, 1.0, 1.0, **SMALL)
    out.sum().backward()
    ref = formula(gate.detach().double().requires_grad_(), up.detach().double().requires_grad_(),
                  leaves[2].detach().double(), a.double(), b.double(), 1.0, 1.0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert fc1.grad.shape == (37, 48) and a.grad is None and leaves[2].grad is not None
    up_t = up.detach().t().contiguous().t()  # column stride ≠ 1: copied before the kernel
    torch.testing.assert_close(kappa_swiglu_triton(gate, up_t, leaves[2], a, b, U, 1.0, 1.0, **SMALL),
                               out, rtol=0, atol=0)


def test_negative_control_detects_wrong_rows_or_experts():
    """The comparison is sharp: an off-by-one logit row or another expert's α must fail it."""
    with pytest.raises(AssertionError):
        check(37, 24, ref_logit=lambda s: s.roll(1), **SMALL)
    with pytest.raises(AssertionError):
        check(37, 24, [9, 0, 14, 1, 13], ref_alpha=lambda a: a.roll(1, 0), **SMALL)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [False, True], ids=["one_expert", "grouped"])
def test_compiled_kernels_bf16_on_cuda(grouped):
    """The real compiled kernels, in a process without TRITON_INTERPRET (this one interprets)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # conftest keeps an explicit setting
    code = f"import test_kappa_triton as t; t.compiled_kernels_bf16_on_cuda({grouped})"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def compiled_kernels_bf16_on_cuda(grouped):
    """The real compiled kernels (default tiles) in bf16 against the float64 formula."""
    n, f = 3000, 1000
    counts = [1000, 0, 999, 1, 1000] if grouped else None
    tpe = None if counts is None else torch.tensor(counts, device="cuda")
    leaves = [None if t is None else t.detach().cuda().requires_grad_()
              for t in make(n, f, counts, dtype=torch.bfloat16)]
    refs = [None if t is None else t.detach().double().requires_grad_() for t in leaves]
    w = torch.randn(n, f, device="cuda").bfloat16().double()
    out, grads = run(lambda *a: kappa_swiglu_triton(*a, U, 0.15, 2.0, tpe), leaves, w)
    ref, ref_grads = run(lambda *a: formula(*a, 0.15, 2.0, counts), refs, w)
    close(out, ref, 1.6e-2)
    for got, want in zip(grads, ref_grads):
        close(got, want, 1.6e-2)
    again = run(lambda *a: kappa_swiglu_triton(*a, U, 0.15, 2.0, tpe),
                [None if t is None else t.detach().requires_grad_() for t in leaves], w)[1]
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
