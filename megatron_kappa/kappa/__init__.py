"""κ-SwiGLU: SwiGLU whose SiLU sharpness κ is set per token and gate unit by the router logit.

    h = g · σ(κ g) · u,   κ = U ** tanh(gain · (α · (scale · s) + b))

g, u: an expert's gate and up projections [N, F]; s: the raw router logit of each row's expert
[N]; α, b: per gate unit [F] (or [E, F] for rows grouped by expert, see `tokens_per_expert`).
scale = gain = 1 is the paper; the authors' code uses scale 0.15 and gain 2. α = None or
b = None are the paper's ablations (that term ≡ 0).

Backends, one math:
  "torch"   megatron_kappa.kappa.reference: a row-chunked autograd function (the CPU path and
            the tests' oracle);
  "triton"  megatron_kappa.kappa.triton_op: fused forward and backward kernels (the GPU path;
            runs on CPU tensors under TRITON_INTERPRET=1, which is how CI tests it);
  "auto"    Triton for CUDA tensors, torch otherwise.
Inside a graph model.compile compiles, either backend is the same math as plain differentiable
ops (reference.kappa_swiglu_traced), fused by inductor into its own kernels.
On the Triton path a kernel that cannot compile or launch on this machine stops with one line
naming `model.kappa.backend` (set it to "torch" to run without Triton).

Modules:
  inputs.py        What κ sees of the router logit: the `model.kappa.input` variants, each owning
                   its transform and its settings, in one registry (`VARIANTS`; `register` adds one
                   at run time)
  reference.py     The reference κ-SwiGLU op in plain torch: the CPU path of `kappa_swiglu` and the
                   tests' oracle
  triton_guard.py  Fail-safe checks of the κ Triton kernels (megatron_kappa.kappa.triton_op): tile
                   sizes before a launch, and the one-line error for a kernel that cannot compile or
                   launch on this machine
  triton_op.py     Fused Triton kernels for κ-SwiGLU, forward and backward (the "triton" backend of
                   `kappa_swiglu`)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_kappa.kappa import inputs as _inputs

if TYPE_CHECKING:  # torch is imported where the op runs: the config reads KappaSettings without it
    import torch

BACKENDS = ("auto", "torch", "triton")
_PAPER = _inputs.VARIANTS[_inputs.DEFAULT]  # the `logit` variant: the paper's values


@dataclass(frozen=True)
class KappaSettings:
    """The κ-SwiGLU knobs of an expert layer (config: model.kappa.*, which takes its defaults from
    here). The κ-input defaults are the default variant's (megatron_kappa.kappa.inputs)."""

    U: float = _PAPER.U
    use_alpha: bool = True
    use_bias: bool = True
    logit_scale: float = _PAPER.logit_scale
    tanh_gain: float = _PAPER.tanh_gain
    backend: str = "auto"  # one of BACKENDS
    # What κ sees of the router logit (a variant of megatron_kappa.kappa.inputs.VARIANTS) and the
    # scale of the κ path's gradient into the router; applied by the router, in torch.
    input: str = _inputs.DEFAULT
    router_grad_scale: float = _PAPER.router_grad_scale


DEFAULTS = KappaSettings()


def _check(gate, up, logit, alpha, bias, U, tokens_per_expert):
    if gate.shape != up.shape or gate.dim() != 2 or logit.shape != gate.shape[:1]:
        raise ValueError(f"kappa_swiglu: expected gate/up [N, F] and logit [N], got "
                         f"{tuple(gate.shape)}, {tuple(up.shape)}, {tuple(logit.shape)}")
    if not U >= 1.0:  # U = 1 (κ ≡ 1) is where the authors' U ramp starts
        raise ValueError(f"kappa_swiglu: U must be >= 1, got {U}")
    f = gate.shape[1]
    want = (f,) if tokens_per_expert is None else (tokens_per_expert.shape[0], f)
    for name, p in (("alpha", alpha), ("bias", bias)):
        if p is not None and tuple(p.shape) != want:
            raise ValueError(f"kappa_swiglu: expected {name} of shape {list(want)}, got {list(p.shape)}")


def resolve_backend(backend: str, device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"kappa_swiglu: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def kappa_swiglu(gate, up, logit, alpha, bias, U: float = DEFAULTS.U,
                 logit_scale: float = DEFAULTS.logit_scale, tanh_gain: float = DEFAULTS.tanh_gain,
                 backend: str = "auto", tokens_per_expert: torch.Tensor | None = None,
                 probs: torch.Tensor | None = None):
    """κ-SwiGLU of gate/up [N, F] with router logits [N].

    α, b: [F] (one expert), or [E, F] with `tokens_per_expert` [E] giving how many consecutive
    rows belong to each expert (the grouped-experts layout); either may be None (ablations).
    backend: one of BACKENDS (config: model.kappa.backend).
    probs [N] (the torch backend, eager): (h · p).to(gate's dtype), each row scaled by its routing
    probability in the same op, whose backward makes p's gradient from the h it computes anyway.
    """
    import torch

    from megatron_kappa.kappa.reference import kappa_swiglu_torch, kappa_swiglu_traced

    _check(gate, up, logit, alpha, bias, U, tokens_per_expert)
    if probs is not None and (torch.compiler.is_compiling() or resolve_backend(backend, gate.device) != "torch"):
        raise ValueError("kappa_swiglu: probs are scaled in the op on the torch backend, eager, only")
    if torch.compiler.is_compiling():  # model.compile: inductor's fused kernels, whatever the backend
        return kappa_swiglu_traced(gate, up, logit, alpha, bias, U, logit_scale, tanh_gain, tokens_per_expert)
    setting = backend
    backend = resolve_backend(backend, gate.device)
    if backend == "triton":
        try:
            from megatron_kappa.kappa.triton_op import kappa_swiglu_triton
        except ImportError as err:
            raise RuntimeError(f"model.kappa.backend: {setting}: the κ kernels need Triton, which does "
                               f"not import ({err}); set model.kappa.backend=torch") from err
        if tokens_per_expert is not None:  # the kernels read the offsets on the device
            tokens_per_expert = tokens_per_expert.to(gate.device, non_blocking=True)
        return kappa_swiglu_triton(gate, up, logit, alpha, bias, U, logit_scale, tanh_gain,
                                   tokens_per_expert, backend=setting)
    # Grouped rows on the torch path: one pass over all rows, each with its expert's α and b. The
    # counts are read on the host: free for the host counts megatron's dispatchers give, and the
    # Triton path (CUDA) reads them on the device instead.
    counts = None if tokens_per_expert is None else tokens_per_expert.tolist()
    return kappa_swiglu_torch(gate, up, logit, alpha, bias, U, logit_scale, tanh_gain, counts, probs,
                              None if probs is None else gate.dtype)


def kappa_values(logit, alpha, bias, U: float = DEFAULTS.U, logit_scale: float = DEFAULTS.logit_scale,
                 tanh_gain: float = DEFAULTS.tanh_gain):
    """κ [N, F] itself ([N, 1] when both α and b are ablated), for statistics and references."""
    from megatron_kappa.kappa.reference import kappa_values as _kappa_values_torch
    return _kappa_values_torch(logit, alpha, bias, U, logit_scale, tanh_gain)
