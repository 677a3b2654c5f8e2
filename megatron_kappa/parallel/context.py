"""Context parallelism's data side (`parallel.cp`): each rank's chunks of a batch, and the loss
reduced over the context-parallel group.

The ranks of a context-parallel group read the same samples (the data-parallel rank excludes CP,
as megatron's) and each keeps its two chunks of every sequence, megatron's load-balanced causal
layout (megatron.core.utils.get_batch_on_this_cp_rank: chunks r and 2·CP−1−r of 2·CP). RoPE
follows the same layout inside megatron's GPTModel (get_pos_emb_on_this_cp_rank), the attention in
megatron_kappa.model.cp_attention; everything else (the embedding, x0, the value embeddings,
the MLPs and experts, the loss per token) works token by token and needs nothing more.

The loss: each rank's share is its tokens' masked loss sum over the unmasked token count of the
whole sequences (the count summed over CP), so the shares add up to the one-process mean exactly,
also when the mask leaves the ranks different counts. Gradients are averaged over the data-
parallel group *with* CP (megatron's get_data_parallel_group(with_context_parallel=True), DeepSpeed's
group: megatron_kappa.parallel.engine), so the share is multiplied by CP for the backward, as
megatron's pipeline schedule does (`output_tensor *= cp_group_size`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.utils import get_batch_on_this_cp_rank


def size() -> int:
    """The context-parallel size (1 without context parallelism)."""
    return ps.get_context_parallel_world_size()


def split_batch(batch: dict) -> dict:
    """This rank's chunks of every [b, s] tensor of `batch` (a new dict; unchanged at CP 1)."""
    if size() == 1:
        return batch
    return get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=ps.get_context_parallel_group())


def loss_share(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """This rank's share of the micro-batch's mean loss over the unmasked tokens: its masked sum
    over the count of the whole sequences (a device scalar; at CP 1 the mean itself)."""
    count = mask.sum()
    if size() > 1:
        count = count.detach().clone()
        dist.all_reduce(count, group=ps.get_context_parallel_group())
    return (per_token.float() * mask).sum() / count.clamp_min(1.0)


def whole(share: torch.Tensor) -> torch.Tensor:
    """The mean loss from every rank's share (the sum over CP), as a detached copy; at CP 1 a copy
    of the share."""
    value = share.detach().clone()
    if size() == 1:
        return value
    dist.all_reduce(value, group=ps.get_context_parallel_group())
    return value


def backward_scale() -> int:
    """What a loss share is multiplied by for the backward: gradients are averaged over DP × CP,
    where the CP ranks' shares must add up (megatron's schedule: output_tensor *= cp_group_size)."""
    return size()
