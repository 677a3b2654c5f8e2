"""Move weights between one full (single-process) state dict and any TP/EP/ETP layout.

A full state dict names experts by their global index (`local_experts.<global>`) and holds
unsplit tensors; a rank's model holds its local experts and its TP shards. The rules come from
the attributes megatron-core puts on parameters (`tensor_model_parallel`, `partition_dim`) plus
two layouts it leaves implicit:
  - a SwiGLU fc1 weight is [gate; up] on every rank, so a TP shard is [gate_t; up_t];
  - κ's α, b are [local experts, ffn / ETP]: rows follow EP, columns follow expert TP.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _is_kappa(name: str) -> bool:
    return name.endswith(("experts.kappa_alpha", "experts.kappa_bias"))


def _is_glu_fc1(name: str) -> bool:
    return name.endswith("linear_fc1.weight")


def _tp(name: str):
    """(group, rank, size) of the tensor-parallel group that splits this parameter."""
    if _is_expert(name):
        return (ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_rank(),
                ps.get_expert_tensor_parallel_world_size())
    return (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size())


def _num_local_experts(model) -> int:
    return model.config.num_moe_experts // ps.get_expert_model_parallel_world_size()


def _global_name(name: str, ep_rank: int, num_local: int) -> str:
    return _LOCAL_EXPERT.sub(lambda m: f".local_experts.{ep_rank * num_local + int(m.group(1))}.", name)


def _tp_pieces(full: torch.Tensor, name: str, dim: int, size: int) -> list[torch.Tensor]:
    if _is_glu_fc1(name):
        gate, up = full.chunk(2, dim=dim)
        return [torch.cat(pair, dim=dim) for pair in zip(gate.chunk(size, dim), up.chunk(size, dim))]
    return list(full.chunk(size, dim=dim))


def _tp_join(pieces: list[torch.Tensor], name: str, dim: int) -> torch.Tensor:
    if _is_glu_fc1(name):
        halves = [p.chunk(2, dim=dim) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(pieces, dim=dim)


def local_shard(full_state: dict, name: str, local: torch.Tensor, model) -> torch.Tensor:
    """This rank's piece of the full tensor that corresponds to local parameter `name`."""
    num_local, ep_rank = _num_local_experts(model), ps.get_expert_model_parallel_rank()
    key = _global_name(name, ep_rank, num_local)
    if key not in full_state:
        raise KeyError(f"full state dict has no '{key}' (for local '{name}')")
    tensor = full_state[key]
    if _is_kappa(name):
        tensor = tensor[ep_rank * num_local: (ep_rank + 1) * num_local]
    if getattr(local, "tensor_model_parallel", False):
        _, rank, size = _tp(name)
        tensor = _tp_pieces(tensor, name, local.partition_dim, size)[rank]
    if tensor.shape != local.shape:
        raise ValueError(f"'{name}': full-layout shard has shape {tuple(tensor.shape)}, "
                         f"the local parameter {tuple(local.shape)}")
    return tensor


@torch.no_grad()
def load_full_state_dict(model, full_state: dict):
    """Copy a single-process state dict into this rank's (sharded) model."""
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor is None or name.endswith("_extra_state"):
            continue
        tensor.copy_(local_shard(full_state, name, tensor, model))


def gather_full(model, tensors: dict | None = None) -> dict:
    """The full-layout version of `tensors` (local name → tensor; default: the parameters).

    Collective: every rank of the world must call it; every rank gets the full result. Use it
    with `{n: p.grad for n, p in model.named_parameters()}` to gather gradients.
    """
    params = dict(model.named_parameters())
    tensors = {n: p.detach() for n, p in params.items()} if tensors is None else tensors
    num_local = _num_local_experts(model)
    ep_group, ep_size = ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_world_size()
    full = {}
    for name, param in params.items():  # same order on every rank
        t = tensors[name].contiguous()
        if getattr(param, "tensor_model_parallel", False):
            group, _, size = _tp(name)
            if size > 1:
                pieces = [torch.empty_like(t) for _ in range(size)]
                dist.all_gather(pieces, t, group=group)
                t = _tp_join(pieces, name, param.partition_dim)
        if not _is_expert(name) or ep_size == 1:
            full[_global_name(name, 0, num_local)] = t
            continue
        pieces = [torch.empty_like(t) for _ in range(ep_size)]
        dist.all_gather(pieces, t, group=ep_group)
        if _is_kappa(name):
            full[name] = torch.cat(pieces, dim=0)
        else:
            for ep_rank, piece in enumerate(pieces):
                full[_global_name(name, ep_rank, num_local)] = piece
    return full
