"""The gradient reductions megatron-core expects from its caller, written once.

megatron-core's own DDP does these inside `finalize_model_grads`; we train under DeepSpeed (or a
plain loop in tests), so they are named here:

  install_tensor_parallel_grad_hooks
      params tagged `sequence_parallel` (norms, q/k norms, router) hold a partial gradient on
      every TP rank: sum over TP, by a hook installed once after building the model. (always ours)
  reduce_data_parallel_grads
      dense params: average over DP; expert params (incl. κ's α and b): sum over expert-DP,
      divide by DP. DP includes the context-parallel ranks (megatron's group with CP).
      (DeepSpeed's job when it drives training; the parity tests use it)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_kappa.model.params import is_expert


def _all_reduce_flat(grads: list[torch.Tensor], group, scale: float = 1.0):
    """Sum the tensors over `group` in one collective, then scale them, in place."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    if scale != 1.0:
        flat.mul_(scale)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def install_tensor_parallel_grad_hooks(model):
    """Sum over TP, in backward, the gradient of every `sequence_parallel` parameter.

    A tensor hook runs when the gradient is produced, before DeepSpeed's ZeRO-2 reduction hooks
    take it, and per micro-batch (the sum is linear, so accumulation stays right).
    """
    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return

    def hook(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    for p in model.parameters():
        if p.requires_grad and getattr(p, "sequence_parallel", False):
            p.register_hook(hook)


def reduce_data_parallel_grads(model, skip_expert_data_parallel: bool = False):
    """Dense grads averaged over DP; expert grads summed over expert-DP and divided by DP.

    skip_expert_data_parallel exists for the negative control in the parity tests only.
    """
    dense, expert = [], []
    for name, p in model.named_parameters():
        if p.grad is not None:
            (expert if is_expert(name) else dense).append(p.grad)
    dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    _all_reduce_flat(dense, parallel_state.get_data_parallel_group(with_context_parallel=True), scale=1.0 / dp)
    if not skip_expert_data_parallel:
        _all_reduce_flat(expert, parallel_state.get_expert_data_parallel_group(), scale=1.0 / dp)
