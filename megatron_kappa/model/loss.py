"""The language-model loss, without the [tokens, vocab] logits in fp32 at once.

megatron-core's `vocab_parallel_cross_entropy` turns the whole logits tensor into fp32 and keeps
the fp32 softmax for the backward: for a micro-batch of 16k tokens and a 32k vocabulary that is
two 2 GiB tensors beside the bf16 logits. Here the loss walks the tokens in chunks: each chunk's
logits are upcast, reduced to the log-sum-exp and the target logit, and freed; the backward
recomputes each chunk's softmax from the (bf16) logits and the saved log-sum-exp. Vocabulary
parallelism (TP) works as in megatron: each rank holds a slice of the vocabulary, the max, the
sum of exponentials and the target logit are all-reduced over the TP group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state


class ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, chunk: int, group):
        """logits [N, V/TP] (any float dtype), target [N] (global vocabulary ids) → loss [N], fp32."""
        n, vocab_local = logits.shape
        tp = dist.get_world_size(group) if group is not None else 1
        first = (dist.get_rank(group) if tp > 1 else 0) * vocab_local
        loss = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            x = logits[rows].float()
            top = x.max(dim=-1).values
            if tp > 1:
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            sum_exp = torch.exp(x - top[:, None]).sum(dim=-1)
            local = target[rows] - first
            mine = (local >= 0) & (local < vocab_local)
            picked = x.gather(1, local.clamp(0, vocab_local - 1)[:, None]).squeeze(1) * mine
            if tp > 1:
                dist.all_reduce(sum_exp, group=group)
                dist.all_reduce(picked, group=group)
            lse[rows] = top + sum_exp.log()
            loss[rows] = lse[rows] - picked
        ctx.save_for_backward(logits, target, lse)
        ctx.chunk, ctx.first = chunk, first
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse = ctx.saved_tensors
        n, vocab_local = logits.shape
        grad = torch.empty_like(logits)
        for start in range(0, n, ctx.chunk):
            rows = slice(start, min(start + ctx.chunk, n))
            softmax = torch.exp(logits[rows].float() - lse[rows, None])
            local = target[rows] - ctx.first
            mine = (local >= 0) & (local < vocab_local)
            # d loss / d logit = softmax − one-hot(target), the one-hot only on the owning rank
            softmax.scatter_add_(1, local.clamp(0, vocab_local - 1)[:, None], -mine.to(softmax.dtype)[:, None])
            grad[rows] = (softmax * grad_loss[rows, None]).to(grad.dtype)
        return grad, None, None, None


def language_model_loss(logits: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per-token loss [b, s] from the model's (vocabulary-parallel) logits [b, s, V/TP]."""
    group = parallel_state.get_tensor_model_parallel_group() \
        if parallel_state.get_tensor_model_parallel_world_size() > 1 else None
    b, s, v = logits.shape
    loss = ChunkedVocabParallelCrossEntropy.apply(logits.reshape(b * s, v), labels.reshape(b * s), chunk, group)
    return loss.view(b, s)
