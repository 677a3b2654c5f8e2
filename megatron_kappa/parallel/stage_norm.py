"""DeepSpeed's ZeRO-1/2 gradient norm when pipeline stages hold different parameter groups.

DeepSpeed 0.19.8 drops empty parameter groups (engine.py 2348) and then, in
`DeepSpeedZeroOptimizer.scaled_global_norm`, sums each remaining group's squared norm over the
model-parallel group with one all-reduce per group, pairing groups by position. Stages whose
groups differ (the first has the input embedding, the last the output layer, a middle one neither;
stages with and without κ experts or value embeddings) then pair unrelated groups, or, with
unequal counts, wait forever for each other (a hang, seen with the nanochat block at PP2).

`install(optimizer)` replaces that method on the one optimizer instance (pipeline stages
only) with the same arithmetic keyed by group name: every rank sums its groups' squared norms
(each parameter's norm in fp64, as DeepSpeed; under CPU offload the norms DeepSpeed recorded on
the gradients' way to the CPU) in a vector indexed by the names of all stages, one all-reduce
(sum) over the model-parallel group gives each group's norm, DeepSpeed's own expert-norm averaging runs on this rank's
groups, and a
second all-reduce (max) gives every rank every group's final norm, so all stages combine the same
numbers. tests/test_compat.py checks the DeepSpeed attributes read here still exist.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.utils import get_norm_dtype

# What the replacement reads from DeepSpeed's ZeRO optimizer (deepspeed.runtime.zero.stage_1_and_2).
READS = ("scaled_global_norm", "bit16_groups", "averaged_gradients", "params_in_partition", "dp_process_group",
         "model_parallel_group", "model_parallel_rank", "has_moe_layers", "_average_expert_grad_norms",
         "_muon_update_lacks_loss_scale", "loss_scale", "cpu_offload", "device", "norm_for_param_grads",
         "get_param_id")


def group_names(optimizer) -> list[str]:
    """A name per optimizer group as DeepSpeed holds them (after dropping empty ones and splitting
    the experts' off), in order: our `kind` and DeepSpeed's `name`, which is the expert-parallel
    group's for every split-off expert group (so the kind tells them apart)."""
    names = [f"{g.get('kind')}/{g.get('name', i)}" for i, g in enumerate(optimizer.optimizer.param_groups)]
    if len(set(names)) != len(names):
        raise ValueError(f"stage_norm: optimizer groups are not told apart by kind and name: {names}")
    return names


def install(optimizer) -> None:
    """Key `optimizer`'s (a DeepSpeedZeroOptimizer) gradient norm by group name across the
    model-parallel group (which spans the pipeline stages)."""
    from deepspeed.runtime.utils import combine_grad_norm_groups, is_model_parallel_parameter

    names = group_names(optimizer)
    group = optimizer.model_parallel_group
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, names, group=group)
    union = sorted(set().union(*every))
    index = [union.index(n) for n in names]

    def scaled_global_norm(self, norm_type=2):
        assert norm_type == 2, "stage_norm: the L2 norm"
        device = self.device  # where DeepSpeed keeps its norms
        squares = torch.zeros(len(union), dtype=torch.float32, device=device)
        for i, params in enumerate(self.params_in_partition):
            # as DeepSpeed: each parameter's norm in get_norm_dtype (fp64), their squares summed
            # there, the sum in fp32 for the all-reduces
            local = torch.zeros((), dtype=get_norm_dtype(), device=device)
            for norm, p in _partition_norms(self, i, params):
                if getattr(p, "ds_pipe_replicated", False):
                    continue
                if is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
                    local = local + norm.to(device=device, dtype=get_norm_dtype()).square()
            local = local.float()
            dist.all_reduce(local, group=self.dp_process_group)  # the partitions of the data-parallel ranks
            squares[index[i]] = local
        dist.all_reduce(squares, group=group)  # one sum over TP and the stages, whatever groups they hold
        norms = []
        for i in range(len(self.params_in_partition)):
            norm = squares[index[i]].sqrt()
            norm = torch.where(torch.isfinite(norm), norm, torch.full_like(norm, -1.0))  # DeepSpeed's sentinel
            if not self.cpu_offload and self._muon_update_lacks_loss_scale(i):  # as DeepSpeed's offload path
                norm = torch.where(norm >= 0, norm * self.loss_scale, norm)
            norms.append(norm)
        if self.has_moe_layers:
            self._average_expert_grad_norms(norms)
        final = torch.zeros(len(union), dtype=torch.float32, device=device)
        for i, norm in enumerate(norms):  # an invalid norm stays invalid through the max
            final[index[i]] = torch.where(norm >= 0, norm.square(), torch.full_like(norm, float("inf")))
        dist.all_reduce(final, op=dist.ReduceOp.MAX, group=group)
        return combine_grad_norm_groups(list(final.sqrt()), norm_type=norm_type)

    optimizer.scaled_global_norm = types.MethodType(scaled_global_norm, optimizer)


def _partition_norms(optimizer, i: int, params):
    """(the L2 norm of this rank's gradient partition of a parameter, the parameter) for group `i`:
    computed from the averaged gradients, or under CPU offload the norms DeepSpeed recorded while
    copying them to the CPU (its complete_grad_norm_calculation_for_cpu_offload reads the same;
    a parameter without one had no gradient)."""
    if optimizer.cpu_offload:
        recorded = optimizer.norm_for_param_grads
        for p in params:
            norm = recorded.get(optimizer.get_param_id(p))
            if norm is not None:
                yield norm, p
        return
    grads = (g for g in optimizer.averaged_gradients[i] if not getattr(g, "_zero_padding", False))
    for g, p in zip(grads, params):
        yield torch.linalg.vector_norm(g.detach().to(get_norm_dtype())), p
