"""Continuing a prompt with the trained model: greedy or sampled (temperature, top-k, top-p), with
a key/value cache.

The cache is megatron-core's static one (StaticInferenceContext): the prompt runs once, then each
new token runs alone against the keys and values kept for every layer. megatron allocates those
buffers on the current CUDA device at the first forward; they are allocated here instead, on the
model's device, so the same path runs on a CPU. One process, no tensor or sequence parallelism (a
one-token step cannot be split over the sequence): evaluation.loading.load_model consolidates any
training layout for it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (the most likely token)
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches p (1: all)
    seed: int = 0

    def check(self):
        if self.temperature < 0:
            raise ValueError(f"--temperature: must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k: must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p: must be in (0, 1], got {self.top_p}")


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The next token [B] from the last position's logits [B, V]."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # probability of the tokens ranked above
        drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, before >= sampling.top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def kv_cache(model, batch: int, length: int):
    """megatron's static inference context for `length` positions, its buffers made here."""
    from megatron.core.inference.contexts import StaticInferenceContext
    context = StaticInferenceContext(batch, length)
    weight = next(model.parameters())
    for layer in model.decoder.layers:
        attention = layer.self_attention
        # keys and values may differ in width (MLA: nope + rope dims for keys, v_head_dim for values)
        shape = (length, batch, attention.num_query_groups_per_partition)
        context.key_value_memory_dict[attention.layer_number] = (
            torch.empty(*shape, attention.key_hidden_size, dtype=weight.dtype, device=weight.device),
            torch.empty(*shape, attention.val_hidden_size, dtype=weight.dtype, device=weight.device))
    return context


@torch.no_grad()
def generate(model, prompt: list[int], max_new_tokens: int, vocab_size: int, sampling: Sampling = Sampling(),
             stop: int | None = None, max_length: int | None = None) -> list[int]:
    """Up to `max_new_tokens` tokens after `prompt` (fewer at `stop`, which is included, or at
    `max_length` positions in all)."""
    from megatron.core import parallel_state as ps
    if ps.get_tensor_model_parallel_world_size() > 1 or ps.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError("generation: run it as one process (the checkpoint is consolidated for it)")
    sampling.check()
    if not prompt:
        raise ValueError("generation: the prompt has no tokens")
    total = len(prompt) + max_new_tokens
    if max_length is not None:
        total = min(total, max_length)
    if total <= len(prompt):
        return []
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(sampling.seed) if sampling.temperature > 0 else None
    context = kv_cache(model, 1, total)
    tokens = torch.tensor([prompt], device=device)
    positions = torch.arange(len(prompt), device=device)[None]
    out = []
    while True:
        logits = model(tokens, positions, None, inference_context=context)[:, -1, :vocab_size]
        context.sequence_len_offset += tokens.shape[1]
        token = next_token(logits, sampling, generator)
        out.append(int(token))
        if out[-1] == stop or len(prompt) + len(out) >= total:
            return out
        tokens, positions = token[None], positions[:, -1:] + 1
