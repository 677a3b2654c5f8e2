"""Bytes of the training state one rank holds under DeepSpeed's bf16 ZeRO-1/2 as this project
configures it (megatron_kappa.parallel.engine.ds_config): weights, gradients at their two peaks
(summed in bf16 or, train.grad_accum_dtype's default, in fp32), the fp32 master copy, the
optimizer moments (Muon's momentum with the copy ZeRO stages it in) and the reduce bucket."""
from __future__ import annotations

from megatron_kappa.config import Config, ModelConfig, TrainConfig
from megatron_kappa.plan.layout import Layout
from megatron_kappa.plan.params import EXPERT_KINDS, largest_tensors
from megatron_kappa.plan.planned import Planned
from megatron_kappa.plan.units import value_bytes

REDUCE_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements)


def fp32_accumulation(precision: str, grad_accum_dtype: str) -> bool:
    """bf16/fp8 weights whose gradients are summed and reduced in fp32 (train.grad_accum_dtype;
    the trainer's megatron_kappa.parallel.grad_precision.fp32_accumulation, restated here because
    the planner loads no torch)."""
    return precision in ("bf16", "fp8") and grad_accum_dtype == "fp32"


def reduced_bytes(precision: str, grad_accum_dtype: str) -> int:
    """Bytes of one gradient value as ZeRO accumulates and reduces it: 4 under fp32 accumulation
    (DeepSpeed's grad_accum_dtype and communication_data_type fp32), else the weights' (2 in bf16
    and fp8, 4 in fp32). Muon's momentum takes the same dtype (muon_momentum_bytes)."""
    return 4 if fp32_accumulation(precision, grad_accum_dtype) else value_bytes(precision)


def optimizer_groups(params: dict[str, int], m: ModelConfig, train: TrainConfig, layout: Layout) -> list[dict]:
    """DeepSpeed's parameter groups on one rank, as this project forms them
    (megatron_kappa.optim.optimizer.param_groups, then DeepSpeed's split of the experts into
    groups of their own when they are reduced over the expert-data-parallel group, i.e. when
    EP > 1 or ETP != TP): each group's elements, the data-parallel size `d` that partitions it,
    its largest tensor and whether Muon/Aurora update it (`muon`: the matrices and the experts
    under muon/aurora)."""
    apart = layout.ep > 1 or layout.etp != layout.tp
    routers_apart = train.optimizer != "adamw" and train.router_optimizer != "matrix"
    members = {"matrix": ["attention", "dense_mlp", "shared_experts"] + ([] if routers_apart else ["router"])
               + ([] if apart else ["experts"]),
               "experts": ["experts"] if apart else [], "router": ["router"] if routers_apart else [],
               "embedding": ["embedding", "value_embedding"], "output": ["output"], "norm": ["norm"],
               "kappa": ["kappa"]}
    largest = largest_tensors(m, layout)
    out = []
    for name, kinds in members.items():
        n = sum(params.get(k, 0) for k in kinds)
        if n:
            d = layout.edp if apart and name in ("experts", "kappa") else layout.zero_dp
            out.append({"name": name, "elements": n, "d": d,
                        "largest": min(n, max(largest[k] for k in kinds if params.get(k, 0))),
                        "muon": train.optimizer != "adamw" and name in ("matrix", "experts")})
    return out


