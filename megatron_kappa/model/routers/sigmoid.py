"""The sigmoid router's pieces (megatron_kappa.routers' `sigmoid` entry): softmax's top-k router
and MoE layer (megatron scores them by sigmoid through its settings), and the expert bias moved
toward balance after every optimizer step (Trinity's aux-loss-free balancing)."""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

from megatron_kappa import routers
from megatron_kappa.config import MoEConfig
from megatron_kappa.model.routers.softmax import topk_layer, topk_router


def routers_with_expert_bias(model):
    return [m for m in model.modules()
            if getattr(m, "expert_bias", None) is not None and hasattr(m, "local_tokens_per_expert")]


@torch.no_grad()
def update_expert_bias(model, rate: float):
    """After each optimizer step (the global batch), move each router's bias toward balance: its
    token counts summed over TP×DP, bias += rate · sign(mean − count)."""
    found = routers_with_expert_bias(model)
    if not found:
        return
    counts = torch.stack([r.local_tokens_per_expert for r in found])
    biases = torch.stack([r.expert_bias for r in found])
    group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    for router, bias in zip(found, get_updated_expert_bias(counts, biases, rate, group)):
        router.expert_bias.copy_(bias)
        router.local_tokens_per_expert.zero_()


def after_step(model, moe: MoEConfig):
    """The global batch's token counts move each router's expert bias toward balance."""
    update_expert_bias(model, moe.bias_update_rate)


routers.implement("sigmoid", router=topk_router, layer=topk_layer, after_step=after_step)
