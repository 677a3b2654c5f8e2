"""The mla kind's pieces (megatron_kappa.attention_kinds' `mla` entry, model.mla): megatron-core's
MLASelfAttention with the key's RoPE part gathered so that its gradient is whole under tensor
parallelism, and its MLATransformerConfig.

In megatron's local spec the key/value down projection is a ColumnParallelLinear: each TP rank
computes a slice of [c_kv; k_pe] for every token, megatron gathers the slices over TP and, with
sequence parallelism, scatters c_kv back to this rank's tokens but keeps k_pe for every token.
k_pe is then used by this rank's heads only, so its gradient differs per rank, and the gather's
backward (a split, no sum) hands each rank its channels of a partial gradient: the down
projection's RoPE rows miss the other ranks' heads (tests/test_parallel.py: with megatron's class
the TP2 gradients leave one process's; AdamW's sign-like first steps hide much of it in the loss).
Here the gathered [c_kv; k_pe] is scattered to this rank's tokens whole, which
is megatron's other path (a duplicated down projection): it gathers k_pe over the sequence with a
reduce-scatter backward, which sums the heads' gradients over TP.

FP8 (`down_fp8`): megatron accepts only its own ColumnParallelLinear for the two down projections
(its constructor compares the spec's class), so the spec cannot name the FP8 subclass there; the
built modules become FP8ColumnParallelLinear instead, a subclass that changes only the GEMM.
"""
from __future__ import annotations

import dataclasses

from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_kappa import attention_kinds
from megatron_kappa.model import fp8


class SequenceParallelMLA(MLASelfAttention):
    def __init__(self, *args, down_fp8=None, **kwargs):
        super().__init__(*args, **kwargs)
        if down_fp8 is not None:
            for name in ("linear_q_down_proj", "linear_kv_down_proj"):
                module = getattr(self, name, None)
                if module is not None:
                    module.__class__ = fp8.FP8ColumnParallelLinear
                    module.set_fp8(down_fp8)

    def _qkv_down_projection(self, hidden_states):
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        whole = self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim
        if kv_combined.size(-1) != whole:  # a TP slice, every token: whole channels, this rank's tokens
            if not self.config.sequence_parallel:
                raise ValueError("model.mla: tensor parallelism without sequence parallelism is not supported")
            kv_combined = scatter_to_sequence_parallel_region(gather_from_tensor_model_parallel_region(kv_combined))
        return q_compressed, kv_combined


def attention(spec, attention_fp8: fp8.FP8Settings | None):
    """The self-attention spec: megatron's local MLA spec's, built as SequenceParallelMLA (the down
    projections' FP8, the attention projections' settings, is set on the built modules)."""
    return dataclasses.replace(spec, module=SequenceParallelMLA, params={**spec.params, "down_fp8": attention_fp8})


attention_kinds.implement("mla", transformer_config=MLATransformerConfig, attention=attention)