def gradient_bytes(params: dict[str, int], cfg: Config, layout: Layout, planned: Planned = Planned()) -> dict[str,
                                                                                                              float]:
    """The gradient memory DeepSpeed's ZeRO-1/2 holds on one rank with this project's settings
    (contiguous_gradients, reduce_scatter, no overlap_comm: megatron_kappa.parallel.engine), at
    its two peaks. Each group's gradient partition holds its elements / d; where ZeRO copies
    whole tensors into it, the partition's two edges can add up to two tensors ("edges"; none
    when d is 1). With bf16 accumulation (fp32 weights: the same, in fp32):
      backward  ZeRO-1: autograd's full gradients, until the boundary moves them through the
                reduce bucket (DeepSpeed's reduce_gradients). ZeRO-2: the partitions, filled
                bucket by bucket as backward runs, and the tensor just produced.
      step      the partitions with their edges, and the fp32 gradient of the group being
                stepped (DeepSpeed steps the groups one at a time: the largest group's
                partition is the peak, "largest_group").
    With fp32 accumulation (`fp32_accumulation`, megatron_kappa.parallel.grad_precision): every
    partition is fp32 (4 bytes); the AdamW groups' partitions are ZeRO's exact fp32 slices
    (no edges), which their step reads in place (no copy); the Muon/Aurora groups' keep
    whole tensors (edges) and are copied at their step, as with bf16 ("largest_group": the
    largest of those, 0 when there are none).
      backward  ZeRO-1: an fp32 accumulator for every parameter (grad_accum), and the bf16
                gradient just produced, while it is added into its accumulator. A partition
                larger than one reduce bucket: at the boundary the fp32 partitions are made
                while the accumulators past the first bucket still exist (from DeepSpeed's
                code; the runs measured fit one bucket). ZeRO-2: the fp32 partitions and the
                bf16 tensor just produced.
      step      the fp32 partitions, with the Muon groups' edges and the copy of the largest;
                ZeRO-1 also holds a second fp32 copy of the Muon groups' partitions with their
                edges, made as it flattens them at the boundary (DeepSpeed's get_flat_partition
                runs the Muon update there). An upper bound where groups' order frees some
                partitions first (they are released group by group as each steps).
    The reduce bucket (`bucket_bytes`) comes on top during backward. With the optimizer offloaded
    (planned only) the step's fp32 gradient is made in CPU memory: the step holds the partitions."""
    size = value_bytes(cfg.precision)
    fp32 = fp32_accumulation(cfg.precision, cfg.train.grad_accum_dtype)
    grad = reduced_bytes(cfg.precision, cfg.train.grad_accum_dtype)  # bytes of an accumulated gradient
    groups = optimizer_groups(params, cfg.model, cfg.train, layout)
    copied = [g for g in groups if g["muon"] or not fp32]  # whole tensors in the partition, a copy at the step
    partitions = sum(g["elements"] / g["d"] for g in groups)
    edges = sum(_edges(g) for g in copied)
    largest_group = max((g["elements"] / g["d"] for g in copied), default=0)
    muon_share = sum(g["elements"] / g["d"] for g in copied) if fp32 and cfg.zero.stage == 1 else 0
    # ZeRO-1's second copy (fp32 accumulation; offloaded, the update runs on the CPU's copy: not measured)
    updates = grad * (muon_share + edges) if muon_share and not planned.offload_optimizer else 0
    step = grad * (partitions + edges) + updates + 4 * largest_group * (not planned.offload_optimizer)
    produced = size * max((g["largest"] for g in groups), default=0)  # autograd's gradient of one tensor
    if cfg.zero.stage == 1 and fp32:
        backward = grad * sum(params.values()) + max(produced, grad * (partitions - REDUCE_BUCKET_ELEMENTS))
    elif cfg.zero.stage == 1:
        backward = size * sum(params.values())
    else:
        backward = grad * (partitions + edges) + produced
    return {"backward": backward, "step": step, "partitions": grad * partitions, "edges": grad * edges,
            "largest_group": largest_group, "muon_updates": updates}


def _edges(group: dict) -> float:
    """Elements of whole tensors beyond a group's partition (ZeRO copies a tensor that straddles the
    partition's edge whole): at most two tensors, at most the rest of the group."""
    return min(group["elements"] - group["elements"] / group["d"], 2 * group["largest"])


def muon_momentum_bytes(params: dict[str, int], m: ModelConfig, train: TrainConfig, precision: str, layout: Layout,
                        planned: Planned = Planned()) -> dict[str, float]:
    """The momentum DeepSpeed 0.19.8's ZeRO-1/2 keeps for the Muon/Aurora groups on one rank
    (runtime/zero/stage_1_and_2.py): "committed", the optimizer state's flat momentum_buffer over
    every whole tensor with elements in the rank's partition (the partition and its edges), in
    the gradients' dtype (reduced_bytes: fp32 under fp32 accumulation, bf16 with bf16
    accumulation; _muon_momentum_buffer sizes it so), and "staged", the copy of the same size the
    boundary's Muon update writes into (_muon_staging_momentum) and step() commits once the step
    survives; it is kept between steps, so both are held from the first step on. κ's α under
    model.kappa.alpha_optimizer matrix is among the matrices (its edges not counted: α's
    tensors are small). Planned only: bf16 moments (2 bytes); the optimizer offloaded, the
    momentum is the fp32 partition in CPU memory, no staging ("offloaded", not on the GPU). 0
    under adamw."""
    if train.optimizer == "adamw":
        return {"committed": 0.0, "staged": 0.0, "offloaded": 0.0}
    muon = [g for g in optimizer_groups(params, m, train, layout) if g["muon"]]
    k = m.kappa
    alpha = 0.0
    if k.alpha_optimizer == "matrix" and k.use_alpha and params.get("kappa"):
        d = layout.edp if layout.ep > 1 or layout.etp != layout.tp else layout.zero_dp
        alpha = params["kappa"] * k.use_alpha / (k.use_alpha + k.use_bias) / d
    if planned.offload_optimizer:
        partition = sum(g["elements"] / g["d"] for g in muon) + alpha
        return {"committed": 0.0, "staged": 0.0, "offloaded": 4 * partition}
    elements = sum(g["elements"] / g["d"] + _edges(g) for g in muon) + alpha
    size = 2 if planned.optimizer_states == "bf16" else reduced_bytes(precision, train.grad_accum_dtype)
    return {"committed": size * elements, "staged": size * elements, "offloaded": 0.0}


