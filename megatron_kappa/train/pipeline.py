"""The training step with pipeline stages (`parallel.pp > 1`): megatron-core's 1F1B schedule over
this rank's micro-batches, DeepSpeed's ZeRO-1 for the reduction and the update.

DeepSpeed runs with `managed_gradient_accumulation: false` (megatron_kappa.parallel.engine): the
schedule does every forward and backward on the raw module, gradients accumulate in `.grad`, and
`engine.step()` is the accumulation boundary where ZeRO-1 reduces them over the data-parallel
group (the expert-data-parallel one for experts) and steps. Its gradient norm is summed over
megatron's model-parallel group, which spans the stages. ZeRO-2 reduces inside backward hooks
and is refused with stages (the preflight).

The loss exists on the last stage only; it is summed over the pipeline group so that every rank
has it. κ's L2 penalty belongs to the stages that hold α and b: each backwards its own share once
per step, outside the schedule.

Without stages the step comes here too with `parallel.overlap_moe_expert_parallel_comm`: megatron's
no-pipelining schedule then runs its combined 1F1B (each micro-batch's forward interleaved layer by
layer with the previous one's backward; docs/ep_overlap.md), with the same reduction and update.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_kappa.config import Config
from megatron_kappa.model import embedding_copy
from megatron_kappa.model.nanochat import pipeline_seq_length
from megatron_kappa.model.virtual_stages import chunks_of
from megatron_kappa.parallel import context
from megatron_kappa.parallel.groups import dp_mean, pipeline_sum
from megatron_kappa.train import recipe
from megatron_kappa.train.data import batch_at, train_first_sample


def run_schedule(model, batches: list[dict], cfg: Config, position_ids, forward_only: bool) -> torch.Tensor:
    """The mean loss of `batches` (micro-batches) through every stage, on every rank of the
    pipeline; with forward_only=False the gradients are accumulated in `.grad` (megatron's
    schedule divides each micro-batch's loss by their count)."""
    chunks = chunks_of(model)  # virtual stages: megatron's interleaved schedule, each chunk its own iterator
    data = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)

    def forward_step(data_iterator, module, return_schedule_plan=False):
        # context parallelism: this rank's chunks (megatron's schedule sizes the p2p tensors by s / CP)
        batch = context.split_batch({**next(data_iterator), "position_ids": position_ids})
        # the first stage embeds the tokens; the others take their input from the previous stage.
        # EP overlap (megatron's combined 1F1B): the schedule asks for the model's plan of this
        # micro-batch instead, and runs its layers' pieces itself; the plan's output is the same
        # per-token loss
        run = module.build_schedule_plan if return_schedule_plan else module
        output = run(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, lambda per_token: _loss(per_token, batch["loss_mask"])

    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=chunks, num_microbatches=len(batches),
        seq_length=pipeline_seq_length(cfg.model), micro_batch_size=cfg.train.micro_batch, forward_only=forward_only)
    device = position_ids.device
    loss = torch.zeros((), device=device)
    if ps.is_pipeline_last_stage():
        loss = torch.stack([r["loss"] for r in results]).mean()
    return pipeline_sum(loss)


def _loss(per_token, mask):
    # with context parallelism this rank's share of the mean: megatron's schedule multiplies it by
    # CP for the backward (output_tensor *= cp_group_size), `whole` adds the shares for the record
    loss = context.loss_share(per_token, mask)
    # a copy: megatron's schedule divides the returned loss by the micro-batch count in place
    return loss, {"loss": context.whole(loss)}


def train_step(engine, model, cfg: Config, train_ds, step: int, device, position_ids, micro_batches: int):
    """One optimizer step; returns (the step's loss averaged over data-parallel ranks, this rank's
    κ L2 penalty), as device tensors."""
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batches = [batch_at(train_ds, train_first_sample(step, micro, cfg.train, dp_rank, dp), cfg.train.micro_batch,
                        device)
               for micro in range(micro_batches)]
    loss = run_schedule(engine.module, batches, cfg, position_ids, forward_only=False)
    for chunk in chunks_of(model):  # MTP's embedding copy on the last stage steps with the first's
        embedding_copy.all_reduce_grads(chunk)
    l2 = recipe.kappa_l2(model, cfg.model.kappa, cfg.parallel, device)
    if l2.requires_grad:  # this stage holds α, b
        (l2 * recipe.l2_scale()).backward()
    engine.step()
    return dp_mean(loss), l2


def stage_sum_counts(by: dict, input_embedding: int) -> tuple[dict, int]:
    """Parameter counts by category summed over the pipeline stages (each counts its layers)."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return by, input_embedding
    every = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(every, (by, input_embedding), group=ps.get_pipeline_model_parallel_group())
    return {k: sum(b[k] for b, _ in every) for k in by}, sum(e for _, e in every)
