"""The router losses' gradient scale, in a form Dynamo traces (model.compile compiles the routers).

megatron-core attaches each router loss to an activation with MoEAuxLossAutoScaler, an autograd
Function whose backward reads the scale from a class attribute (`main_loss_backward_scale`, set by
the trainer per run and copied into in place by the pipeline schedule after each micro-batch's
forward). Dynamo cannot read an attribute of an autograd Function class (a graph break per loss:
"Unsupported python_type() call"), and a scale tensor passed into the graph would be saved for
the backward and then changed in place by the schedule (the backward refuses it). So while
compiling, the loss is attached by `_ScaledAuxLoss`, whose backward calls a custom op that reads
megatron's scale when it runs, as megatron's own backward does. Eager code (everything when
model.compile is off) still calls megatron's Function: the same values either way.
"""
from __future__ import annotations

import functools
import importlib

import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler


@functools.cache
def _register_grad_op() -> None:
    """Registers the custom op `megatron_kappa::aux_loss_grad` once (at install, not at import):
    ones like the loss × megatron's scale as it is at the call (1 where none is set, as megatron's
    backward does). Opaque to the compiler, so it runs in the compiled backward when that runs."""

    @torch.library.custom_op("megatron_kappa::aux_loss_grad", mutates_args=())
    def aux_loss_grad(aux_loss: torch.Tensor) -> torch.Tensor:
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        ones = torch.ones_like(aux_loss)  # the schedule's scale is [1]: its value, in the loss's shape
        return ones if scale is None else ones * scale.reshape(())

    @aux_loss_grad.register_fake
    def _(aux_loss):
        return torch.empty_like(aux_loss)


class _ScaledAuxLoss(torch.autograd.Function):
    """MoEAuxLossAutoScaler's gradients: the output's gradient through, the loss's ones × scale."""

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ops.megatron_kappa.aux_loss_grad(aux_loss)  # registered by install()


class TraceableAuxLossScaler:
    """Stands in for MoEAuxLossAutoScaler where routers attach their losses (megatron's router
    module, once `install`ed, and this project's routers)."""

    @staticmethod
    def apply(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return MoEAuxLossAutoScaler.apply(output, aux_loss)
        return _ScaledAuxLoss.apply(output, aux_loss)


ROUTER_MODULE = "megatron.core.transformer.moe.router"


def install() -> None:
    """megatron's router module attaches its aux loss and z-loss through TraceableAuxLossScaler
    (the one name it imported; eager calls go on to megatron's own Function)."""
    router = importlib.import_module(ROUTER_MODULE)
    if getattr(router, "MoEAuxLossAutoScaler", None) not in (MoEAuxLossAutoScaler, TraceableAuxLossScaler):
        raise RuntimeError(f"megatron_kappa.model.aux_loss: {ROUTER_MODULE}.MoEAuxLossAutoScaler is gone or "
                           "changed upstream; review the compiled routers for this megatron-core version")
    _register_grad_op()
    router.MoEAuxLossAutoScaler = TraceableAuxLossScaler
