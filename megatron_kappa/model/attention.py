"""Core attention through `torch.nn.functional.scaled_dot_product_attention`.

A drop-in for megatron-core's local `DotProductAttention` in the layer spec (same constructor
and forward, [s, b, heads, head_dim] in, [s, b, heads·head_dim] out), without materialising the
[s, s] scores: torch picks the flash, cuDNN or memory-efficient kernel on a GPU, and a fused
kernel on the CPU. Causal masks are passed as `is_causal`; grouped-query attention as
`enable_gqa` (the key/value heads are not repeated in memory). With context parallelism
(`parallel.cp > 1`) the keys and values are all-gathered over the context-parallel group and each
rank's two chunks of queries attend to them (megatron_kappa.model.cp_attention).

With QK-Clip (`train.qk_clip`, megatron_kappa.optim.qk_clip) it also records each head's largest
pre-softmax logit of the step's training forwards in `current_max_attn_logits` ([heads of this TP
rank], the name and shape of megatron's TE attention, which TE's kernel returns): SDPA does not
return it, so `head_max_logits` computes QKᵀ once more, without gradients, a block of queries at a
time (one more QKᵀ GEMM per layer: the cost of not having TE's fused max here); with context
parallelism, per query chunk against the keys it sees.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_kappa.model.cp_attention import context_parallel_attention


class SDPAttention(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number, attn_mask_type, attention_type, attention_dropout=None,
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
        self.current_max_attn_logits = None  # QK-Clip: [heads] max over the step's training forwards

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
                enable_gqa=self.heads != self.groups, dropout_p=self.dropout if self.training else 0.0,
                observe=self.observe_chunk if self.config.qk_clip and self.training else None)
            return out.reshape(s, b, self.hidden_per_partition)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if self.config.qk_clip and self.training:
            self.track_max_logits(head_max_logits(q, k, self.scale, causal, mask))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             dropout_p=self.dropout if self.training else 0.0,
                                             scale=self.scale, enable_gqa=self.heads != self.groups)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_per_partition)

    def observe_chunk(self, q, k, mask):
        """Context parallelism: one query chunk against the keys it sees (its mask aligned to the
        lower right); the step's maxima over the CP ranks come from QK-Clip's MAX over DP × CP."""
        self.track_max_logits(head_max_logits(q, k, self.scale, False, mask))

    def track_max_logits(self, batch_max: torch.Tensor):
        """Fold one forward's per-head maxima into the step's (QK-Clip resets it after the step)."""
        seen = self.current_max_attn_logits
        self.current_max_attn_logits = batch_max if seen is None else torch.maximum(seen, batch_max)


# elements of one block of fp32 scores in head_max_logits (256 MiB)
SCORE_BLOCK_ELEMENTS = 1 << 26


@torch.no_grad()
def head_max_logits(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, mask=None) -> torch.Tensor:
    """The largest pre-softmax logit scale·q_i·k_j of each query head over the batch and every
    (i, j) the attention lets through, [heads] in fp32. q [b, heads, s, d], k [b, groups, t, d]
    (query head h reads key head h // (heads / groups), as SDPA's enable_gqa); `causal`: key j ≤
    query i (aligned at the start, as SDPA's is_causal with s = t); `mask`: SDPA's boolean mask
    (True where attention is allowed), broadcastable to [b, heads, s, t]."""
    b, heads, s, d = q.shape
    groups, t = k.shape[1], k.shape[2]
    rows = max(1, SCORE_BLOCK_ELEMENTS // max(1, b * heads * t))
    kf = k.float().unsqueeze(2)  # [b, groups, 1, t, d]
    best = torch.full((heads,), float("-inf"), device=q.device)
    for start in range(0, s, rows):
        stop = min(s, start + rows)
        qf = q[:, :, start:stop].float().reshape(b, groups, heads // groups, stop - start, d)
        scores = (qf @ kf.transpose(-1, -2)).mul_(scale).reshape(b, heads, stop - start, t)
        if causal:
            i = torch.arange(start, stop, device=q.device)[:, None]
            scores.masked_fill_(torch.arange(t, device=q.device)[None, :] > i, float("-inf"))
        if mask is not None:
            scores.masked_fill_(~mask[..., start:stop, :], float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best
