"""Core attention through `torch.nn.functional.scaled_dot_product_attention`.

A drop-in for megatron-core's local `DotProductAttention` in the layer spec (same constructor
and forward, [s, b, heads, head_dim] in, [s, b, heads·head_dim] out), without materialising the
[s, s] scores: torch picks the flash, cuDNN or memory-efficient kernel on a GPU, and a fused
kernel on the CPU. Causal masks are passed as `is_causal`; grouped-query attention as
`enable_gqa` (the key/value heads are not repeated in memory). With context parallelism
(`parallel.cp > 1`) the keys and values are all-gathered over the context-parallel group and each
rank's two chunks of queries attend to them (megatron_kappa.model.cp_attention).
"""
from __future__ import annotations

import math

import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megatron_kappa.model.cp_attention import context_parallel_attention


class SDPAttention(MegatronModule):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        super().__init__(config=config)
        self.cp_group = None
        if config.context_parallel_size > 1:
            if cp_comm_type not in (None, "all_gather"):  # the one exchange implemented here
                raise ValueError(f"parallel.cp: sdpa exchanges keys and values by all_gather, not {cp_comm_type}")
            self.cp_group = pg_collection.cp if pg_collection is not None and hasattr(pg_collection, "cp") else \
                parallel_state.get_context_parallel_group()
        tp = pg_collection.tp.size() if pg_collection is not None else \
            parallel_state.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        # MLA: queries/keys of k_channels and values of v_channels per head (else both kv_channels)
        k_channels, v_channels = k_channels or config.kv_channels, v_channels or config.kv_channels
        self.hidden_per_partition = v_channels * self.heads
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.attn_mask_type = attn_mask_type

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("model.attention: sdpa takes neither packed sequences nor a bias")
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        if causal and attention_mask is not None:
            raise NotImplementedError("model.attention: sdpa builds the causal mask itself (pass None)")
        # megatron's masks are True where attention is *not* allowed; SDPA's bool masks the opposite
        mask = None if attention_mask is None else ~attention_mask
        s, b = query.shape[0], query.shape[1]
        if self.cp_group is not None:
            if not causal or mask is not None:
                raise NotImplementedError("parallel.cp: sdpa splits causal attention only")
            out = context_parallel_attention(
                query, key, value, rank=self.cp_group.rank(), size=self.cp_group.size(), scale=self.scale,
                gather=lambda t: gather_from_sequence_parallel_region(t, True, self.cp_group),
                enable_gqa=self.heads != self.groups, dropout_p=self.dropout if self.training else 0.0)
            return out.reshape(s, b, self.hidden_per_partition)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             dropout_p=self.dropout if self.training else 0.0,
                                             scale=self.scale, enable_gqa=self.heads != self.groups)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_per_partition)
