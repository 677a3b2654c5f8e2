"""The optimizer state by parameter: ZeRO's flat partitions as tensors shaped like the parameters,
so that a checkpoint loads into any layout.

DeepSpeed's ZeRO-1/2 (runtime/zero/stage_1_and_2.py, 0.19.8) keeps per parameter group one flat
fp32 partition per data-parallel rank (`single_partition_of_fp32_groups`) and the base optimizer's
state for it: AdamW's `exp_avg`, `exp_avg_sq` (flat, like the partition) and `step`; Muon's
`momentum_buffer`, which is not flat like the partition but holds the WHOLE momentum of every
parameter that overlaps the partition, one after the other (`params_in_partition`; the ranks
sharing a parameter hold the same copy). Every parameter carries DeepSpeed's `_hp_mapping`
(deepspeed.utils.tensor_fragment) on the ranks whose partition it overlaps: which elements of it
(`lp_fragment_address`) sit where in the partition (`hp_fragment_address`), and `_dp_group`.

`by_parameter` turns that into {kind: {name: tensor}} for the parameters this rank owns (the
same owners as the weights, megatron_kappa.parallel.sharding.owned_state): one all-reduce per
parameter over its data-parallel group (each rank adds its fragment into zeros: no gather to one
process), so the files hold every parameter's fp32 master copy and moments once, named and shaped
like the weights. `restore` writes them back into the flat partitions of an engine of any layout:
each rank takes from the full tensors (sharding.consolidate) the fragment its partition holds.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_kappa.parallel import sharding

MASTER = "master"  # ZeRO's fp32 copy of the weights
ADAMW = ("exp_avg", "exp_avg_sq")
MUON = ("momentum_buffer",)


def _zero(engine):
    zero = engine.optimizer
    if not hasattr(zero, "single_partition_of_fp32_groups"):
        raise TypeError(f"checkpoint: expected DeepSpeed's ZeRO-1/2 optimizer, got {type(zero).__name__}")
    return zero


def _groups(zero) -> dict:
    """id(parameter) → its group index in the ZeRO optimizer."""
    return {id(p): i for i, group in enumerate(zero.bit16_groups) for p in group}


def _kinds(zero, group: int) -> tuple[str, ...]:
    return (MASTER, *(MUON if zero.optimizer.param_groups[group].get("use_muon") else ADAMW))


def _momentum_offsets(zero, group: int) -> dict:
    """id(parameter) → where its whole momentum starts in the group's Muon buffer."""
    offsets, at = {}, 0
    for p in zero.params_in_partition[group]:
        offsets[id(p)] = at
        at += p.numel()
    return offsets


def _state(zero, group: int) -> dict:
    return zero.optimizer.state.setdefault(zero.single_partition_of_fp32_groups[group], {})


def _step(zero, group: int) -> float:
    step = zero.optimizer.state.get(zero.single_partition_of_fp32_groups[group], {}).get("step", 0)  # read only
    return float(step.item() if torch.is_tensor(step) else step)


def by_parameter(engine, model) -> tuple[dict, dict]:
    """({kind: {name: fp32 tensor}}, {full name: optimizer step}) for the parameters this rank
    owns, under the weights' (state-dict) names. Collective: every rank of the world calls it."""
    zero = _zero(engine)
    groups, coords = _groups(zero), sharding.rank_coords(model)
    out, steps = {}, {}
    momentum_at = {g: _momentum_offsets(zero, g) for g in range(len(zero.bit16_groups))}
    for name, p in model.named_parameters():  # the same order on every rank of a data-parallel group
        group = groups[id(p)]
        kinds = _kinds(zero, group)
        buf = torch.zeros(len(kinds), p.numel(), dtype=torch.float32, device=p.device)
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is not None:
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            flat, state = zero.single_partition_of_fp32_groups[group], _state(zero, group)
            for row, kind in enumerate(kinds):
                if kind == MASTER:
                    piece = flat.detach().narrow(0, hp.start, hp.numel)
                elif kind in MUON:
                    whole = state.get(kind)  # absent before Muon's first step: zero
                    if whole is None:
                        continue
                    piece = whole.narrow(0, momentum_at[group][id(p)] + lp.start, lp.numel)
                else:
                    piece = state[kind].narrow(0, hp.start, hp.numel)
                buf[row].narrow(0, lp.start, lp.numel).copy_(piece)
        dist.all_reduce(buf, group=p._dp_group)
        if not sharding._owns(coords, name):
            continue
        for row, kind in enumerate(kinds):
            for state_name, tensor, _ in sharding._per_expert(name, p, buf[row].view(p.shape)):
                out.setdefault(kind, {})[state_name] = tensor.clone()
        step = round(_step(zero, group))  # every rank of the group steps its partition: the same
        for state_name, _, _ in sharding._per_expert(name, p, p):
            steps[sharding.global_name(model, state_name)] = step
    return out, steps


@torch.no_grad()
def restore(engine, model, full: dict, steps: dict):
    """Write `full` ({kind: full-layout tensors}, from sharding.consolidate) and the steps into
    the engine's flat partitions, each rank its own fragments; then the weights from the master
    copy. Any layout: the full tensors are cut with this rank's coordinates."""
    zero = _zero(engine)
    groups = _groups(zero)
    momentum_at = {g: _momentum_offsets(zero, g) for g in range(len(zero.bit16_groups))}
    for kind, tensors in full.items():
        shards = sharding.local_parameters(model, tensors)
        for name, p in model.named_parameters():
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None or name not in shards:
                continue
            group = groups[id(p)]
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            flat, state = zero.single_partition_of_fp32_groups[group], _state(zero, group)
            shard = shards[name].reshape(-1)
            if kind == MASTER:
                flat.data.narrow(0, hp.start, hp.numel).copy_(shard.narrow(0, lp.start, lp.numel))
            elif kind in MUON:
                if kind not in state:
                    total = sum(q.numel() for q in zero.params_in_partition[group])
                    state[kind] = torch.zeros(total, dtype=torch.float32, device=flat.device)
                state[kind].narrow(0, momentum_at[group][id(p)], p.numel()).copy_(shard)
            else:
                if kind not in state:
                    state[kind] = torch.zeros_like(flat)
                state[kind].narrow(0, hp.start, hp.numel).copy_(shard.narrow(0, lp.start, lp.numel))
    for name, p in model.named_parameters():
        group = groups[id(p)]
        if getattr(p, "_hp_mapping", None) is None or zero.optimizer.param_groups[group].get("use_muon"):
            continue
        step = steps[sharding.global_name(model, next(n for n, _, _ in sharding._per_expert(name, p, p)))]
        state = _state(zero, group)
        if torch.is_tensor(state.get("step")):
            state["step"].fill_(float(step))
        else:
            state["step"] = torch.tensor(float(step))
    zero.update_lp_params()
