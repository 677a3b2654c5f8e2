"""Expert capacity in training and in evaluation, as the authors run it.

The authors train with capacity factor 1.0 (tokens over an expert's capacity are dropped: the
layer passes them on through the residual only) and evaluate with 3.0 (nanochat/gpt.py,
`get_capacity`: `train_capacity if self.training else eval_capacity`). megatron-core reads one
value, `config.moe_expert_capacity_factor`, in the router (which drops) and in the dispatcher
(which then sizes its buffers from the routing map). A forward pre-hook on every MoE router
sets that value from the router's own train/eval mode just before it routes, so `model.eval()`
alone switches to the evaluation factor, in validation, CORE and eval/*.py alike.

Which tokens drop, in one capacity group: the T tokens one router call sees (a rank's micro-batch,
micro_batch × seq_length tokens; its sequence-parallel share, / tp, under TP), as in
megatron-core and in the authors' code (one device's batch, device_batch_size × seq_len, 32 ×
2048 by default there). Two keys choose the rule:
  model.moe.capacity    megatron: ceil(T·k/E · factor) (moe_utils.get_capacity); authors:
                        floor(k·factor·T/E) rounded up to even, at least 4 (14c9b04 gpt.py 679-687)
  model.moe.drop_order  probs, position: megatron-core's policies (the lowest routing weights
                        drop; the latest tokens drop); authors: every token's top-1 choice fills the
                        experts first, then the top-2 ones, each pass in the order of the tokens
                        in the batch, batch row by batch row (14c9b04 gpt.py 577-600)
With megatron's capacity and one of its policies, megatron's router drops; otherwise the router
routes without capacity and `drop` applies the rule (model/moe.py, ZLossRouter.routing).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

AUTHORS_MIN_CAPACITY = 4  # 14c9b04 nanochat/gpt.py: GPTConfig.min_capacity


def capacity(tokens: int, topk: int, experts: int, factor: float, rule: str) -> int:
    """The per-expert capacity of a group of `tokens` tokens."""
    if rule == "megatron":
        return math.ceil(tokens * topk / experts * factor)
    c = math.floor(topk * factor * tokens / experts)
    return max(c + c % 2, AUTHORS_MIN_CAPACITY)


def drop(probs: torch.Tensor, routing_map: torch.Tensor, topk: int, cap: int, order: str,
         seq: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map) [T, E] of the tokens in megatron's order (sequence-major, T = seq ·
    batch) with each expert keeping at most `cap` of its tokens, chosen by `order` (module doc)."""
    T, E = routing_map.shape
    if order == "probs":
        score = probs.masked_fill(~routing_map, float("-inf"))
        keep = torch.zeros_like(routing_map)
        keep.scatter_(0, score.topk(min(cap, T), dim=0).indices, True)
    elif order == "position":
        # the first `cap` chosen tokens per expert, in megatron's token order
        keep = routing_map.long().cumsum(0) <= cap
    else:  # authors: slot by slot (top-1 first), each slot in batch-major token order
        batch_major = torch.arange(T, device=probs.device).view(seq, batch).t().reshape(-1)
        score = probs.masked_fill(~routing_map, float("-inf"))[batch_major]
        slots = score.topk(topk, dim=-1).indices  # [T, k]: each token's experts by weight
        one_hot = F.one_hot(slots, E)  # [T, k, E]
        position = one_hot.permute(1, 0, 2).reshape(topk * T, E).cumsum(0).reshape(topk, T, E).permute(1, 0, 2)
        kept = ((position <= cap) & one_hot.bool()).any(1)  # [T, E] batch-major
        keep = torch.empty_like(kept)
        keep[batch_major] = kept
    keep = keep & routing_map
    return probs * keep, keep


def _set_factor(router, args):
    factor = router.train_capacity_factor if router.training else router.eval_capacity_factor
    router.config.moe_expert_capacity_factor = factor


def install_capacity_switch(model, train_factor: Optional[float], eval_factor: Optional[float]) -> int:
    """Hook every MoE router of `model` (returns how many). Nothing is installed when both factors
    are the same: the model's config already holds the training one."""
    if train_factor == eval_factor:
        return 0
    hooked = 0
    for module in model.modules():
        router = getattr(module, "router", None)
        if router is None or not hasattr(router, "config") or hasattr(router, "train_capacity_factor"):
            continue
        router.train_capacity_factor, router.eval_capacity_factor = train_factor, eval_factor
        router.register_forward_pre_hook(_set_factor)
        hooked += 1
    return hooked
