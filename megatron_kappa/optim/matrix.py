"""The orthogonalised matrix update of Muon and of the κ-SwiGLU authors' "Aurora" (the math only;
megatron_kappa.optim.muon runs it inside DeepSpeed's ZeRO).

Both run SGD momentum in the Nesterov (EMA) form of KellerJordan/Muon and of the authors'
nanochat/optim.py (askerlee/kappa-swiglu @ 02b8de3), per matrix G = ∂L/∂W with buffer M:

    M ← β·M + (1-β)·G                     (M.lerp_(G, 1-β))
    V ← (1-β)·G + β·M   (Nesterov)        (G.lerp(M, β));  V ← M without Nesterov
    W ← W·(1 - lr·wd) - lr · s(shape) · P(V)          (decoupled weight decay; DeepSpeed applies it)

P is a polar-factor approximation (the "U Vᵀ" of V = U Σ Vᵀ), computed on the smaller Gram side:

  Muon:   Newton–Schulz quintic X ← aX + (bA + cA²)X, A = XXᵀ, X₀ = V/(‖V‖_F + 1e-7), transposed
          so that rows ≤ cols, (a, b, c) = (3.4445, -4.7750, 2.0315), 5 steps (KellerJordan/Muon;
          DeepSpeed 0.19.8 `zeropower_via_newtonschulz5`). Not convergent: σ(P) ∈ ≈[0.7, 1.2].
  Aurora: square V: the same iteration with the authors' convergent "simple quintic"
          (a, b, c) = (2, -1.5, 0.5) (p(1)=1, p'(1)=0). Rectangular V: transpose to tall
          (m > n, rows = the LONG side), then row-equilibrate:
              D₀ = diag(1/‖v_i‖)                          (row norms of V, clamped at 1e-7)
              repeat `rounds` (=2) times: U = NS(D·V)
                  between rounds: D ← D · ((n/m) / ‖u_i‖²)^exponent   (exponent 0.5)
          and return U (transposed back). n/m is the squared row norm every row of a tall
          semi-orthogonal matrix has on average (‖U‖²_F = n), so the correction pushes the
          long-side vectors of the update toward equal norms ("uniform row norms").
          The authors train with 5 Newton–Schulz steps (gpt.py setup_optimizer; 12 before 53b2589).

s(shape) (aspect scale) of an [m, n] matrix (rows, cols as stored):
  "original"        sqrt(max(1, m/n))         KellerJordan/Muon, DeepSpeed, an authors' option
  "match_rms_adamw" 0.2·sqrt(max(m, n)), capped at 1.0 unless another cap is given: the authors'
                    DEFAULT (--muon-match-rms-adamw true): 1.0 for every max(m, n) ≥ 25
  "none"            1
Defaults here: muon → "original" (as DeepSpeed's Muon); aurora → "match_rms_adamw", cap 1.0
(as the authors ran it, with lr 0.01 tuned for it).

Which matrices: leading dimensions are a batch (a stacked expert weight [E, m, n] is E matrices),
and a `RowBlocks(groups, sizes)` says that a parameter's rows are `groups` repetitions of blocks
of `sizes` rows and block k of every group together forms one matrix. That way a fused weight is
orthogonalised as the separate matrices the authors' model has: megatron's SwiGLU fc1 [gate; up]
is RowBlocks(1, (F, F)); megatron's interleaved QKV is RowBlocks(query_groups, (q·hd, hd, hd)).

Not reproduced: the authors' *Muon* (Polar Express coefficients, NorMuon variance reduction,
cautious weight decay); "muon" here is the reference Muon that DeepSpeed also implements.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KELLER_COEFFS = (3.4445, -4.7750, 2.0315)  # KellerJordan/Muon zeropower_via_newtonschulz5
AURORA_COEFFS = (2.0, -1.5, 0.5)  # authors' _polar_factor_simple_quintic
METHODS = ("muon", "aurora")
SCALE_MODES = ("original", "match_rms_adamw", "none")
DEFAULT_SCALE = {"muon": "original", "aurora": "match_rms_adamw"}


def newton_schulz(G: torch.Tensor, steps: int = 5, coeffs=KELLER_COEFFS, eps: float = 1e-7,
                  compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximate polar factor of each [m, n] matrix in G [..., m, n]; returns G's dtype.

    Cast first, then normalise by the Frobenius norm (so σ_max ≤ 1), as the reference does in bf16.
    The iteration multiplies by the Gram matrix of the short side, hence the transpose for m > n.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs [..., m, n], got {tuple(G.shape)}")
    a, b, c = coeffs
    X = G.to(compute_dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


def aurora_polar(G: torch.Tensor, ns_steps: int = 5, rounds: int = 2, exponent: float = 0.5,
                 eps: float = 1e-7, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The authors' row-equilibrated polar factor (aurora_grad_update_fused), batched over [...]."""
    if rounds < 1:
        raise ValueError("rounds must be ≥ 1")
    m, n = G.size(-2), G.size(-1)
    if m == n:  # square: plain Newton–Schulz in the update's dtype, as the authors do
        return newton_schulz(G, ns_steps, AURORA_COEFFS, eps, compute_dtype)
    wide = m < n
    hi = torch.promote_types(G.dtype, torch.float32)  # D math in fp32 (fp64 if given fp64)
    V = (G.mT if wide else G).to(hi)  # tall: rows are the long side
    rows, cols = V.size(-2), V.size(-1)
    target_row_sq = cols / rows  # mean squared row norm of a tall semi-orthogonal matrix
    D = V.norm(dim=-1, keepdim=True).clamp(min=eps).reciprocal()
    for it in range(rounds):
        U = newton_schulz(D * V, ns_steps, AURORA_COEFFS, eps, compute_dtype).to(hi)
        if it < rounds - 1:
            row_sq = U.square().sum(dim=-1, keepdim=True).clamp(min=eps * eps)
            D = D * (target_row_sq / row_sq).pow(exponent)
    return (U.mT if wide else U).to(G.dtype)


