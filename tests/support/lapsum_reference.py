"""LapSum's soft top-k written out as explicit formulas in float64 (tests/test_lapsum.py,
tests/test_softmoe.py)."""
import torch

f64 = torch.float64


def laplace_cdf(t):
    """Unit Laplace CDF; each `where` branch is clamped to its own side so neither overflows and
    autograd through the branch not taken stays finite (0, not inf·0)."""
    return torch.where(t > 0, 1 - 0.5 * torch.exp(-t.clamp_min(0)), 0.5 * torch.exp(t.clamp_max(0)))


def ref_threshold(r, k, a, iters=400):
    """b [T] with Σ F((r − b)/a) = k by bisection in float64 (r [T, n], k [T], a [T, 1])."""
    r, k, a = r.detach().to(f64), k.detach().to(f64), a.detach().to(f64)
    n = r.shape[1]
    # Outside these brackets Σ F < k (hi) or Σ F > k (lo) for sure (bound each term by its extreme).
    lo = r.min(-1).values - a[:, 0] * ((n / (2 * (n - k))).log().abs() + 1)
    hi = r.max(-1).values + a[:, 0] * ((n / (2 * k)).log().abs() + 1)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        above = laplace_cdf((r - mid[:, None]) / a).sum(-1) > k  # sum too big: b is higher
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    return 0.5 * (lo + hi)


def reference(r, k, a):
    """p by the explicit formula in float64, differentiable in r, k, a (k, a: 0-d or per row).
    b = b₀ − (G(b₀) − k)/G'(b₀) with b₀ the detached bisection root: the value is b₀ (G(b₀) = k to
    rounding) and its derivative is −(∂G/∂θ − ∂k/∂θ)/G', the implicit-function derivative."""
    rows = r.shape[0]
    k = k.expand(rows) if k.dim() == 0 else k
    a = (a.expand(rows) if a.dim() == 0 else a)[:, None]
    b0 = ref_threshold(r, k, a)[:, None]
    t0 = (r - b0) / a
    G = laplace_cdf(t0).sum(-1, keepdim=True)
    dG = -0.5 * torch.exp(-t0.abs()).sum(-1, keepdim=True) / a
    b = b0 - (G - k[:, None]) / dG
    return laplace_cdf((r - b) / a)
