"""Muon / Aurora (megatron_kappa.optim.matrix) against an independent float64 reference.

The reference (tests/support/optim_reference.py) is written from the sources (KellerJordan/Muon
muon.py; the authors' nanochat/optim.py aurora_grad_update_fused) as explicit formulas, one 2-D
matrix at a time.
The same reference checks the DeepSpeed path in tests/test_optimizers.py.
"""

import pytest
import torch

from megatron_kappa.optim.matrix import RowBlocks, aurora_polar, matrix_update, newton_schulz, orthogonalize
from tests.support.optim_reference import ref_direction

D = torch.float64


def ref_run(W0, grads, method, lr, beta, wd, steps, nesterov=True, scale=True):
    """All steps of one matrix (or a stack: each [m, n] slice alone); returns the weights."""
    W, buf, out = W0.clone(), torch.zeros_like(W0), []
    for g in grads:
        buf = beta * buf + (1 - beta) * g
        v = (1 - beta) * g + beta * buf if nesterov else buf
        mats = v.reshape(-1, *v.shape[-2:])
        upd = torch.stack([ref_direction(x, method, steps, scale) for x in mats]).reshape(v.shape)
        W = W * (1 - lr * wd) - lr * upd
        out.append(W.clone())
    return out


def run_opt(W0, grads, method, lr, momentum, weight_decay, ns_steps, nesterov=True, **kw):
    """Our matrix_update driven by the decoupled step DeepSpeed's MuonWithAuxAdam applies."""
    W, buf, out = W0.clone(), torch.zeros_like(W0), []
    for g in grads:
        d = matrix_update(g.clone(), buf, momentum, nesterov, method=method, ns_steps=ns_steps, **kw)
        W = W * (1 - lr * weight_decay) - lr * d
        out.append(W.clone())
    return out


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


SHAPES = {"square": (6, 6), "tall": (12, 5), "wide": (5, 12), "stacked": (3, 4, 10)}
HP = dict(lr=0.01, momentum=0.95, weight_decay=0.05, ns_steps=5)


