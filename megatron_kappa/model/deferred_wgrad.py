"""Grouped expert GEMMs whose weight gradient is computed later, when megatron's overlapped schedule
asks for it (`parallel.delay_wgrad_compute`: megatron-core's `backward_dw`).

megatron's combined 1F1B schedule (pipeline_parallel/combined_1f1b.py) runs, for each layer, one
micro-batch's expert backward, then the next micro-batch's dispatch all-to-all, then
`layer.mlp.backward_dw()`, then the first one's dispatch backward all-to-all: with the weight
gradient deferred, the expert backward before the dispatch is only the input gradient, and on a
GPU the weight-gradient GEMMs run beside both all-to-alls. megatron implements `backward_dw` in
Transformer Engine's linears only (its local linears compute their weight gradients in backward;
their `backward_dw` does nothing); here the grouped experts' two GEMMs do it
(megatron_kappa.model.experts.GroupedExperts).

`DeferredWgradGEMM` computes out = x · Wᵀ per expert group; its backward returns the input
gradient only and queues (x, dy). `WgradQueue.run()` computes each queued dW[e] = dy_eᵀ · x_e (the
same grouped GEMM torch's own backward of grouped_mm runs) and hands it to autograd as the
weight's gradient (`torch.autograd.backward(weight, dW)`), so it accumulates into `.grad` through
the weight's AccumulateGrad node and every hook there (DeepSpeed's fp32 accumulation) runs, as it
would have inside the backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Each expert group's rows of x [N, in] times its weight [E, out, in], transposed."""
    if x.dtype == torch.float64:
        # torch's grouped GEMM takes 16- and 32-bit floats only; float64 (the precision the
        # parity tests compare kernels and layouts in) runs one GEMM per expert instead
        rows = x.tensor_split(offs.tolist())  # one piece per expert, then any rows past the last
        return torch.cat([r @ w.t() for r, w in zip(rows, weight)]
                         + [x.new_zeros(rows[-1].shape[0], weight.shape[1])])
    return F.grouped_mm(x, weight.transpose(1, 2), offs=offs)


def grouped_wgrad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, experts: int) -> torch.Tensor:
    """dW [E, out, in] of `grouped_gemm`: each group's dyᵀ · x (rows past offs[-1] contribute none)."""
    if x.dtype == torch.float64:
        xs, dys = x.tensor_split(offs.tolist()), dy.tensor_split(offs.tolist())
        return torch.stack([d.t() @ r for d, r in zip(dys[:experts], xs[:experts])])
    return F.grouped_mm(dy.t(), x, offs=offs)


class WgradQueue:
    """The weight gradients a module's backward left for `run()` (megatron's backward_dw)."""

    def __init__(self):
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def run(self):
        """Compute every queued weight gradient, in the order the backward queued them, and
        accumulate each into its weight through autograd."""
        pending, self.pending = self.pending, []
        for weight, x, dy, offs in pending:
            dw = grouped_wgrad(x, dy, offs, weight.shape[0])
            torch.autograd.backward(weight, dw.to(weight.dtype))


class DeferredWgradGEMM(torch.autograd.Function):
    """`grouped_gemm(x, weight, offs)` whose backward gives x its gradient now and queues the
    weight's on `queue`. Call it through `deferred_gemm`: the weight enters detached, so this
    backward does not touch the weight's AccumulateGrad node at all (its hooks would run there with
    no gradient); `WgradQueue.run` does, once, with the gradient."""

    @staticmethod
    def forward(ctx, x, weight_data, offs, queue: WgradQueue, owner: tuple):
        ctx.save_for_backward(x, weight_data, offs)
        ctx.queue, ctx.owner = queue, owner
        return grouped_gemm(x, weight_data, offs)

    @staticmethod
    def backward(ctx, dy):
        x, weight, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = grouped_gemm(dy, weight.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
        ctx.queue.pending.append((ctx.owner[0], x, dy, offs))
        return dx, None, None, None, None


def deferred_gemm(x: torch.Tensor, weight: torch.nn.Parameter, offs: torch.Tensor, queue: WgradQueue):
    """grouped_gemm(x, weight, offs) with weight's gradient left on `queue` by the backward."""
    return DeferredWgradGEMM.apply(x, weight.detach(), offs, queue, (weight,))
