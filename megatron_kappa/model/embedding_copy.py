"""The last pipeline stage's copy of the input embedding (model.mtp with parallel.pp > 1).

megatron-core's MTP modules embed the shifted tokens on the stage that holds them, the last one, so
GPTModel builds a second word embedding there (`mtp_process`). megatron keeps the two equal: the
copy starts as the first stage's (LanguageModule.setup_embeddings_and_output_layer: zeros, then an
all-reduce over the embedding group, after moving the weight with `.cuda()`) and every step the two
gradients are summed over the embedding group (finalize_model_grads), which DeepSpeed does not do.
Here `setup` makes the same start on the weight's own device, and `all_reduce_grads` is called by
the pipeline step before `engine.step()`, so both copies take the same update.

The copy is marked `ds_pipe_replicated`, DeepSpeed's mark for the tied weights of its own pipeline:
the gradient norm and the summary count it once (megatron_kappa.parallel.stage_norm and
megatron_kappa.summary skip it); the planner counts its memory on the last stage. Checkpoints
store it with its stage like any parameter (one embedding more on disk): a consolidated or
resharded state has one tensor of that name, equal on both stages.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def needs_copy(model) -> bool:
    """Whether this model has MTP modules and pipeline stages (a copy on the last stage)."""
    return bool(getattr(model.config, "mtp_num_layers", 0)) and model.config.pipeline_model_parallel_size > 1


def setup(model) -> None:
    """megatron's setup_embeddings_and_output_layer for untied weights with MTP on stages, on any
    device: the parameter marks, then the copy set to the first stage's weight (collective over
    the embedding group; nothing to do for a meta build)."""
    if model.post_process and model.output_layer.weight is not None:
        model.output_layer.weight.is_embedding_or_output_parameter = True
    if not hasattr(model, "embedding"):  # a middle stage
        return
    weight = model.embedding.word_embeddings.weight
    weight.is_embedding_or_output_parameter = True
    weight.shared_embedding = True
    if not model.pre_process:  # the copy: its value comes from the first stage
        weight.shared = True
        weight.ds_pipe_replicated = True
        if not weight.is_meta:
            weight.data.zero_()
    if not weight.is_meta and model._is_in_embd_group():
        dist.all_reduce(weight.data, group=model.embd_group)


def all_reduce_grads(model) -> None:
    """Sum the input embedding's gradient over the embedding group (the first stage and the
    copy's), so that both copies step alike (collective over the group; no-op elsewhere)."""
    if not needs_copy(model) or not hasattr(model, "embedding") or not model._is_in_embd_group():
        return
    weight = model.embedding.word_embeddings.weight
    grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    dist.all_reduce(grad, group=model.embd_group)
    weight.grad = grad
