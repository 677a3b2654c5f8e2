"""The router losses' gradient scale, in a form Dynamo traces (model.compile compiles the routers).

megatron-core attaches each router loss to an activation with MoEAuxLossAutoScaler, an autograd
Function whose backward reads the scale from a class attribute (`main_loss_backward_scale`, set by
the trainer per run and copied into in place by the pipeline schedule). Dynamo cannot read an
attribute of an autograd Function class (a graph break per loss: "Unsupported python_type() call"),
so while compiling the loss is attached by `_ScaledAuxLoss` instead, which takes that same scale
tensor as an input. The tensor is captured when the layers are compiled (`capture_scale`); the
trainer sets the run's scale before, and later settings copy into it. Eager code (including
everything when model.compile is off) still calls megatron's Function: the same values either way.
"""
from __future__ import annotations

import importlib

import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler


class _ScaledAuxLoss(torch.autograd.Function):
    """MoEAuxLossAutoScaler's gradients with the scale passed in: the output's gradient through,
    the loss's gradient ones × scale."""

    @staticmethod
    def forward(ctx, output, aux_loss, scale):
        ctx.save_for_backward(aux_loss, scale)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        aux_loss, scale = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss) * scale, None


class TraceableAuxLossScaler:
    """Stands in for MoEAuxLossAutoScaler where routers attach their losses (megatron's router
    module, once `install`ed, and this project's routers)."""

    scale: torch.Tensor | None = None  # megatron's scale tensor, captured by capture_scale

    @classmethod
    def apply(cls, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        if cls.scale is None or not torch.compiler.is_compiling():
            return MoEAuxLossAutoScaler.apply(output, aux_loss)
        return _ScaledAuxLoss.apply(output, aux_loss, cls.scale)


def capture_scale(device) -> torch.Tensor:
    """megatron's scale tensor, made as its backward would make it where no run has set one (1.0),
    for compiled routers to read. A run sets its scale before compiling (train/loop.py)."""
    if MoEAuxLossAutoScaler.main_loss_backward_scale is None:
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=device))
    TraceableAuxLossScaler.scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    return TraceableAuxLossScaler.scale


ROUTER_MODULE = "megatron.core.transformer.moe.router"


def install() -> None:
    """megatron's router module attaches its aux loss and z-loss through TraceableAuxLossScaler
    (the one name it imported; eager calls go on to megatron's own Function)."""
    router = importlib.import_module(ROUTER_MODULE)
    if getattr(router, "MoEAuxLossAutoScaler", None) not in (MoEAuxLossAutoScaler, TraceableAuxLossScaler):
        raise RuntimeError(f"megatron_kappa.model.aux_loss: {ROUTER_MODULE}.MoEAuxLossAutoScaler is gone or "
                           "changed upstream; review the compiled routers for this megatron-core version")
    router.MoEAuxLossAutoScaler = TraceableAuxLossScaler
