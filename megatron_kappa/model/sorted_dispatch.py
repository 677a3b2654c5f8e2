"""A token dispatcher with no host sync, for MoE layers whose experts all live on this rank.

megatron-core's dispatchers read the number of tokens per expert on the host in every MoE layer
of every micro-batch (their permutation uses `masked_select`, the all-to-all needs split sizes):
on a GPU each read makes the host wait for the device, so the next kernels are queued late and the
GPU idles. With EP = TP = 1 nothing has to leave the device. A top-k router gives every token
exactly k (token, expert) pairs, so the pairs in expert order are a fixed number of rows
(tokens × k), found by a stable sort of the routing map; the counts per expert stay a device
tensor (the grouped experts take their GEMM offsets on the device). Each token's k rows are
summed in a fixed order, in the combine and in the backward of the gather, so results are
deterministic without atomics. The probabilities may carry the router logit as a second channel
(κ-SwiGLU's [T, E, 2]): they are moved like any per-pair tensor.

Config: `model.moe.dispatcher: sorted` (validated: EP = TP = ETP = 1, no capacity factor, a top-k
router).
"""
from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig


class _TokensToRows(torch.autograd.Function):
    """tokens [T, H] → rows [T·k, H] (rows = tokens[token_of_row]); the backward sums each
    token's k row gradients in a fixed order instead of scattering with atomics."""

    @staticmethod
    def forward(ctx, tokens, token_of_row, rows_by_token, k: int):
        ctx.save_for_backward(rows_by_token)
        ctx.k = k
        return tokens.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, grad_rows):
        (rows_by_token,) = ctx.saved_tensors
        grad = grad_rows.index_select(0, rows_by_token).view(-1, ctx.k, grad_rows.shape[-1]).sum(1)
        return grad, None, None, None


class _RowsToTokens(torch.autograd.Function):
    """rows [T·k, H] → tokens [T, H]: each token's k rows summed in a fixed order."""

    @staticmethod
    def forward(ctx, rows, token_of_row, rows_by_token, k: int):
        ctx.save_for_backward(token_of_row)
        return rows.index_select(0, rows_by_token).view(-1, k, rows.shape[-1]).sum(1)

    @staticmethod
    def backward(ctx, grad_tokens):
        (token_of_row,) = ctx.saved_tensors
        return grad_tokens.index_select(0, token_of_row), None, None, None


class SortedDispatcher(MoETokenDispatcher):
    def __init__(self, num_local_experts, local_expert_indices, config: TransformerConfig, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        if self.ep_size != 1 or self.tp_size != 1:
            raise ValueError("model.moe.dispatcher: sorted needs all experts on one rank (EP = ETP = 1)")
        self.k = config.moe_router_topk

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, self.hidden_shape[-1])
        t, e = routing_map.shape
        # The routed pairs in expert-major order: a stable sort brings the True entries of the
        # transposed map to the front, in order; there are exactly t·k of them.
        not_routed = routing_map.t().reshape(-1).logical_not().to(torch.int8)
        order = torch.argsort(not_routed, stable=True)[: t * self.k]
        self.token_of_row = order % t
        self.rows_by_token = torch.argsort(self.token_of_row, stable=True)
        self.tokens_per_expert = routing_map.sum(dim=0)
        pair_probs = probs.transpose(0, 1).reshape(e * t, *probs.shape[2:]).index_select(0, order)
        return tokens, pair_probs

    def token_dispatch(self, hidden_states, probs):
        return hidden_states, probs  # nothing to send: every expert is here

    def dispatch_postprocess(self, hidden_states, probs):
        rows = _TokensToRows.apply(hidden_states, self.token_of_row, self.rows_by_token, self.k)
        return rows, self.tokens_per_expert, probs

    def combine_preprocess(self, hidden_states):
        return _RowsToTokens.apply(hidden_states, self.token_of_row, self.rows_by_token, self.k)

    def token_combine(self, hidden_states):
        return hidden_states

    def combine_postprocess(self, hidden_states):
        return hidden_states.view(self.hidden_shape)


class SortedMoELayer(MoELayer):
    """megatron's MoELayer (any router and experts of ours) with the sorted dispatcher."""

    def __init__(self, config: TransformerConfig, submodules=None, layer_number=None, pg_collection=None,
                 is_mtp_layer=False, name=None):
        super().__init__(config, submodules, layer_number, pg_collection, is_mtp_layer, name)
        self.token_dispatcher = SortedDispatcher(self.num_local_experts, self.local_expert_indices,
                                                 config=self.config,
                                                 pg_collection=pg_collection or get_default_pg_collection())