def state_bytes(params: dict[str, int], cfg: Config, layout: Layout, planned: Planned = Planned()) -> dict[str, float]:
    """Bytes of weights, gradients (the larger of `gradient_bytes`'s two peaks), the fp32 master
    copy and the optimizer moments on one rank under DeepSpeed's ZeRO-`zero.stage`.

    bf16/fp8: bf16 weights; the master copy (fp32) and the moments are partitioned over the
    data-parallel group of each parameter: DP for the dense ones, EDP for the experts. fp32: fp32
    weights and gradients, no master copy. Moments: AdamW 2 fp32 per parameter; muon and aurora
    keep a momentum for the matrices they orthogonalise (the optimizer groups' Muon ones:
    attention, MLPs, experts; the routers under train.router_optimizer matrix; κ's α under
    model.kappa.alpha_optimizer matrix) with its staged copy (muon_momentum_bytes: the whole
    tensors of the partition, in the gradients' dtype, twice) and AdamW's two for the rest.
    Planned only (`planned`): the moments in bf16 (2 bytes each); the master copy and moments
    offloaded to the CPU ("offloaded", not on the GPU)."""
    half = value_bytes(cfg.precision) == 2
    moment_bytes = 2 if planned.optimizer_states == "bf16" else 4
    grads = gradient_bytes(params, cfg, layout, planned)
    out = dict(weights=0.0, gradients=max(grads["backward"], grads["step"]), master=0.0, moments=0.0)
    # the kinds Muon/Aurora update, as the optimizer groups hold them (their moments: muon_momentum_bytes)
    groups = {g["name"] for g in optimizer_groups(params, cfg.model, cfg.train, layout) if g["muon"]}
    matrices = {"attention", "dense_mlp", "shared_experts"} | ({"experts"} if groups else set()) | (
        {"router"} if "matrix" in groups and cfg.train.router_optimizer == "matrix" else set())
    k = cfg.model.kappa  # "kappa" counts α and b alike; α's share is orthogonalised with `matrix`
    alpha_share = (k.use_alpha / (k.use_alpha + k.use_bias)
                   if groups and k.alpha_optimizer == "matrix" and k.use_alpha else 0.0)
    for kind, n in params.items():
        d = layout.edp if kind in EXPERT_KINDS else layout.zero_dp
        out["weights"] += value_bytes(cfg.precision) * n
        out["master"] += 4 * n / d if half else 0
        if groups and kind in matrices:
            moments = 0  # Muon's momentum, below
        elif kind == "kappa":
            moments = 2 - 2 * alpha_share  # b AdamW's two, α Muon's momentum (below)
        else:
            moments = 2
        out["moments"] += moments * moment_bytes * n / d
    muon = muon_momentum_bytes(params, cfg.model, cfg.train, cfg.precision, layout, planned)
    out["moments"] += muon["committed"] + muon["staged"]
    if planned.offload_optimizer:
        out["offloaded"] = out["master"] + out["moments"] + muon["offloaded"]
        out["master"] = out["moments"] = 0.0
    return out


def bucket_bytes(precision: str, grad_accum_dtype: str) -> float:
    """DeepSpeed's reduce bucket: `reduce_bucket_size` (5e8) elements in the dtype gradients are
    reduced in (fp32 under fp32 accumulation), allocated whole at the first gradient of each
    backward pass and released after it (under ZeRO-1 with fp32 accumulation, after the step:
    the accumulators it reduced point into it until then). The updated weights are all-gathered
    in place, so there is no all-gather bucket."""
    return REDUCE_BUCKET_ELEMENTS * reduced_bytes(precision, grad_accum_dtype)
