"""κ-SwiGLU: SwiGLU whose SiLU sharpness κ is set per token and gate unit by the router logit.

    h = g · σ(κ g) · u,   κ = U ** tanh(gain · (α · (scale · s) + b))

g, u: the expert's gate and up projections [N, F]; s: the raw router logit of each row's
expert [N]; α, b: per gate unit [F]. scale = gain = 1 is the paper; the authors' code uses
scale 0.15 and gain 2. α = None or b = None are the paper's ablations (that term ≡ 0).

The backward is explicit so that autograd saves only g, u and s (plain SwiGLU saves g, silu(g)
and u): κ and σ(κg) are recomputed from them instead of being stored as [N, F] tensors.
"""
from __future__ import annotations

import math

import torch


def _kappa(logit, alpha, bias, log_u, scale, gain):
    """tanh argument t and κ, as [N, F] (or [N, 1] when only the logit varies)."""
    z = None
    if alpha is not None:
        z = (logit * scale).unsqueeze(-1) * alpha
    if bias is not None:
        z = bias.expand(logit.shape[0], -1) if z is None else z + bias
    if z is None:  # both ablated: κ ≡ 1
        z = logit.new_zeros(logit.shape[0], 1)
    t = torch.tanh(z * gain) if gain != 1.0 else torch.tanh(z)
    return t, torch.exp(t * log_u)


class KappaSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, logit, alpha, bias, U, scale, gain):
        compute = torch.promote_types(gate.dtype, torch.float32)
        g, u = gate.to(compute), up.to(compute)
        s = logit.to(compute)
        a = None if alpha is None else alpha.to(compute)
        b = None if bias is None else bias.to(compute)
        _, kappa = _kappa(s, a, b, math.log(U), scale, gain)
        # g·σ(κg) written as silu(κg)/κ: at κ = 1 this is bit-for-bit torch's silu(g).
        out = torch.nn.functional.silu(kappa * g).div_(kappa).mul_(u)
        ctx.save_for_backward(gate, up, logit, alpha, bias)
        ctx.consts = (U, scale, gain)
        return out.to(gate.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, logit, alpha, bias = ctx.saved_tensors
        U, scale, gain = ctx.consts
        log_u = math.log(U)
        compute = torch.promote_types(gate.dtype, torch.float32)
        g, u, s = gate.to(compute), up.to(compute), logit.to(compute)
        a = None if alpha is None else alpha.to(compute)
        b = None if bias is None else bias.to(compute)
        dh = grad_out.to(compute)

        t, kappa = _kappa(s, a, b, log_u, scale, gain)
        kg = kappa * g
        sig = torch.sigmoid(kg)
        d_up = torch.nn.functional.silu(kg).div_(kappa).mul_(dh)  # as in forward: exact at κ = 1
        del kg
        # d(g σ(κg))/dg = σ + κ g σ (1-σ);  d(g σ(κg))/dκ = g² σ (1-σ)
        dsig = sig * (1.0 - sig)
        du_h = dh * u
        d_gate = du_h * (sig + kappa * g * dsig)
        need_z = any(ctx.needs_input_grad[2:5])
        d_logit = d_alpha = d_bias = None
        if need_z and (a is not None or b is not None):
            # dκ/dz = κ · ln U · (1 - t²) · gain, with z = α · scale · s + b
            dz = du_h * g * g * dsig * kappa * (1.0 - t * t) * (log_u * gain)
            if a is not None:
                if ctx.needs_input_grad[2]:
                    d_logit = (dz @ a) * scale
                if ctx.needs_input_grad[3]:
                    d_alpha = (s * scale) @ dz
            if b is not None and ctx.needs_input_grad[4]:
                d_bias = dz.sum(0)
        if ctx.needs_input_grad[2] and d_logit is None:
            d_logit = torch.zeros_like(s)
        cast = lambda x, ref: None if x is None or ref is None else x.to(ref.dtype)
        return (cast(d_gate, gate), cast(d_up, up), cast(d_logit, logit), cast(d_alpha, alpha),
                cast(d_bias, bias), None, None, None)


def kappa_swiglu(gate, up, logit, alpha, bias, U: float = 3.0, logit_scale: float = 1.0,
                 tanh_gain: float = 1.0):
    """κ-SwiGLU of gate/up [N, F] with router logits [N] and per-unit α, b [F] (either may be None)."""
    if gate.shape != up.shape or gate.dim() != 2 or logit.shape != gate.shape[:1]:
        raise ValueError(f"kappa_swiglu: expected gate/up [N, F] and logit [N], got "
                         f"{tuple(gate.shape)}, {tuple(up.shape)}, {tuple(logit.shape)}")
    if not U > 1.0:
        raise ValueError(f"kappa_swiglu: U must be > 1, got {U}")
    return KappaSwiGLU.apply(gate, up, logit, alpha, bias, float(U), float(logit_scale),
                             float(tanh_gain))


def kappa_values(logit, alpha, bias, U: float = 3.0, logit_scale: float = 1.0, tanh_gain: float = 1.0):
    """κ [N, F] itself (no autograd trick), for statistics and references."""
    return _kappa(logit, alpha, bias, math.log(U), logit_scale, tanh_gain)[1]
