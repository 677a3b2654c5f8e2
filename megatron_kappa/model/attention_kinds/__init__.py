"""The built-in attention kinds' pieces that need torch, one module per kind, each handing its own
to the attention registry (megatron_kappa.attention_kinds.implement) when imported. Importing
this package imports them all: megatron_kappa.model.build does, before it asks the registry for a
TransformerConfig class or a self-attention spec. gqa has no module: it is megatron-core's stock
SelfAttention and TransformerConfig.

Modules:
  mla.py  The mla kind's pieces (megatron_kappa.attention_kinds' `mla` entry, model.mla): megatron-
          core's MLASelfAttention with the key's RoPE part gathered so that its gradient is whole
          under tensor parallelism, and its MLATransformerConfig
"""
from megatron_kappa.model.attention_kinds import mla  # noqa: F401  (hands its pieces over)