def data(shape, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    W0 = torch.randn(*shape, generator=g, dtype=D) * 0.1
    return W0, [torch.randn(*shape, generator=g, dtype=D) for _ in range(n)]


# ---- the steps against the reference ------------------------------------------------------
@pytest.mark.parametrize("method", ["muon", "aurora"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_steps_match_float64_reference(method, shape):
    W0, grads = data(SHAPES[shape])
    ours = run_opt(W0, grads, method=method, compute_dtype=D, **HP)
    ref = ref_run(W0, grads, method, HP["lr"], HP["momentum"], HP["weight_decay"], HP["ns_steps"])
    for k, (a, b) in enumerate(zip(ours, ref)):
        # compare the total change since W0, the part the optimizer is responsible for
        assert rel(a - W0, b - W0) < 1e-6, (method, shape, k)


@pytest.mark.parametrize("method", ["muon", "aurora"])
def test_default_fp32_close_to_reference(method):
    W0, grads = data((12, 5))
    ours = run_opt(W0.float(), [g.float() for g in grads], method=method, **HP)
    ref = ref_run(W0, grads, method, HP["lr"], HP["momentum"], HP["weight_decay"], HP["ns_steps"])
    assert rel(ours[-1].double() - W0, ref[-1] - W0) < 1e-4


@pytest.mark.parametrize("change", ["no_nesterov", "no_aspect_scale", "one_round", "twelve_steps"])
def test_negative_controls_fail_the_comparison(change):
    """The comparison is sharp enough to see each ingredient (tall matrix: scale 1.58 for muon)."""
    method = "aurora" if change in ("one_round", "twelve_steps") else "muon"
    W0, grads = data((12, 5) if method == "muon" else (5, 12))
    kw = dict(compute_dtype=D, method=method, **HP)
    if change == "one_round":
        kw["rounds"] = 1
    if change == "twelve_steps":
        W0, grads = data((6, 6))  # square: NS with 5 vs 12 steps differ a lot
        kw["ns_steps"] = 12
    ours = run_opt(W0, grads, **kw)
    ref = ref_run(W0, grads, method, HP["lr"], HP["momentum"], HP["weight_decay"], HP["ns_steps"],
                  nesterov=change != "no_nesterov", scale=change != "no_aspect_scale")
    assert rel(ours[-1] - W0, ref[-1] - W0) > 1e-3


# ---- polar-factor properties ------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(32, 16), (16, 32), (24, 24), (4, 8, 20)])
def test_muon_newton_schulz_band(shape):
    """Keller's coefficients give σ ∈ ≈(0.68, 1.13) after 5 steps (not exactly orthogonal)."""
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=D)
    s = torch.linalg.svdvals(newton_schulz(G, 5, compute_dtype=D))
    assert s.min() > 0.6 and s.max() < 1.25
    assert newton_schulz(G.float(), 5).dtype == torch.float32


def test_aurora_square_is_converged_newton_schulz():
    g = torch.Generator().manual_seed(2)
    Q, _ = torch.linalg.qr(torch.randn(16, 16, generator=g, dtype=D))
    G = Q * torch.linspace(0.3, 1.0, 16, dtype=D)  # well conditioned
    U = aurora_polar(G, ns_steps=12, compute_dtype=D)
    assert (U.T @ U - torch.eye(16, dtype=D)).abs().max() < 1e-6
    assert torch.allclose(U, Q, atol=1e-6)  # polar factor of Q·diag(s) is Q


@pytest.mark.parametrize("shape", [(8, 40), (40, 8)])
def test_aurora_equalises_long_side_norms(shape):
    """Long-side vectors of the update (columns of a wide matrix, rows of a tall one) move
    toward equal squared norm short/long, while the update stays semi-orthogonal."""
    g = torch.Generator().manual_seed(3)
    m, n = shape
    G = torch.randn(8, 40, generator=g, dtype=D) * torch.logspace(-1, 1, 40, dtype=D)
    G = G if shape == (8, 40) else G.T.contiguous()
    plain = newton_schulz(G, 5, (2.0, -1.5, 0.5), compute_dtype=D)
    U = aurora_polar(G, ns_steps=5, compute_dtype=D)
    def long_sq(X):
        return (X * X).sum(0) if m < n else (X * X).sum(1)
    def cv(x):
        return (x.std() / x.mean()).item()
    assert abs(long_sq(U).mean().item() - 8 / 40) < 1e-6
    assert cv(long_sq(U)) < 0.1 < 1.0 < cv(long_sq(plain))
    s = torch.linalg.svdvals(U)
    assert (s - 1).abs().max() < 1e-3


# ---- fused / stacked weights -----------------------------------------------------------------
@pytest.mark.parametrize("method", ["muon", "aurora"])
def test_matrix_split_orthogonalizes_each_block(method):
    g = torch.Generator().manual_seed(4)
    # SwiGLU fc1 [gate; up] = (1, (F, F)) and an interleaved QKV = (2 groups, (q=4, k=2, v=2))
    fc1 = torch.randn(2 * 6, 4, generator=g, dtype=D)
    out = orthogonalize(fc1, method, 5, blocks=RowBlocks(1, (6, 6)), compute_dtype=D)
    for blk, o in zip(fc1.split(6), out.split(6)):
        assert torch.allclose(o, ref_direction(blk, method, 5), atol=1e-9)
    qkv = torch.randn(2 * 8, 5, generator=g, dtype=D)
    out = orthogonalize(qkv, method, 5, blocks=RowBlocks(2, (4, 2, 2)), compute_dtype=D)
    grp, ogrp = qkv.view(2, 8, 5), out.view(2, 8, 5)
    for lo, hi in [(0, 4), (4, 6), (6, 8)]:
        want = ref_direction(grp[:, lo:hi].reshape(-1, 5), method, 5)
        assert torch.allclose(ogrp[:, lo:hi].reshape(-1, 5), want, atol=1e-9)


@pytest.mark.parametrize("method", ["muon", "aurora"])
def test_stacked_experts_with_blocks(method):
    """A grouped-experts fc1 [E, gate; up]: every expert's gate and up are separate matrices."""
    g = torch.Generator().manual_seed(6)
    X = torch.randn(3, 2 * 5, 8, generator=g, dtype=D)
    out = orthogonalize(X, method, 5, blocks=RowBlocks(1, (5, 5)), compute_dtype=D)
    for e in range(3):
        for lo in (0, 5):
            want = ref_direction(X[e, lo:lo + 5], method, 5)
            assert torch.allclose(out[e, lo:lo + 5], want, atol=1e-9)
    whole = orthogonalize(X, method, 5, compute_dtype=D)  # negative control: no blocks
    assert not torch.allclose(whole, out, atol=1e-3)


def test_integer_blocks_mean_equal_row_blocks():
    """DeepSpeed's own meaning of muon_num_heads (k equal row blocks) still works."""
    X = torch.randn(12, 4, generator=torch.Generator().manual_seed(7), dtype=D)
    assert torch.equal(orthogonalize(X, "muon", 5, blocks=2, compute_dtype=D),
                       orthogonalize(X, "muon", 5, blocks=RowBlocks(1, (6, 6)), compute_dtype=D))
    with pytest.raises(ValueError):
        orthogonalize(X, "muon", 5, blocks=5, compute_dtype=D)
    with pytest.raises(ValueError):
        orthogonalize(X, "adam", 5)


def test_matrix_update_momentum_and_nesterov():
    W0, grads = data((12, 4))
    buf = torch.zeros_like(W0)
    upd = matrix_update(grads[0].clone(), buf, 0.95, True, method="muon", compute_dtype=D)
    v = 0.05 * grads[0] + 0.95 * (0.05 * grads[0])  # (1-β)G + β·M with M = (1-β)G
    assert rel(upd, ref_direction(v, "muon", 5)) < 1e-9 and torch.allclose(buf, 0.05 * grads[0])
    plain = matrix_update(grads[1].clone(), buf.clone(), 0.95, False, method="muon", compute_dtype=D)
    m = 0.95 * buf + 0.05 * grads[1]
    assert rel(plain, ref_direction(m, "muon", 5)) < 1e-9


def test_match_rms_adamw_cap():
    from megatron_kappa.optim.matrix import aspect_scale
    assert aspect_scale(16, 4, "match_rms_adamw") == pytest.approx(0.8)
    assert aspect_scale(100, 64, "match_rms_adamw") == 1.0  # the authors' default cap
    assert aspect_scale(100, 64, "match_rms_adamw", 3.0) == pytest.approx(2.0)
    assert aspect_scale(64, 16, "original") == 2.0 and aspect_scale(16, 64, "original") == 1.0


@pytest.mark.parametrize("shape", [(6, 6), (5, 12)])
def test_aurora_direction_is_transpose_equivariant(shape):
    """Stored orientation ([out, in] in megatron, [in, out] in the authors' experts) does not
    change the polar factor; only the 'original' aspect scale depends on it."""
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(5), dtype=D)
    assert torch.allclose(aurora_polar(G.T, compute_dtype=D), aurora_polar(G, compute_dtype=D).T,
                          atol=1e-12)
