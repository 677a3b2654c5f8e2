"""LapSum soft top-k: a differentiable relaxation of "pick the k largest of n scores".

    p = lapsum_topk(r, k, α),   p_e = F((r_e − b)/α),   b such that Σ_e p_e = k   (per row)

r: scores [T, n]; k ∈ (0, n): the number of "active" entries, real-valued (a 0-d tensor, or one
per row [T]); α > 0: the scale of the Laplace CDF F (0-d or [T]). F(x) = ½eˣ for x ≤ 0 and
1 − ½e⁻ˣ for x > 0 (unit scale). So p ∈ (0, 1) (in floating point, entries more than ~100α
(fp32) or ~700α (fp64) from b are exactly 0 or 1), Σp = k, and p is invariant to adding a
constant to a row of r. α is a temperature: α → 0 gives the hard top-k indicator (integer k),
α → ∞ gives k/n everywhere. (LapSum, arXiv 2503.06242.)

Threshold solve (no grad; fp32, or fp64 for fp64 input; batched, no loop over rows or experts).
In scaled units s = (r − c)/α (c: the row max, then a first estimate of the threshold, below),
H(b) = Σ_j F(s_j − b) is decreasing in b, and on an interval between consecutive sorted knots,
with m knots below b,
    H(b) = (n − m) + ½·L·e^{−b} − ½·U·e^{b},   L = Σ_{j<m} e^{s_j},   U = Σ_{j≥m} e^{−s_j}
(sorted order). H at every knot comes from prefix sums done as `logcumsumexp` (all the
exponentials used are e^{s_j − s_i} with j on the small side, so ≤ 1: nothing overflows);
`searchsorted` gives m = #{knots with H > k}; H(b) = k is then U·y² − 2c·y − L = 0 in y = e^b,
c = n − m − k, whose one positive root is taken in its cancellation-free form
    c ≥ 0:  b = g − log U,     c < 0:  b = log L − g,     g = log(|c| + √(c² + L·U)),
with g evaluated in logs (L·U ≤ n²/4 but log L, log U can each be ±10⁷ for tiny α).

Gradients (closed form, an `autograd.Function`). With t = (r − b)/α, φ = ½e^{−|t|} (the density
at each entry), q = φ/Σφ = softmax(−|t|), differentiating Σ F(t) = k implicitly gives
    ∂p_i/∂k = q_i,  ∂p_i/∂r_j = (φ_i/α)(δ_ij − q_j),  ∂p_i/∂α = −(φ_i/α)(t_i − ⟨q, t⟩),
so for an upstream v:
    grad_k = ⟨v, q⟩,   grad_r = (Σφ/α)·q ⊙ (v − grad_k),
    grad_α = −(Σφ/α)·Σ_i q_i v_i (t_i − ⟨q, t⟩) = −(Σφ/α²)·Σ_i q_i v_i (r_i − ⟨q, r⟩)
(the last from r, see backward). A 0-d (or [1]) k or α gets the sum of its per-row gradients.

Pitfalls handled: `torch.where` evaluates both branches, so each branch is kept finite (the
quadratic's unused branch is ±inf, never NaN; F uses e^{−|t|} in both); q is a softmax and Σφ is
exp(logsumexp), so q stays finite when every φ underflows (tiny α, integer k: the true gradient is
then ~e^{−gap/α}, returned as 0); saved tensors are never modified; k is clamped inside the solve
to [4nε, n − 4nε] so that k = 0 or n (outside the contract) gives finite output instead of NaN.
Scores must be finite. Precision: a solve relative to the row max gives t only to
~ε·(max r − b)/α; so the scores are re-centred on that first b and solved again (see _threshold),
which leaves the entries near the threshold with t accurate to a few ulps of t.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LapSumTopK", "lapsum_threshold", "lapsum_topk"]


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _per_row(x, rows: int, dtype: torch.dtype, device) -> Tensor:
    """k or α as one value per row (detached): a 0-d / [1] tensor is broadcast, a [T] one kept."""
    x = torch.as_tensor(x, dtype=dtype, device=device).detach().reshape(-1)
    if x.numel() not in (1, rows):
        raise ValueError(f"expected a scalar or one value per row ({rows}), got {x.numel()} values")
    return x.expand(rows)


@torch.no_grad()
def _solve_scaled(s: Tensor, k: Tensor) -> Tensor:
    """The threshold b [T] with Σ_j F(s_j − b) = k for scaled scores s [T, n] (see the module doc)."""
    rows, n = s.shape
    tiny = 4 * n * torch.finfo(s.dtype).eps
    k = k.clamp(tiny, n - tiny)[:, None]
    ss = torch.sort(s, dim=-1).values
    lo = torch.logcumsumexp(ss, -1)  # log Σ_{j≤i} e^{s_j}
    hi = torch.logcumsumexp(-ss.flip(-1), -1).flip(-1)  # log Σ_{j≥i} e^{−s_j}
    # H at knot i: Σ_{j<i} ½e^{s_j−s_i} + ½ + Σ_{j>i} (1 − ½e^{s_i−s_j}); both exps below are in [1, n].
    i = torch.arange(n, device=s.device, dtype=s.dtype)
    knots = (n - 0.5 - i) + 0.5 * torch.exp(lo - ss) - 0.5 * torch.exp(ss + hi)
    # −H is ascending up to rounding; cummax makes it exactly so, as searchsorted requires.
    ascending = torch.cummax(-knots, dim=-1).values
    m = torch.searchsorted(ascending, -k)  # [T, 1] = #{knots with H > k}: those lie below b
    ninf = torch.full((rows, 1), -torch.inf, dtype=s.dtype, device=s.device)
    log_l = torch.cat([ninf, lo], -1).gather(-1, m)  # log Σ_{j<m} e^{s_j}   (−inf when m = 0)
    log_u = torch.cat([hi, ninf], -1).gather(-1, m)  # log Σ_{j≥m} e^{−s_j}  (−inf when m = n)
    c = (n - m).to(s.dtype) - k
    # g = log(|c| + √(c² + e^z)) scaled by e^h, h = max(log|c|, z/2), so both terms are ≤ 1 and
    # the argument of the log is in [1, 1 + √2]. Only k ∈ {0, n} could make h = −inf (clamped).
    z = log_l + log_u
    log_c = torch.log(c.abs())
    h = torch.maximum(log_c, 0.5 * z)
    cs = torch.exp(log_c - h)
    g = h + torch.log(cs + torch.sqrt(cs * cs + torch.exp(z - 2 * h)))
    # c ≥ 0 implies m < n (log_u finite), c < 0 implies m > 0 (log_l finite); the branch not taken
    # is ±inf, not NaN.
    return torch.where(c >= 0, g - log_u, log_l - g).squeeze(-1)


def _threshold(scores: Tensor, k, alpha) -> tuple[Tensor, Tensor, Tensor]:
    """(t = (r − b)/α [T, n], α per row [T, 1], b [T, 1]) in the compute dtype, all detached."""
    if scores.dim() != 2:
        raise ValueError(f"scores must be [tokens, experts], got shape {tuple(scores.shape)}")
    dtype = _compute_dtype(scores)
    rows = scores.shape[0]
    r = scores.detach().to(dtype)
    k_rows = _per_row(k, rows, dtype, scores.device)
    a_rows = _per_row(alpha, rows, dtype, scores.device)[:, None]
    # Pass 1, relative to the row max, locates b, but only to ~ε·(max r − b)/α in t: for α = 1e-4
    # and a spread of 1e3 that is O(1). Pass 2 re-centres on that estimate: r − b₁ is exact for the
    # entries near the threshold (the only ones whose p is not 0 or 1 to working precision), so t
    # comes out with the error of a few ulps of t itself.
    r_max = r.amax(-1, keepdim=True)
    b1 = r_max + a_rows * _solve_scaled((r - r_max) / a_rows, k_rows)[:, None]
    s = (r - b1) / a_rows
    b2 = _solve_scaled(s, k_rows)[:, None]
    return s - b2, a_rows, b1 + a_rows * b2


def lapsum_threshold(scores: Tensor, k, alpha) -> Tensor:
    """The threshold b [T] (score units, compute dtype, no grad) with Σ_e F((r_e − b)/α) = k."""
    return _threshold(scores, k, alpha)[2].squeeze(-1)


def _reduce(grad_rows: Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """Per-row gradient [T] → the input's shape: a single value gets the sum over rows."""
    g = grad_rows.sum() if shape.numel() == 1 else grad_rows
    return g.reshape(shape).to(dtype)


