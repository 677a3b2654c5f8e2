"""What κ sees of the router logit: the `model.kappa.input` variants, each owning its transform
and its settings, in one registry (`VARIANTS`; `register` adds one at run time).

  logit       the paper's text: κ = U^tanh(α·s + b) on the raw router logit s, U = 3, constant.
  scaled      the authors' code at the paper's date (askerlee/kappa-swiglu 14c9b04): s × 0.15 and
              a gain of 2 inside tanh (the op's logit_scale / tanh_gain), U = 3.
  normalized  the authors' latest code (02b8de3, nanochat/gpt.py MOELayer._select_gate_confidence
              with --kappa-input-logit-norm-exponent 0.5): s' = 6 · s / n_e with the per-expert
              normaliser n_e = √H · m̃_e^0.5 · mean_e'(m̃_e'^0.5), m̃_e = √(‖r_e‖² + 1e-4), all of it
              detached (no gradient reaches the router weight through n_e); U = 4.
Both authors' variants also ramp U from 1 over 15 % of the iterations after the κ freeze, and scale
the κ path's gradient into the router logit by 0.1 (`scale_grad`: forward value unchanged; the
routing probabilities keep their full gradient). normalized also brings 02b8de3's κ learning
rates (0.3 → 0.15: --kappa-bias-lr-scale 1.0 / final 0.5 × the embedding rate 0.3) and λ_α 1e-2
(--kappa-scale-l2-loss-weight-scale 1); logit and scaled keep the paper's and 14c9b04's (0.12 →
0.06, λ_α 2e-2). docs/recipe.md has the sources, line by line.

Everything that depends on the variant reads it from here: the router (`kappa_input`), the
analysis metrics (`Variant.transform`), the config (the allowed values, checked when a config is
validated, and the help texts of docs/config.md), the settings (`resolve`: U, its ramp, the
gradient scale, logit_scale / tanh_gain, κ's learning rates and λ_α), `KappaSettings`'
defaults (the `logit` entry) and the export (`hf_input`, `hf_code`, `hf_doc`, `card`: the exported
modeling file's code for it and the model card's words). The registry is megatron_kappa.registry's,
the one every kind uses.

The transform runs in torch on the router's [tokens, experts] logits, before dispatch, so every
backend of the op (and every dispatcher) gets it unchanged. torch is imported only where a
transform runs: the config reads this registry without it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from megatron_kappa.registry import Registry

if TYPE_CHECKING:
    import torch

# The normalised variant's constants, as in the authors' code at 02b8de3: the gain 6 ("cosine
# ~0.15 → ~1"), --kappa-input-logit-norm-exponent 0.5 and top_logit_norm_eps 1e-4.
NORM_GAIN = 6.0
NORM_EXPONENT = 0.5
NORM_EPS = 1e-4


def identity(logits: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """κ sees the raw logit (for `scaled` the op multiplies it, by logit_scale and tanh_gain)."""
    return logits


def normalized_logit(logits: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """6 · s / n_e for logits [..., E] of router weight [E, H] (the normaliser detached)."""
    import torch

    dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32 as the authors', fp64 in tests
    m = torch.linalg.vector_norm(router_weight.detach(), ord=2, dim=-1, dtype=dtype)
    m = torch.sqrt(m.square() + NORM_EPS)
    compensation = m.pow(1.0 - NORM_EXPONENT).mean()
    normaliser = math.sqrt(router_weight.shape[-1]) * m.pow(NORM_EXPONENT) * compensation
    return NORM_GAIN * logits / normaliser.to(logits.dtype)


@dataclass(frozen=True)
class Variant:
    """A `model.kappa.input` variant: what κ sees of the router logits, and the κ settings it
    brings (null config keys take these)."""
    # (router logits [..., E], router weight [E, H]) → what κ sees, [..., E]; differentiable in
    # the logits (the router's gradient flows through it, times router_grad_scale)
    transform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    U: float
    logit_scale: float
    tanh_gain: float
    router_grad_scale: float
    u_warmup: float  # fraction of the iterations over which U ramps from 1, after the κ freeze
    # κ's learning rate (peak, end) and the L2 weight of α that the variant's code trained with
    # (model.kappa.lr, lr_end, l2_alpha when null): the paper's and 14c9b04's, or 02b8de3's
    lr: float = 0.12
    lr_end: float = 0.06
    l2_alpha: float = 2e-2
    # True: model.kappa.logit_scale / tanh_gain are free and in effect (logit_scale / tanh_gain
    # here must then be the config's defaults); False: this variant's values are in effect and
    # the config keys must stay at their defaults (config/checks.py refuses others)
    config_scales: bool = False
    help: str = ""  # one line for docs/config.md: "where it is from: what κ sees"
    # The export (megatron_kappa.export: modeling_kappa_moe.py, written from these, and the model
    # card). hf_input: the modeling file's name for what κ sees, its config's kappa["input"]; None:
    # no exported model computes this variant and the export refuses it. hf_code: the modeling
    # file's torch code for it, the body of its kappa_logit(logits [T, E], router_weight [E, H])
    # that returns what κ sees (None: the raw logit, which the file's scales then multiply);
    # hf_doc: that function's docstring words for it. card: the model card's "where s is ...".
    # dataclasses.replace copies them: a variant that transforms otherwise sets hf_input to None
    hf_input: Optional[str] = None
    hf_code: Optional[str] = None
    hf_doc: str = ""
    card: str = ""


DEFAULT = "logit"  # the paper's text; KappaSettings' and the config's defaults are this entry's


def _same_default_scales(name: str, variant: Variant, variants: Registry):
    """A variant with config_scales takes logit_scale / tanh_gain from the config: its own must be
    the config's defaults (the default variant's)."""
    default = variants.get(DEFAULT)
    if variant.config_scales and default is not None and \
            (variant.logit_scale, variant.tanh_gain) != (default.logit_scale, default.tanh_gain):
        raise ValueError(f"model.kappa.input: {name}: with config_scales, logit_scale and tanh_gain are the "
                         f"config's, whose defaults are {default.logit_scale} and {default.tanh_gain}")


VARIANTS: Registry[Variant] = Registry("model.kappa.input", Variant, noun="variant", needs=("transform",),
                                       default=DEFAULT, check=_same_default_scales)
register, lookup = VARIANTS.register, VARIANTS.lookup  # the registry's verbs (a run-time variant calls register)

RAW_CARD = "s is the router logit of the token for that expert (the logit, not the probability)"
# the authors' normaliser as modeling_kappa_moe.py computes it (fp32; normalized_logit above is its twin)
NORMALIZED_CODE = """m = torch.sqrt(router_weight.float().norm(dim=-1).square() + 1e-4)
normaliser = math.sqrt(router_weight.shape[-1]) * m.sqrt() * m.sqrt().mean()
return 6.0 * logits / normaliser
"""

register("logit", Variant(identity, U=3.0, logit_scale=1.0, tanh_gain=1.0, router_grad_scale=1.0,
                          u_warmup=0.0, config_scales=True, help="the paper: s", hf_input="logit", card=RAW_CARD))
register("scaled", Variant(identity, U=3.0, logit_scale=0.15, tanh_gain=2.0, router_grad_scale=0.1,
                           u_warmup=0.15, help="the authors' code at the paper's date: 0.15·s, tanh gain 2",
                           hf_input="logit", card=RAW_CARD))
register("normalized", Variant(normalized_logit, U=4.0, logit_scale=1.0, tanh_gain=1.0, router_grad_scale=0.1,
                               u_warmup=0.15, lr=0.3, lr_end=0.15, l2_alpha=1e-2,
                               help="the authors' latest code: 6·s / a detached per-expert norm of the router "
                                    "weight",
                               hf_input="normalized", hf_code=NORMALIZED_CODE,
                               hf_doc="6·s / n_e with n_e = √H · m_e^½ · mean_e'(m_e'^½), m_e = √(‖r_e‖² + 1e-4)",
                               card="s is 6 · (router logit) / n_e, with n_e a detached per-expert norm of the "
                                    "router weight (the authors' latest code)"))


def resolve(k) -> Variant:
    """The settings in effect for a `model.kappa` config section: its input variant's values,
    replaced by any key the config sets (null = the variant's). logit_scale / tanh_gain are the
    config's for a variant with config_scales (logit), the variant's own otherwise (the config
    checks refuse other values there)."""
    v = lookup(k.input)
    def pick(mine, default):
        return default if mine is None else float(mine)
    return dataclasses.replace(
        v, U=pick(k.U, v.U),
        logit_scale=float(k.logit_scale) if v.config_scales else v.logit_scale,
        tanh_gain=float(k.tanh_gain) if v.config_scales else v.tanh_gain,
        router_grad_scale=pick(k.router_grad_scale, v.router_grad_scale),
        u_warmup=pick(k.u_warmup, v.u_warmup), lr=pick(k.lr, v.lr), lr_end=pick(k.lr_end, v.lr_end),
        l2_alpha=pick(k.l2_alpha, v.l2_alpha))


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x in the forward; its gradient times `scale` in the backward (the authors' scale_grad)."""
    if scale == 1.0:
        return x
    return x.detach() + scale * (x - x.detach())  # (x − x) is exactly 0: the value is x bit for bit


def kappa_input(logits: torch.Tensor, router_weight: torch.Tensor, input: str,
                router_grad_scale: float) -> torch.Tensor:
    """What the experts' κ gets for router logits [..., E]: the variant's transform, then the κ
    path's gradient scale."""
    return scale_grad(lookup(input).transform(logits, router_weight), router_grad_scale)


# --- the config's view: docs/config.md's help texts, from the registry -------------------------

def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _value(x: float, notes: dict) -> str:
    return f"{x:g}" + (f", {notes[x]}" if x in notes else "")


def input_help() -> str:
    """model.kappa.input's help: every variant with its one line."""
    listed = ", ".join(f"{name} ({v.help})" if v.help else name for name, v in VARIANTS.items())
    return (f"what κ sees of the router logit s: {listed}; each variant brings its own U, "
            "router_grad_scale and u_warmup (null keys; docs/recipe.md)")


def null_help(key: str, notes: dict | None = None) -> str:
    """"null: <the default variant's value>; <other value> for input(s) <the variants that differ>"
    for a key a null config value takes from the variant (U, router_grad_scale, u_warmup)."""
    notes = notes or {}
    base = getattr(VARIANTS[DEFAULT], key)
    others: dict[float, list[str]] = {}
    for name, v in VARIANTS.items():
        if getattr(v, key) != base:
            others.setdefault(getattr(v, key), []).append(name)
    parts = [f"null: {_value(base, notes)}"] + [
        f"{_value(value, notes)} for input{'s' if len(names) > 1 else ''} {_names(names)}"
        for value, names in others.items()]
    return "; ".join(parts)


def scale_help(key: str) -> str:
    """Which inputs take logit_scale / tanh_gain from the config, and what the others set."""
    base = getattr(VARIANTS[DEFAULT], key)
    free = [name for name, v in VARIANTS.items() if v.config_scales]
    fixed = [f"{name} sets {getattr(v, key):g} itself" for name, v in VARIANTS.items()
             if not v.config_scales and getattr(v, key) != base]
    return (f"input {_names(free)} only" + (f": {', '.join(fixed)}" if fixed else "")
            + f"; the other inputs refuse any value but {base:g}")
