"""Muon's and Aurora's matrix directions as explicit float64 formulas, one 2-D matrix at a time:
from the sources (KellerJordan/Muon muon.py; the authors' nanochat/optim.py
aurora_grad_update_fused), and the authors' own Aurora step re-stated (optim.py 78-134 and
161-164). Shared by tests/test_matrix_optim.py, tests/test_alpha_optimizer.py,
tests/test_optimizers.py and tests/test_sharded_alpha.py."""
import math

import torch


# ---- reference (float64, 2-D, explicit formulas) ------------------------------------------
def ref_ns(G, coeffs, steps):
    a, b, c = coeffs
    X = G.T if G.shape[0] > G.shape[1] else G
    X = X / (torch.sqrt((X * X).sum()) + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + b * (A @ X) + c * (A @ A @ X)
    return X.T if G.shape[0] > G.shape[1] else X


def ref_aurora(G, steps, rounds=2, beta=0.5):
    m, n = G.shape
    if m == n:
        return ref_ns(G, (2.0, -1.5, 0.5), steps)
    V = G.T if m < n else G
    d = 1.0 / torch.clamp(torch.sqrt((V * V).sum(1)), min=1e-7)
    for r in range(rounds):
        U = ref_ns(d[:, None] * V, (2.0, -1.5, 0.5), steps)
        if r < rounds - 1:
            d = d * ((V.shape[1] / V.shape[0]) / torch.clamp((U * U).sum(1), min=1e-14)) ** beta
    return U.T if m < n else U


def ref_scale(m, n, method):
    return math.sqrt(max(1.0, m / n)) if method == "muon" else min(0.2 * math.sqrt(max(m, n)), 1.0)


def ref_direction(v, method, steps, nesterov_scale=True):
    if method == "muon":
        P = ref_ns(v, (3.4445, -4.7750, 2.0315), steps)
    else:
        P = ref_aurora(v, steps)
    return P * (ref_scale(*v.shape, method) if nesterov_scale else 1.0)


# ---- 14c9b04's Aurora step, re-stated in float64 -----------------------------------------------
def polar_simple_quintic(M: torch.Tensor, iters: int) -> torch.Tensor:
    """optim.py 78-94: X/(‖X‖_F + 1e-7), then X ← 2X + (-1.5A + 0.5A²)X, A = XXᵀ, on the wide side."""
    X = M.mT if M.size(-2) > M.size(-1) else M
    X = X / (torch.linalg.matrix_norm(X) + 1e-7)
    for _ in range(iters):
        A = X @ X.mT
        X = 2.0 * X + (-1.5 * A + 0.5 * (A @ A)) @ X
    return X.mT if M.size(-2) > M.size(-1) else X


def authors_aurora_direction(grad: torch.Tensor, momentum: float = 0.95, ns_steps: int = 5,
                             pp_iterations: int = 2, pp_beta: float = 0.5) -> torch.Tensor:
    """optim.py 97-134 from a zero momentum buffer (α's first step): the unscaled direction of one
    [m, n] matrix."""
    buf = torch.zeros_like(grad).lerp(grad, 1 - momentum)
    update = grad.lerp(buf, momentum)  # Nesterov
    m, n = update.shape
    if m == n:
        return polar_simple_quintic(update, ns_steps)
    transposed = m < n
    if transposed:
        update, (m, n) = update.mT, (n, m)
    target_row_sq = n / m
    Dg = update.norm(dim=-1, keepdim=True).clamp(min=1e-7).reciprocal()
    for it in range(pp_iterations):
        U = polar_simple_quintic(Dg * update, ns_steps)
        if it < pp_iterations - 1:
            row_sq = U.square().sum(dim=-1, keepdim=True).clamp(min=1e-14)
            Dg = Dg * (target_row_sq / row_sq) ** pp_beta
    return U.mT if transposed else U


def authors_scale(shape, capped: bool = True) -> float:
    """get_muon_lr_scale with match_rms_adamw (optim.py 299-311) and the cap of 1.0 that
    _resolve_matrix_adjust_lr adds (optim.py 180-181)."""
    scale = 0.2 * max(shape[-2], shape[-1]) ** 0.5
    return min(scale, 1.0) if capped else scale