def aspect_scale(m: int, n: int, mode: str = "original", max_scale: float | None = None) -> float:
    """s(shape) of an [m, n] matrix; `max_scale` None means the mode's own cap (1.0 for
    match_rms_adamw, as the authors' _resolve_matrix_adjust_lr; none otherwise)."""
    if mode == "original":
        scale = math.sqrt(max(1.0, m / n))
    elif mode == "match_rms_adamw":
        scale = 0.2 * math.sqrt(max(m, n))
        max_scale = 1.0 if max_scale is None else max_scale
    elif mode == "none":
        scale = 1.0
    else:
        raise ValueError(f"unknown scale mode {mode!r}; one of {SCALE_MODES}")
    return min(scale, max_scale) if max_scale is not None else scale


@dataclass(frozen=True)
class RowBlocks:
    """Rows = `groups` × (blocks of `sizes` rows); block k of every group is one matrix."""
    groups: int
    sizes: tuple

    def apply(self, X: torch.Tensor, orth) -> torch.Tensor:
        """`orth` ([..., m, n] → same shape, per matrix) on each block matrix of X [..., rows, n]."""
        *lead, m, n = X.shape
        if m != self.groups * sum(self.sizes):
            raise ValueError(f"{self} does not fit {m} rows")
        blocks = X.reshape(*lead, self.groups, sum(self.sizes), n).split(list(self.sizes), dim=-2)
        out = [orth(b.reshape(*lead, self.groups * s, n)).reshape(*lead, self.groups, s, n)
               for b, s in zip(blocks, self.sizes)]
        return torch.cat(out, dim=-2).reshape(X.shape)


def as_blocks(spec):
    """None (the whole matrix), an int k (k equal row blocks: DeepSpeed's `muon_num_heads`
    meaning), or anything with `.apply(X, orth)` (e.g. RowBlocks)."""
    if spec is None or hasattr(spec, "apply"):
        return spec
    if isinstance(spec, int) and not isinstance(spec, bool) and spec >= 1:
        return None if spec == 1 else _EqualRows(spec)
    raise TypeError(f"not a matrix-block spec: {spec!r}")


@dataclass(frozen=True)
class _EqualRows:
    count: int

    def apply(self, X, orth):
        m = X.size(-2)
        if m % self.count:
            raise ValueError(f"{m} rows do not split into {self.count} equal blocks")
        return RowBlocks(1, (m // self.count,) * self.count).apply(X, orth)


def orthogonalize(V: torch.Tensor, method: str = "muon", ns_steps: int = 5,
                  scale_mode: str | None = None, max_scale: float | None = None,
                  rounds: int = 2, exponent: float = 0.5, blocks=None,
                  compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """s(shape)·P(V) for every matrix in V (after `blocks`, see as_blocks): the step direction."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; one of {METHODS}")
    mode = scale_mode or DEFAULT_SCALE[method]

    def orth(X):
        if method == "muon":
            P = newton_schulz(X, ns_steps, KELLER_COEFFS, compute_dtype=compute_dtype)
        else:
            P = aurora_polar(X, ns_steps, rounds, exponent, compute_dtype=compute_dtype)
        return P * aspect_scale(X.size(-2), X.size(-1), mode, max_scale)

    spec = as_blocks(blocks)
    return orth(V) if spec is None else spec.apply(V, orth)


def nesterov_momentum(grad: torch.Tensor, buf: torch.Tensor, beta: float,
                      nesterov: bool = True) -> torch.Tensor:
    """Update `buf` in place (EMA form) and return the matrix to orthogonalise; grad untouched."""
    buf.lerp_(grad.to(buf.dtype), 1 - beta)
    return grad.to(buf.dtype).lerp(buf, beta) if nesterov else buf.clone()


def matrix_update(grad: torch.Tensor, buf: torch.Tensor, beta: float = 0.95, nesterov: bool = True,
                  **orthogonalize_kw) -> torch.Tensor:
    """One step's direction (momentum, then orthogonalize); `buf` is updated in place."""
    return orthogonalize(nesterov_momentum(grad, buf, beta, nesterov), **orthogonalize_kw)