class LapSumTopK(torch.autograd.Function):
    """p = F((r − b)/α) with Σp = k per row; backward is the closed-form VJP of the module doc.
    apply(scores [T, n], k, alpha) with k and alpha tensors (0-d, [1] or [T])."""

    @staticmethod
    def forward(ctx, scores: Tensor, k: Tensor, alpha: Tensor) -> Tensor:
        t, a_rows, _ = _threshold(scores, k, alpha)
        f = 0.5 * torch.exp(-t.abs())  # finite for any t; F(t) from it on both sides
        p = torch.where(t > 0, 1 - f, f)
        ctx.save_for_backward(t, a_rows, scores)
        ctx.meta = (scores.dtype, k.shape, k.dtype, alpha.shape, alpha.dtype)
        return p.to(scores.dtype)

    @staticmethod
    def backward(ctx, grad_p: Tensor):
        t, a_rows, scores = ctx.saved_tensors
        scores_dtype, k_shape, k_dtype, a_shape, a_dtype = ctx.meta
        v = grad_p.to(t.dtype)
        neg = -t.abs()
        lse = torch.logsumexp(neg, -1, keepdim=True)
        q = torch.exp(neg - lse)  # softmax(−|t|): finite even when every φ underflows
        scale = 0.5 * torch.exp(lse) / a_rows  # Σφ/α
        grad_k_rows = (v * q).sum(-1, keepdim=True)  # ⟨v, q⟩, needed by grad_r too
        grad_r = grad_k = grad_a = None
        if ctx.needs_input_grad[0]:
            grad_r = (scale * q * (v - grad_k_rows)).to(scores_dtype)
        if ctx.needs_input_grad[1]:
            grad_k = _reduce(grad_k_rows.squeeze(-1), k_shape, k_dtype)
        if ctx.needs_input_grad[2]:
            # t − ⟨q, t⟩ = (r − ⟨q, r⟩)/α, formed from r: for huge α the threshold is far from every
            # score (|t| ≈ log(n/2k) while the spread of t is ~(range of r)/α), so differences of t
            # would keep only ε·|t|/spread of their digits. r is first re-centred on the entry
            # nearest the threshold, so that for tiny α (only entries near it have weight) the
            # differences that matter are exact.
            r = scores.to(t.dtype)
            w = r - r.gather(-1, t.abs().argmin(-1, keepdim=True))
            d = (w - (q * w).sum(-1, keepdim=True)) / a_rows
            grad_a_rows = -scale * (q * v * d).sum(-1, keepdim=True)
            grad_a = _reduce(grad_a_rows.squeeze(-1), a_shape, a_dtype)
        return grad_r, grad_k, grad_a


def lapsum_topk(scores: Tensor, k, alpha) -> Tensor:
    """LapSum soft top-k of each row of `scores` [T, n]: p ∈ (0, 1) [T, n] in the scores' dtype
    with Σ_e p_e = k. k ∈ (0, n): a 0-d tensor, a [T] tensor or a number; alpha > 0: a 0-d or [T]
    tensor or a number. Differentiable in scores, k and alpha (any of them may require grad)."""
    # Numbers become tensors of the compute dtype (as_tensor would round 0.1 to fp32 for fp64
    # input), made by a fill on the scores' device: torch.tensor(x, device=...) would be a
    # host-to-device copy, which waits for the device.
    def as_tensor(x):
        return torch.full((), x, dtype=_compute_dtype(scores), device=scores.device)
    k, alpha = (x if torch.is_tensor(x) else as_tensor(x) for x in (k, alpha))
    return LapSumTopK.apply(scores, k, alpha)
