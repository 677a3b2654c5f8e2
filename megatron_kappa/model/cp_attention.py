"""Context-parallel core attention (`parallel.cp`): each rank's queries against the whole
sequence's keys and values, all-gathered over the context-parallel group.

The layout is megatron's load-balanced causal one (megatron.core.utils.get_batch_on_this_cp_rank,
rope_utils.get_pos_emb_on_this_cp_rank): the sequence of S tokens is cut into 2·CP chunks of
S/(2·CP) tokens and rank r holds chunks r and 2·CP−1−r, in that order. Under a causal mask an
early chunk has few keys to attend to and a late one many; pairing chunk r with its mirror gives
every rank the same amount of work.

The exchange is the simplest one (megatron's `cp_comm_type: all_gather`): K and V of every rank
are gathered in one collective, put back in sequence order, and each of the rank's two query
chunks attends to the keys up to its own end with a causal mask aligned to the lower right (the
chunk's first query sees every earlier chunk). The gather's backward is a reduce-scatter: each
rank's K and V receive the gradient from every rank's queries. A ring (p2p) exchange that
overlaps the passing of K/V chunks with the compute is not implemented (docs/context_parallel.md).

Torch only (no process group here): the caller hands in the gather, so that tests can run the
ranks as iterations of one process.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F


def rank_chunks(rank: int, size: int) -> tuple[int, int]:
    """The two chunks (of 2·size) that context-parallel rank `rank` holds, in its order."""
    return rank, 2 * size - 1 - rank


def _sequence_order(gathered: torch.Tensor, size: int, upto: int) -> torch.Tensor:
    """The first `upto` chunks in sequence order from the gathered [size · 2 chunks, ...] tensor,
    whose block r is rank r's [chunk r; chunk 2·size−1−r]."""
    per_rank = gathered.view(size, 2, gathered.shape[0] // (2 * size), *gathered.shape[1:])
    chunks = [per_rank[c, 0] if c < size else per_rank[2 * size - 1 - c, 1] for c in range(upto)]
    return torch.cat(chunks)


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, rank: int,
                               size: int, gather: Callable[[torch.Tensor], torch.Tensor], scale: float,
                               enable_gqa: bool, dropout_p: float = 0.0,
                               observe: Optional[Callable] = None) -> torch.Tensor:
    """Causal attention of this rank's two query chunks over the full sequence.

    query [s, b, heads, dk], key [s, b, groups, dk], value [s, b, groups, dv]: this rank's tokens
    (s = S / CP, its two chunks). `gather` concatenates a tensor's [s, ...] pieces of every rank of
    the group along dim 0 in rank order, with a reduce-scatter backward. Returns [s, b, heads, dv].
    `observe(q, k, mask)`, when given, sees each chunk's SDPA inputs ([b, heads, chunk, dk],
    [b, groups, keys, dk], the boolean mask: True where attention is allowed), e.g. for QK-Clip's
    largest logits."""
    s, dk = query.shape[0], key.shape[-1]
    if s % 2:
        raise ValueError(f"context parallelism: {s} tokens on this rank do not split into two chunks")
    chunk = s // 2
    # K and V in one collective: concatenated on the channels (they may differ in width: MLA)
    kv = gather(torch.cat([key, value], dim=-1).contiguous())
    outputs = []
    for half, c in enumerate(rank_chunks(rank, size)):
        keys_values = _sequence_order(kv, size, c + 1)  # chunks 0..c: every key this chunk may see
        q = query[half * chunk:(half + 1) * chunk]
        k, v = keys_values[..., :dk], keys_values[..., dk:]
        length = keys_values.shape[0]
        # query i of the chunk sits at position c·chunk + i = length − chunk + i: it sees the keys
        # up to there (the causal mask aligned to the lower right)
        mask = torch.ones(chunk, length, dtype=torch.bool, device=query.device).tril(length - chunk)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, tokens, d]
        if observe is not None:
            observe(q, k, mask)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                             enable_gqa=enable_gqa)
        outputs.append(out.permute(2, 0, 1, 3))
    return torch.cat(outputs)
