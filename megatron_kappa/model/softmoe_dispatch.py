"""Dispatching a variable number of experts per token (the SoftMoE router's routing maps).

megatron's dropless alltoall dispatcher sizes the permuted buffer as tokens × topk, i.e. it assumes
exactly topk experts per token; the permute takes that many entries of the routing map. With
SoftMoE the map holds between 0 and `max_experts` entries per token, so the buffer's size is the
map's count. That count is a device value which the permute needs on the host: it is copied at
megatron's own "before_permutation_1" copy point and waited for there (`cuda_sync_point`). Dropless
alltoall already waits for its split sizes on the host ("before_ep_alltoall" with EP or TP > 1,
"before_finish" otherwise), so the wait only moves earlier, to before the first permutation.
megatron's allgather dispatcher already counts its rows (`tokens_per_expert.sum().item()`).

  VariableCountAlltoAll        alltoall with the buffer sized by the map
  KappaVariableCountAlltoAll   the same, carrying each pair's router logit (KappaAlltoAllDispatcher)
  SoftMoELayer                 MoELayer with the dispatcher for the configured kind and experts
"""
from __future__ import annotations

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_kappa.model.moe import KappaAllGatherDispatcher, KappaAlltoAllDispatcher


class VariableCountAlltoAll(MoEAlltoAllTokenDispatcher):
    def preprocess(self, routing_map):
        tokens_per_expert = super().preprocess(routing_map)
        self.num_out_tokens = routing_map.sum()  # to the host at the copy point below
        self._maybe_update_cuda_sync_point("before_permutation_1")
        return tokens_per_expert


class KappaVariableCountAlltoAll(KappaAlltoAllDispatcher, VariableCountAlltoAll):
    pass


_DISPATCHERS = {  # (carry the logit, kind)
    (False, "alltoall"): VariableCountAlltoAll, (False, "allgather"): MoEAllGatherTokenDispatcher,
    (True, "alltoall"): KappaVariableCountAlltoAll, (True, "allgather"): KappaAllGatherDispatcher}


class SoftMoELayer(MoELayer):
    """MoELayer for the SoftMoE router; `carry_logit` for κ experts (two-channel probs)."""

    def __init__(self, config: TransformerConfig, submodules=None, layer_number=None, pg_collection=None,
                 is_mtp_layer=False, name=None, carry_logit: bool = False):
        kind = config.moe_token_dispatcher_type
        if (carry_logit, kind) not in _DISPATCHERS:
            raise ValueError(f"model.moe.dispatcher: the softmoe router needs 'alltoall' or 'allgather' "
                             f"(got {kind!r}: 'flex' assumes topk experts per token)")
        super().__init__(config, submodules, layer_number, pg_collection, is_mtp_layer, name)
        self.token_dispatcher = _DISPATCHERS[(carry_logit, kind)](
            self.num_local_experts, self.local_expert_indices, config=self.config,
            pg_collection=pg_collection or get_default_pg_collection())
