"""Move weights between one full (single-process) state dict and any TP/EP/ETP/PP layout.

A full state dict names experts by their global index (`local_experts.<global>`) and holds
unsplit tensors; a rank's model holds its local experts and its TP shards. The rules come from
the attributes megatron-core puts on parameters (`tensor_model_parallel`, `partition_dim`) plus
two layouts it leaves implicit:
  - a SwiGLU fc1 weight is [gate; up] on every rank, so a TP shard is [gate_t; up_t];
  - κ's α, b are [local experts, ffn / ETP]: rows follow EP, columns follow expert TP;
  - a pipeline stage numbers its layers from 0 (`decoder.layers.<i>`); the full model's number is
    i plus the stage's first layer (`layer_offset`).
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_kappa.config import ConfigError
from megatron_kappa.model.layout import layer_offset, shift_layers
from megatron_kappa.model.params import is_expert as _is_expert
from megatron_kappa.model.params import is_kappa as _is_kappa

_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _stage() -> tuple[int, int]:
    """(pipeline stage, stages) of this rank."""
    return ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()


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


def global_name(model, name: str) -> str:
    """The full model's name of this rank's state entry `name` (its expert index and layer number)."""
    return shift_layers(_global_name(name, ps.get_expert_model_parallel_rank(), _num_local_experts(model)),
                        layer_offset(model))


def local_shard(full_state: dict, name: str, local: torch.Tensor, model, split_dim="local") -> torch.Tensor:
    """This rank's piece of the full tensor that corresponds to local parameter `name` (split
    along `split_dim` by TP: by default what megatron marked on `local`)."""
    if split_dim == "local":
        split_dim = local.partition_dim if getattr(local, "tensor_model_parallel", False) else None
    num_local, ep_rank = _num_local_experts(model), ps.get_expert_model_parallel_rank()
    key = global_name(model, name)
    if key not in full_state:
        raise KeyError(f"full state dict has no '{key}' (for local '{name}')")
    tensor = full_state[key]
    if _is_kappa(name):
        tensor = tensor[ep_rank * num_local: (ep_rank + 1) * num_local]
    if split_dim is not None:
        _, rank, size = _tp(name)
        tensor = _tp_pieces(tensor, name, split_dim, size)[rank]
    if tensor.shape != local.shape:
        raise ValueError(f"'{name}': full-layout shard has shape {tuple(tensor.shape)}, "
                         f"the local parameter {tuple(local.shape)}")
    return tensor


@torch.no_grad()
def load_full_state_dict(model, full_state: dict, source: str | None = None):
    """Copy a single-process state dict into this rank's (sharded) model. With `source` (the flag
    or key that named the file), a tensor it lacks or of another shape is one ConfigError line
    naming it, as the user's input; without, the library's error."""
    for name, tensor in _state(model).items():
        try:
            tensor.copy_(local_shard(full_state, name, tensor, model))
        except (KeyError, ValueError, RuntimeError) as e:
            if source is None:
                raise
            why = str(e.args[0] if isinstance(e, KeyError) and e.args else e).splitlines()[0]
            raise ConfigError(f"{source}: does not hold this model's weights: {why}") from None


def read_full_state_dict(path, source: str, map_location="cpu") -> dict:
    """A consolidated state dict file (launch/consolidate.py's, or train.init_weights'), memory-
    mapped; a file that is not one is one ConfigError line naming `source`."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    except FileNotFoundError:
        raise ConfigError(f"{source}: {path}: no such file") from None
    except Exception as e:  # a pickle of something else, a truncated or a junk file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{source}: {path}: not a state dict file ({first[:200]})") from None
    if not isinstance(state, dict) or not any(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{source}: {path}: not a state dict file (expected a dict of tensors, got "
                          f"{type(state).__name__}{' without tensors' if isinstance(state, dict) else ''})")
    return state


def full_names(model) -> set[str]:
    """The full model's names of every parameter and buffer this rank holds (what it needs from
    a full state dict: `consolidate(..., wanted=full_names(model))`)."""
    return {global_name(model, n) for n in _state(model)}


def local_parameters(model, full_state: dict) -> dict:
    """{parameter name: this rank's shard, shaped like the parameter} from a full state dict of
    any per-parameter quantity (e.g. an optimizer moment in fp32, keeping its dtype), for the
    parameters it covers."""
    shards = {}
    for name, param in model.named_parameters():
        try:
            pieces = [local_shard(full_state, state_name, view, model, split_dim=dim)
                      for state_name, view, dim in _per_expert(name, param, param.detach())]
        except KeyError:  # not a quantity this parameter has (e.g. Muon's momentum of an AdamW one)
            continue
        shards[name] = pieces[0] if getattr(param, "expert_stack", None) is None else torch.stack(pieces)
    return shards


@torch.no_grad()
def load_local_state(model, state: dict):
    """Copy a state of this rank's own layout (e.g. from local_state) into the model."""
    for name, tensor in _state(model).items():
        if name not in state:
            raise KeyError(f"state has no '{name}' for this rank")
        tensor.copy_(state[name])


def _per_expert(name: str, param, tensor: torch.Tensor):
    """(name, tensor, TP split dim) of a parameter, or of each expert's slice of a stacked one
    (grouped experts), under megatron's per-expert name."""
    dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
    stack = getattr(param, "expert_stack", None)
    if stack is None:
        return [(name, tensor, dim)]
    prefix = name.rsplit(".", 1)[0]
    return [(f"{prefix}.local_experts.{i}.{stack}", tensor[i], None if dim is None else dim - 1)
            for i in range(tensor.shape[0])]


def gather_full(model, tensors: dict | None = None) -> dict:
    """The full-layout version of `tensors` (local name → tensor; default: the parameters).

    Collective: every rank of the world must call it; every rank gets the full result. Use it
    with `{n: p.grad for n, p in model.named_parameters()}` to gather gradients. With pipeline
    stages each stage's part is gathered, then the parts are exchanged over the pipeline group.
    """
    params = dict(model.named_parameters())
    tensors = {n: p.detach() for n, p in params.items()} if tensors is None else tensors
    num_local = _num_local_experts(model)
    ep_group, ep_size = ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_world_size()
    full = {}
    for param_name, param in params.items():  # same order on every rank
        for name, t, dim in _per_expert(param_name, param, tensors[param_name]):
            t = t.contiguous()
            if dim is not None:
                group, _, size = _tp(name)
                if size > 1:
                    pieces = [torch.empty_like(t) for _ in range(size)]
                    dist.all_gather(pieces, t, group=group)
                    t = _tp_join(pieces, name, dim)
            if not _is_expert(name) or ep_size == 1:
                full[_global_name(name, 0, num_local)] = t
                continue
            pieces = [torch.empty_like(t) for _ in range(ep_size)]
            dist.all_gather(pieces, t, group=ep_group)
            _place_expert_pieces(full, name, pieces, num_local)
    stages = ps.get_pipeline_model_parallel_world_size()
    if stages == 1:
        return full
    offset = layer_offset(model)
    mine = {shift_layers(n, offset): t.cpu() for n, t in full.items()}
    every = [None] * stages
    dist.all_gather_object(every, mine, group=ps.get_pipeline_model_parallel_group())
    device = next(iter(full.values())).device
    return {n: t.to(device) for part in every for n, t in part.items()}


def _place_expert_pieces(full: dict, name: str, per_ep: list[torch.Tensor], num_local: int):
    """Put one local expert parameter's per-EP-rank tensors into the full state dict."""
    if _is_kappa(name):  # [local experts, F]: EP ranks stack along the expert dim
        full[name] = torch.cat(per_ep, dim=0)
    else:
        for ep_rank, piece in enumerate(per_ep):
            full[_global_name(name, ep_rank, num_local)] = piece


def rank_coords(model) -> dict:
    """Where this rank's tensors sit in the full layout, and which of them it owns (saved with
    checkpoints, so that consolidation needs no process group)."""
    return {
        "pp": list(_stage()), "layer_offset": layer_offset(model),
        "tp": [ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()],
        "ep": [ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()],
        "etp": [ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()],
        # the context-parallel ranks are replicas too (megatron's data-parallel group with CP)
        "dp": [ps.get_data_parallel_rank(with_context_parallel=True),
               ps.get_data_parallel_world_size(with_context_parallel=True)],
        "edp": [ps.get_expert_data_parallel_rank(), ps.get_expert_data_parallel_world_size()],
        "num_local_experts": _num_local_experts(model),
        "split_dim": {n: (p.partition_dim if getattr(p, "tensor_model_parallel", False) else None)
                      for n, p in _state(model).items()},
    }


def _state(model) -> dict:
    """Parameters and persistent buffers by name (megatron's empty `_extra_state` entries left out)."""
    return {n: t for n, t in model.state_dict(keep_vars=True).items()
            if t is not None and not n.endswith("_extra_state")}


def _owns(coords: dict, name: str) -> bool:
    """Data-parallel replicas hold the same tensor; the one at DP rank 0 (expert-DP rank 0 for
    expert tensors) is its owner."""
    return (coords["edp"] if _is_expert(name) else coords["dp"])[0] == 0


def owned_state(model) -> dict:
    """This rank's parameters and buffers that no other rank stores (see _owns): saving these on
    every rank stores each weight exactly once."""
    coords = rank_coords(model)
    return {n: t.detach() for n, t in _state(model).items() if _owns(coords, n)}


def global_numel(name: str, param) -> int:
    """Elements of the full tensor(s) this local parameter is a piece of, divided among the
    ranks that hold distinct pieces: summing it over one rank's parameters gives the full model."""
    n = param.numel()
    if getattr(param, "tensor_model_parallel", False):
        n *= _tp(name)[2]
    if _is_expert(name):
        n *= ps.get_expert_model_parallel_world_size()
    return n


def consolidate(ranks: list[tuple[dict, dict]], wanted=None) -> dict:
    """Full state dict from every rank's (coords, owned state), offline (no process group): each
    pipeline stage's layers are assembled from that stage's ranks, then renamed to the full
    model's layer numbers. `wanted` (a set of full names, or a predicate on them; default all):
    only those are assembled, so only their pieces are read (from memory-mapped checkpoint files:
    the rest stays on disk)."""
    if wanted is not None and not callable(wanted):
        wanted = wanted.__contains__
    full = {}
    for stage in sorted({_pp(c)[0] for c, _ in ranks}):
        members = [(c, s) for c, s in ranks if _pp(c)[0] == stage]
        offset = members[0][0].get("layer_offset", 0)
        full.update(_consolidate_stage(members, offset, wanted))
    return full


def _pp(coords: dict) -> list[int]:
    return coords.get("pp", [0, 1])  # checkpoints from before pipeline stages: one stage


def _consolidate_stage(ranks: list[tuple[dict, dict]], offset: int, wanted) -> dict:
    """The full-TP/EP state of one pipeline stage, under the full model's names."""
    coords0 = ranks[0][0]
    present = set().union(*(s.keys() for _, s in ranks))  # e.g. an optimizer state: parameters only
    names = [n for n in coords0["split_dim"] if n in present]  # every parameter and buffer, in model order
    dense = {c["tp"][0]: s for c, s in ranks if c["dp"][0] == 0}
    experts = {(c["ep"][0], c["etp"][0]): s for c, s in ranks if c["edp"][0] == 0}
    tp_size, ep_size, etp_size = coords0["tp"][1], coords0["ep"][1], coords0["etp"][1]
    num_local = coords0["num_local_experts"]
    full = {}
    for name in names:
        dim = coords0["split_dim"][name]
        if not _is_expert(name):
            if wanted is not None and not wanted(shift_layers(name, offset)):
                continue
            pieces = [dense[r][name] for r in range(tp_size)]
            full[shift_layers(name, offset)] = pieces[0] if dim is None else _tp_join(pieces, name, dim)
            continue
        if wanted is not None and not any(wanted(shift_layers(_global_name(name, ep, num_local), offset))
                                          for ep in range(ep_size)):
            continue
        per_ep = []
        for ep in range(ep_size):
            if (wanted is not None and not _is_kappa(name)
                    and not wanted(shift_layers(_global_name(name, ep, num_local), offset))):
                per_ep.append(None)  # another rank's experts: not read
                continue
            pieces = [experts[(ep, t)][name] for t in range(etp_size)]
            per_ep.append(pieces[0] if dim is None else _tp_join(pieces, name, dim))
        staged = {}
        _place_expert_pieces(staged, name, per_ep, num_local)
        full.update({shift_layers(n, offset): t for n, t in staged.items() if t is not None})
    return full


def local_state(ranks: list[tuple[dict, dict]], coords: dict) -> dict:
    """The state (parameters, buffers) of the rank at `coords`, in the checkpoint's layout,
    collected from its owners' files."""
    state = {}
    for c, owned in ranks:
        if _pp(c)[0] != _pp(coords)[0]:
            continue
        same_dense = c["tp"][0] == coords["tp"][0] and c["dp"][0] == 0
        same_experts = (c["ep"][0], c["etp"][0]) == (coords["ep"][0], coords["etp"][0]) and c["edp"][0] == 0
        for name, tensor in owned.items():
            if (same_experts if _is_expert(name) else same_dense):
                state[name] = tensor
    return state
