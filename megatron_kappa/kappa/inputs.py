"""What κ sees of the router logit: the three `model.kappa.input` variants and their settings.

  logit       the paper's text: κ = U^tanh(α·s + b) on the raw router logit s, U = 3, constant.
  scaled      the authors' code at the paper's date (askerlee/kappa-swiglu 14c9b04): s × 0.15 and
              a gain of 2 inside tanh (the op's logit_scale / tanh_gain), U = 3.
  normalized  the authors' latest code (02b8de3, nanochat/gpt.py MOELayer._select_gate_confidence
              with --kappa-input-logit-norm-exponent 0.5): s' = 6 · s / n_e with the per-expert
              normaliser n_e = √H · m̃_e^0.5 · mean_e'(m̃_e'^0.5), m̃_e = √(‖r_e‖² + 1e-4), all of it
              detached (no gradient reaches the router weight through n_e); U = 4.
Both authors' variants also ramp U from 1 over 15 % of the iterations after the κ freeze, and scale
the κ path's gradient into the router logit by 0.1 (`scale_grad`: forward value unchanged; the
routing probabilities keep their full gradient). docs/recipe.md has the sources, line by line.

The transform runs in torch on the router's [tokens, experts] logits, before dispatch, so every
backend of the op (and every dispatcher) gets it unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

INPUTS = ("logit", "scaled", "normalized")

# The normalised variant's constants, as in the authors' code at 02b8de3: the gain 6 ("cosine
# ~0.15 → ~1"), --kappa-input-logit-norm-exponent 0.5 and top_logit_norm_eps 1e-4.
NORM_GAIN = 6.0
NORM_EXPONENT = 0.5
NORM_EPS = 1e-4


@dataclass(frozen=True)
class Variant:
    """The κ settings a `model.kappa.input` variant brings (null config keys take these)."""
    U: float
    logit_scale: float
    tanh_gain: float
    router_grad_scale: float
    u_warmup: float  # fraction of the iterations over which U ramps from 1, after the κ freeze


VARIANTS = {
    "logit": Variant(U=3.0, logit_scale=1.0, tanh_gain=1.0, router_grad_scale=1.0, u_warmup=0.0),
    "scaled": Variant(U=3.0, logit_scale=0.15, tanh_gain=2.0, router_grad_scale=0.1, u_warmup=0.15),
    "normalized": Variant(U=4.0, logit_scale=1.0, tanh_gain=1.0, router_grad_scale=0.1, u_warmup=0.15),
}


def resolve(k) -> Variant:
    """The settings in effect for a `model.kappa` config section: its input variant's values,
    replaced by any key the config sets (null = the variant's). logit_scale / tanh_gain are the
    variant's own for scaled and normalized (the config checks refuse other values there)."""
    v = VARIANTS[k.input]
    pick = lambda mine, default: default if mine is None else float(mine)  # noqa: E731
    own = k.input == "logit"
    return Variant(U=pick(k.U, v.U),
                   logit_scale=float(k.logit_scale) if own else v.logit_scale,
                   tanh_gain=float(k.tanh_gain) if own else v.tanh_gain,
                   router_grad_scale=pick(k.router_grad_scale, v.router_grad_scale),
                   u_warmup=pick(k.u_warmup, v.u_warmup))


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x in the forward; its gradient times `scale` in the backward (the authors' scale_grad)."""
    if scale == 1.0:
        return x
    return x.detach() + scale * (x - x.detach())  # (x − x) is exactly 0: the value is x bit for bit


def normalized_logit(logits: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """6 · s / n_e for logits [..., E] of router weight [E, H] (the normaliser detached)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32 as the authors', fp64 in tests
    m = torch.linalg.vector_norm(router_weight.detach(), ord=2, dim=-1, dtype=dtype)
    m = torch.sqrt(m.square() + NORM_EPS)
    compensation = m.pow(1.0 - NORM_EXPONENT).mean()
    normaliser = math.sqrt(router_weight.shape[-1]) * m.pow(NORM_EXPONENT) * compensation
    return NORM_GAIN * logits / normaliser.to(logits.dtype)


def kappa_input(logits: torch.Tensor, router_weight: torch.Tensor, input: str,
                router_grad_scale: float) -> torch.Tensor:
    """What the experts' κ gets for router logits [..., E]: the variant's transform, then the κ
    path's gradient scale. ("scaled" multiplies inside the op, by logit_scale and tanh_gain.)"""
    if input not in INPUTS:
        raise ValueError(f"model.kappa.input: expected one of {INPUTS}, got {input!r}")
    if input == "normalized":
        logits = normalized_logit(logits, router_weight)
    return scale_grad(logits, router_grad_scale)
