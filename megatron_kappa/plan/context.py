"""Context parallelism's costs in the plan: the trainer's all-gather of keys and values, and (planned
only) Transformer Engine's ring.

The trainer (`parallel.cp`; megatron_kappa.model.cp_attention, megatron's cp_comm_type all_gather):
in each layer's forward every CP rank all-gathers the K and V of its s·b/cp tokens over the CP
group (one collective, K and V side by side), and backward reduce-scatters their gradient (the
gather's backward); a core attention that backward computes again (full recompute of the layer,
or the selective core_attn module) gathers once more. An all-gather or a reduce-scatter over cp
ranks, as a ring, takes cp − 1 steps, each sending one rank's share, so per layer and micro-batch

  exchanges   (2 + r)·(cp − 1) messages, r = 1 where the core attention is recomputed
  traffic     exchanges × the rank's tokens × kv/tp values (2 bytes each: plan.speed)

with kv the K and V elements of a token (attention_kinds' kv_elements: 2·groups·d; MLA's
up-projected K, nope + rope, and V of every head). For backward each rank keeps, per layer and
micro-batch, what SDPA saves of its two query chunks (chunk r sees chunks 0..r, chunk 2cp − 1 − r
sees 0..2cp − 1 − r): the gathered keys and values, 2cp + 1 chunks of s/(2cp) tokens in all
whatever the rank, and each chunk's causal mask, which SDPA takes as a bias in the activations'
dtype and keeps ([chunk, its keys]: (2cp + 1)·(s/(2cp))² values, the same for every sequence of
the micro-batch and every head). The rank's own K and V are not kept (only the gathered copies):

  kept        (2cp + 1)/(2cp)·s·b × kv/tp + (2cp + 1)·(s/(2cp))²   instead of s·b/cp × kv/tp

(`kept_values` returns the difference; the selective core_attn module drops it: its checkpoint
keeps the rank's own q, k and v). Counted against the trainer's function in
tests/test_plan_context.py (the gather's sizes, the tensors autograd saves, on the CPU; which
kernel a GPU picks with a mask, and so whether it keeps the bias, is not measured).

Planned only (`Planned.ring_attention`, megatron's default cp_comm_type p2p under Transformer
Engine, which the published runs used): the rank's K and V chunk passes round the ring, cp − 1
hops forward and twice that in backward (K, V and their gradients): 3 (cp − 1) exchanges of the
rank's tokens × kv/tp per layer and micro-batch, whatever the recompute; each rank keeps its own
K and V only.
"""
from __future__ import annotations

from megatron_kappa import attention_kinds
from megatron_kappa.config import ModelConfig


def kv_width(m: ModelConfig, tp: int) -> float:
    """Elements of K and V per token on one TP rank (what the exchange moves; MLA: the
    up-projected K, nope + rope, and V)."""
    return attention_kinds.of(m).kv_elements(m) / tp


def exchanges(recomputed: list[bool], cp: int, ring: bool = False) -> int:
    """Ring steps of one rank per micro-batch over a stage's layers, each sending one share of the
    rank's tokens' K and V (or of their gradient): `recomputed` says per layer whether backward
    runs its core attention again (which gathers again; the ring's count ignores it)."""
    if cp == 1:
        return 0
    if ring:
        return 3 * (cp - 1) * len(recomputed)
    return (cp - 1) * sum(2 + bool(r) for r in recomputed)


def kept_values(m: ModelConfig, tokens: float, tp: int, cp: int, ring: bool = False) -> float:
    """Values one rank keeps per layer and micro-batch for the all-gather beyond the rank's own K
    and V (which the attention kinds' activations count): the gathered keys and values and the
    masks less the own K and V; 0 without CP and under the ring. `tokens`: the rank's, s·b/cp."""
    if cp == 1 or ring:
        return 0.0
    chunk = m.seq_length / (2 * cp)
    kv = kv_width(m, tp)
    return (2 * cp + 1) / 2 * tokens * kv + (2 * cp + 1) * chunk ** 2 - tokens * kv


def own_values(m: ModelConfig, tokens: float, tp: int, cp: int, ring: bool = False) -> float:
    """The rank's own K and V per layer and micro-batch where the all-gather keeps none of them
    (0 without CP and under the ring, which keep them)."""
    return 0.0 if cp == 1 or ring else tokens * kv_width(m, tp)
