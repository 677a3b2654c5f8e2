"""The language-model loss, without the [tokens, vocab] logits in fp32 at once.

megatron-core's `vocab_parallel_cross_entropy` turns the whole logits tensor into fp32 and keeps
the fp32 softmax for the backward: for a micro-batch of 16k tokens and a 32k vocabulary that is
two 2 GiB tensors beside the bf16 logits. Here the loss walks the tokens in chunks: each chunk's
logits are upcast, reduced to the log-sum-exp and the target logit, and freed; the backward
recomputes each chunk's softmax from the (bf16) logits and the saved log-sum-exp. Vocabulary
parallelism (TP) works as in megatron: each rank holds a slice of the vocabulary, the max, the
sum of exponentials and the target logit are all-reduced over the TP group. `ChunkedLossGPTModel`
puts it inside megatron's GPTModel (`model(..., labels=...)`), where megatron computes its loss
(chunk 0: megatron's own loss).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megatron_kappa.model import embedding_copy


class ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, chunk: int, group):
        """logits [N, V/TP] (any float dtype), target [N] (global vocabulary ids) → loss [N], fp32
        (float64 for float64 logits: the tests' reference precision)."""
        n, vocab_local = logits.shape
        tp = dist.get_world_size(group) if group is not None else 1
        first = (dist.get_rank(group) if tp > 1 else 0) * vocab_local
        dtype = torch.promote_types(logits.dtype, torch.float32)
        loss = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            x = logits[rows].to(dtype)
            top = x.amax(dim=-1)  # amax: no indices (max(dim) computes them, at twice the cost on CPU)
            if tp > 1:
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            sum_exp = torch.sub(x, top[:, None]).exp_().sum(dim=-1)
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
            softmax = torch.sub(logits[rows].to(lse.dtype), lse[rows, None]).exp_()
            local = target[rows] - ctx.first
            mine = (local >= 0) & (local < vocab_local)
            # d loss / d logit = softmax − one-hot(target), the one-hot only on the owning rank
            softmax.scatter_add_(1, local.clamp(0, vocab_local - 1)[:, None], -mine.to(softmax.dtype)[:, None])
            grad[rows] = softmax.mul_(grad_loss[rows, None])  # copy_ casts to the logits' dtype
        return grad, None, None, None


def vocab_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per-token loss (fp32, the shape of `labels`) from vocabulary-parallel logits [..., V/TP]."""
    if chunk <= 0:
        raise ValueError(f"vocab_parallel_loss: chunk must be positive, got {chunk}")
    group = parallel_state.get_tensor_model_parallel_group() \
        if parallel_state.get_tensor_model_parallel_world_size() > 1 else None
    loss = ChunkedVocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                  chunk, group)
    return loss.view(labels.shape)


def softcap_logits(output_layer: torch.nn.Module, cap: float):
    """The output layer's logits become cap · tanh(logits / cap) (model.logit_softcap; the authors'
    nanochat block caps at 15: askerlee/kappa-swiglu 14c9b04 nanochat/gpt.py 2447, 143-166) for
    every reader: megatron's loss, the chunked loss and evaluation. A forward hook, so the layer
    and its parameter names stay megatron's; elementwise, so each TP rank caps its vocabulary slice."""
    def hook(module, inputs, output):
        logits, bias = output
        return torch.tanh(logits / cap) * cap, bias
    output_layer.register_forward_hook(hook)


class ChunkedLossGPTModel(GPTModel):
    """megatron-core's GPTModel with the chunked loss (model.cross_entropy_chunk) in place of
    `vocab_parallel_cross_entropy`. It takes the output layer's [s, b, V/TP] logits where they are
    made, as megatron's own loss does: asking the model for logits instead would first copy them
    into [b, s, V/TP] (GPTModel's transpose), one more logits-sized tensor and pass."""

    def __init__(self, *args, cross_entropy_chunk: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.cross_entropy_chunk = cross_entropy_chunk

    def setup_embeddings_and_output_layer(self) -> None:
        # with MTP on pipeline stages megatron's own moves the last stage's embedding copy with
        # .cuda(): ours starts it on the weight's device (megatron_kappa.model.embedding_copy)
        if embedding_copy.needs_copy(self):
            return embedding_copy.setup(self)
        return super().setup_embeddings_and_output_layer()

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """labels [b, s], logits [s, b, V/TP] → loss [b, s], as the method it overrides (megatron's
        own with cross_entropy_chunk 0)."""
        if not self.cross_entropy_chunk:
            return super().compute_language_model_loss(labels, logits)
        loss = vocab_parallel_loss(logits, labels.transpose(0, 1), self.cross_entropy_chunk)
        return loss.transpose(0, 1).contiguous()
