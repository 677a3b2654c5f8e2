"""The memory planner: what the most-loaded rank of a layout holds, and whether it fits.

    python -m megatron_kappa.plan --config X --world N [--gpu-mem 80] [--gpus-per-node 8] [--search] [--json]

Arithmetic only (no torch, no model): the parameters each rank builds, counted from the shapes
the way megatron-core shards them (tests/test_plan.py checks the counts against meta-device
builds of every rank of a grid of layouts), then bytes for them under DeepSpeed's bf16 ZeRO-1/2
as this project configures it (megatron_kappa.parallel.engine.ds_config), and an activation
estimate per recompute mode. docs/plan.md says where each number comes from.

Modules:
  __main__.py     `python -m megatron_kappa.plan`: the command line of megatron_kappa.plan
  activations.py  The activations one rank of a pipeline stage keeps for backward: an estimate, per
                  recompute mode
  dualpipe.py     DeepSeek-V3's DualPipe as the planner models it (planned only: the trainer runs
                  1F1B or interleaved 1F1B)
  planned.py      Settings the planner models that the trainer does not run: each is printed as
                  "planned only"
  published.py    The layouts and memory settings the published frontier runs trained with, each
                  with its source: `python -m megatron_kappa.plan --published` plans each one (does
                  it fit?) and ranks it among the layouts `--search` finds at its world size
  search.py       `--search`: the layouts that fit, fastest first, each at its fastest micro-batch
                  and recompute mode (the step-time estimate of megatron_kappa.plan.speed)
  speed.py        A step-time estimate per layout: compute from FLOPs, the pipeline bubble, and the
                  traffic of tensor, expert, pipeline and data parallelism at stated bandwidths
"""
from __future__ import annotations

import dataclasses

from megatron_kappa import routers
from megatron_kappa.config import Config, ConfigError, stage_layout
from megatron_kappa.model.layout import VALUE_GATE_CHANNELS, ModelLayout, has_value_embedding, model_layout
from megatron_kappa.plan import dualpipe, speed
from megatron_kappa.plan.planned import Planned
from megatron_kappa.plan.activations import activation_bytes  # noqa: E402 (re-exported)

GIB = 2 ** 30
# norm: also model.residual_scalars' λ; attention: also the value-embedding gates
KINDS = ("embedding", "output", "value_embedding", "attention", "dense_mlp", "shared_experts", "router",
         "experts", "kappa", "norm")
EXPERT_KINDS = ("experts", "kappa")  # reduced over the expert-data-parallel group
REDUCE_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements)
HEADROOM = 0.9  # a layout fits when the estimate stays under this share of the GPU's memory


@dataclasses.dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1  # context parallelism: planned only (megatron_kappa.plan.planned)
    vpp: int = 1  # virtual pipeline stages per rank (parallel.vpp: interleaved 1F1B)

    @property
    def dp(self) -> int:
        """Data-parallel size: replicas of the model, each with its own micro-batches."""
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def zero_dp(self) -> int:
        """The group dense gradients are reduced over and ZeRO partitions over: DP × CP (megatron's
        data-parallel group with context parallelism; the CP ranks hold the same weights)."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Data-parallel size of the experts (megatron's expert-data-parallel group)."""
        return self.world // (self.ep * self.etp * self.pp)

    def label(self) -> str:
        extra = f" CP{self.cp}" * (self.cp > 1) + f" VPP{self.vpp}" * (self.vpp > 1)
        # a world the layout does not divide has no data-parallel size: "?" rather than a floor of 0
        dp = self.dp if self.world % (self.tp * self.pp * self.cp) == 0 else "?"
        edp = self.edp if self.world % (self.ep * self.etp * self.pp) == 0 else "?"
        return f"TP{self.tp} PP{self.pp}{extra} EP{self.ep} ETP{self.etp} DP{dp} (EDP{edp})"


def layout_of(cfg: Config, world: int) -> Layout:
    par = cfg.parallel
    return Layout(world=world, tp=par.tp, pp=par.pp, ep=par.ep, etp=par.expert_tp, vpp=par.vpp)


def with_layout(cfg: Config, layout: Layout) -> Config:
    """`cfg` in `layout`; the config's uneven stage split only for its own number of stages (its
    layout string also for its own virtual stages; other virtual stages are the planner's sums)."""
    same_pp = layout.pp == cfg.parallel.pp
    same_chunks = same_pp and layout.vpp == cfg.parallel.vpp
    par = dataclasses.replace(cfg.parallel, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp,
                              first_stage_layers=cfg.parallel.first_stage_layers if same_pp else None,
                              last_stage_layers=cfg.parallel.last_stage_layers if same_pp else None,
                              layout=cfg.parallel.layout if same_chunks else None,
                              vpp=cfg.parallel.vpp if same_chunks else 1)
    return dataclasses.replace(cfg, parallel=par)


def model_shape(cfg: Config, layout: Layout) -> ModelLayout:
    """The model's layout (MoE layers, stages, the vocabulary padded for this TP) under `layout`."""
    return model_layout(with_layout(cfg, layout))


def check(cfg: Config, layout: Layout):
    """One-line errors for a layout the model cannot be split by: the trainer's own checks of the
    config under this layout, and of the layout against the world size."""
    from megatron_kappa.config.checks import validate
    from megatron_kappa.parallel.layout import check_layout
    moe, shape = cfg.model.moe, model_layout(cfg)
    if not routers.lookup(moe.router).planned and shape.has_moe:
        raise ConfigError(f"plan: model.moe.router: {moe.router} is not modelled by the planner")
    if layout.world % (layout.tp * layout.pp * layout.cp):  # the factors say it all: no layout label
        raise ConfigError(f"plan: world size {layout.world} is not divisible by tp × pp × cp = "
                          f"{layout.tp} × {layout.pp} × {layout.cp}")
    split = with_layout(cfg, layout)
    try:
        if cfg.model.seq_length % (2 * layout.cp):  # megatron's causal load balance: 2·cp chunks
            raise ConfigError(f"plan: model.seq_length {cfg.model.seq_length} is not divisible by 2 × cp")
        validate(split)
        check_layout(split.parallel, layout.world, shape.experts)  # experts span the CP ranks too (megatron)
        train = cfg.train
        if train.global_batch % (train.micro_batch * layout.dp):
            raise ConfigError(f"plan: train.global_batch {train.global_batch} is not divisible by "
                              f"train.micro_batch × DP = {train.micro_batch} × {layout.dp}")
        if layout.vpp > max(model_shape(cfg, layout).stage_counts()):
            raise ConfigError(f"plan: {layout.vpp} virtual stages but no pipeline stage has that many layers")
    except ConfigError as e:
        raise ConfigError(f"{e} ({layout.label()})") from None


# --- parameters ---------------------------------------------------------------------------------

def mla_matrices(cfg: Config, t: int) -> dict[str, int]:
    """MLA's projections on one rank of TP t (each split over TP by its output, linear_proj by its
    input): elements by megatron's module name."""
    m, a = cfg.model, cfg.model.mla
    h, n = m.hidden_size, m.num_attention_heads
    q = n * (a.qk_head_dim + a.qk_pos_emb_head_dim)
    out = {"linear_q_down_proj": a.q_lora_rank * h // t, "linear_q_up_proj": q * a.q_lora_rank // t} \
        if a.q_lora_rank else {"linear_q_proj": q * h // t}
    out["linear_kv_down_proj"] = (a.kv_lora_rank + a.qk_pos_emb_head_dim) * h // t
    out["linear_kv_up_proj"] = n * (a.qk_head_dim + a.v_head_dim) * a.kv_lora_rank // t
    out["linear_proj"] = h * n * a.v_head_dim // t
    return out


def attention_params(cfg: Config, t: int) -> tuple[int, int]:
    """(attention matrices, q/k norm gains) of one layer on one rank of TP t."""
    m = cfg.model
    if m.mla.enabled:  # the latents' norms: the query's (with a query latent) and the key/value one
        gains = ((m.mla.q_lora_rank or 0) + m.mla.kv_lora_rank) if m.qk_layernorm else 0
        return sum(mla_matrices(cfg, t).values()), gains * m.norm_gains
    h = m.hidden_size
    head_dim = m.head_dim or h // m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    matrices = h * head_dim * (m.num_attention_heads + 2 * groups) // t  # linear_qkv
    matrices += h * head_dim * m.num_attention_heads // t  # linear_proj
    return matrices, (2 * head_dim if m.qk_layernorm else 0) * m.norm_gains


def layer_params(cfg: Config, layout: Layout, is_moe: bool, index: int = 0) -> dict[str, int]:
    """Layer `index`'s (0-based, global) parameters on one rank, by kind (megatron's sharding)."""
    m, moe, t = cfg.model, cfg.model.moe, layout.tp
    h = m.hidden_size
    head_dim = m.head_dim or h // m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    out = dict.fromkeys(KINDS, 0)
    out["attention"], qk_gains = attention_params(cfg, t)
    out["norm"] = 2 * h * m.norm_gains + qk_gains  # input, pre-MLP (q, k or the MLA latents) gains
    out["norm"] += 2 * m.residual_scalars  # λ_resid, λ_x0
    if m.value_embeddings and has_value_embedding(index + 1, m.num_layers):
        # the table [vocab, kv heads · head_dim] and the gate [kv heads, 32], split by kv head
        out["value_embedding"] = model_shape(cfg, layout).padded_vocab * groups * head_dim // t
        out["attention"] += groups * VALUE_GATE_CHANNELS // t
    ffn = m.ffn_hidden_size or 4 * h
    if not is_moe:
        out["dense_mlp"] = 3 * h * ffn // t  # fc1 [gate; up] and fc2
        return out
    local_experts, expert_ffn = moe.num_experts // layout.ep, (moe.ffn_hidden_size or ffn) // layout.etp
    out["router"] = moe.num_experts * h
    out["experts"] = local_experts * 3 * h * expert_ffn
    k = m.kappa
    out["kappa"] = local_experts * expert_ffn * ((k.use_alpha + k.use_bias) if k.enabled else 0)
    if moe.shared_ffn_hidden_size:
        out["shared_experts"] = 3 * h * moe.shared_ffn_hidden_size // t
    return out


def stage_params(cfg: Config, layout: Layout, stage: int) -> dict[str, int]:
    """Every parameter one rank of pipeline stage `stage` holds, by kind."""
    shape = model_shape(cfg, layout)
    total = dict.fromkeys(KINDS, 0)
    for index, is_moe in zip(shape.stage_layer_indices(stage), shape.stage_moe_layers(stage)):
        for kind, n in layer_params(cfg, layout, is_moe, index).items():
            total[kind] += n
    vocab = shape.padded_vocab // layout.tp * cfg.model.hidden_size
    if stage == 0:
        total["embedding"] += vocab
    if stage == layout.pp - 1:
        total["output"] += vocab
        total["norm"] += cfg.model.hidden_size * cfg.model.norm_gains  # the final norm's gain
        last = cfg.model.num_layers - 1
        h = cfg.model.hidden_size
        if cfg.model.mtp.num_layers and layout.pp > 1:  # the MTP modules' copy of the input embedding
            total["embedding"] += vocab
        for _ in range(cfg.model.mtp.num_layers):  # model.mtp: a layer of the last layer's kind each, on this stage
            for kind, n in layer_params(cfg, layout, shape.moe_layers[last], last).items():
                total[kind] += n
            total["attention"] += 2 * h * h // layout.tp  # eh_proj [h, 2h], TP-split like the attention matrices
            total["norm"] += 3 * h * cfg.model.norm_gains  # enorm, hnorm, its final norm
    return total


# --- bytes --------------------------------------------------------------------------------------

def value_bytes(precision: str) -> int:
    """Bytes of one weight, gradient or activation value in `precision`: 2 in bf16 (and fp8, whose
    weights stay bf16), 4 in fp32."""
    return 2 if precision in ("bf16", "fp8") else 4


def largest_tensors(cfg: Config, layout: Layout) -> dict[str, int]:
    """The largest single parameter tensor of each kind on one rank (elements)."""
    m, moe, t = cfg.model, cfg.model.moe, layout.tp
    h = m.hidden_size
    head_dim = m.head_dim or h // m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    ffn = m.ffn_hidden_size or 4 * h
    expert_ffn = (moe.ffn_hidden_size or ffn) // layout.etp
    local_experts = moe.num_experts // layout.ep if moe.num_experts else 0
    vocab = model_shape(cfg, layout).padded_vocab // t * h
    return {"embedding": vocab, "output": vocab, "value_embedding": model_shape(cfg, layout).padded_vocab * groups * head_dim // t,
            "attention": max(mla_matrices(cfg, t).values()) if m.mla.enabled else
            h * head_dim * (m.num_attention_heads + 2 * groups) // t,  # linear_qkv
            "dense_mlp": 2 * h * ffn // t,  # linear_fc1 [gate; up]
            "shared_experts": 2 * h * (moe.shared_ffn_hidden_size or 0) // t,
            "router": (moe.num_experts or 0) * h,
            # grouped GEMM keeps every local expert's fc1 in one tensor; megatron's SequentialMLP one per expert
            "experts": (local_experts if moe.grouped_gemm else 1) * 2 * expert_ffn * h,
            "kappa": local_experts * expert_ffn if moe.grouped_gemm else expert_ffn,
            "norm": max(h, head_dim)}


def optimizer_groups(params: dict[str, int], cfg: Config, layout: Layout) -> list[dict]:
    """DeepSpeed's parameter groups on one rank, as this project forms them
    (megatron_kappa.optim.optimizer.param_groups, then DeepSpeed's split of the experts into
    groups of their own when they are reduced over the expert-data-parallel group, i.e. when
    EP > 1 or ETP != TP): each group's elements, the data-parallel size `d` that partitions it
    and its largest tensor."""
    apart = layout.ep > 1 or layout.etp != layout.tp
    routers_apart = cfg.train.optimizer != "adamw" and cfg.train.router_optimizer != "matrix"
    members = {"matrix": ["attention", "dense_mlp", "shared_experts"] + ([] if routers_apart else ["router"])
               + ([] if apart else ["experts"]),
               "experts": ["experts"] if apart else [], "router": ["router"] if routers_apart else [],
               "embedding": ["embedding", "value_embedding"], "output": ["output"], "norm": ["norm"],
               "kappa": ["kappa"]}
    largest = largest_tensors(cfg, layout)
    out = []
    for name, kinds in members.items():
        n = sum(params.get(k, 0) for k in kinds)
        if n:
            d = layout.edp if apart and name in ("experts", "kappa") else layout.zero_dp
            out.append({"name": name, "elements": n, "d": d,
                        "largest": min(n, max(largest[k] for k in kinds if params.get(k, 0)))})
    return out


def gradient_bytes(params: dict[str, int], cfg: Config, layout: Layout, planned: Planned = Planned()) -> dict[str, float]:
    """The gradient memory DeepSpeed's ZeRO-1/2 holds on one rank with this project's settings
    (contiguous_gradients, reduce_scatter, no overlap_comm: megatron_kappa.parallel.engine), at
    its two peaks. Each group's gradient partition (its elements / d, in the parameters' dtype)
    holds whole tensors, so a partition's two edges can add up to two tensors ("edges"; none
    when d is 1).
      backward  ZeRO-1: autograd's full gradients, until the boundary moves them through the
                reduce bucket (DeepSpeed's reduce_gradients). ZeRO-2: the partitions, filled
                bucket by bucket as backward runs, and the tensor just produced.
      step      the partitions, and the fp32 gradient of the group being stepped (DeepSpeed
                steps the groups one at a time: the largest group's partition is the peak).
    The reduce bucket (`bucket_bytes`) comes on top during backward. With the optimizer offloaded
    (planned only) the step's fp32 gradient is made in CPU memory: the step holds the partitions."""
    size = value_bytes(cfg.precision)
    groups = optimizer_groups(params, cfg, layout)
    partitions = sum(g["elements"] / g["d"] for g in groups)
    edges = sum(min(g["elements"] - g["elements"] / g["d"], 2 * g["largest"]) for g in groups)
    largest_group = max((g["elements"] / g["d"] for g in groups), default=0)
    step = size * (partitions + edges) + 4 * largest_group * (not planned.offload_optimizer)
    if cfg.zero.stage == 1:
        backward = size * sum(params.values())
    else:
        backward = size * (partitions + edges + max((g["largest"] for g in groups), default=0))
    return {"backward": backward, "step": step, "partitions": size * partitions, "edges": size * edges,
            "largest_group": largest_group}


def state_bytes(params: dict[str, int], cfg: Config, layout: Layout, planned: Planned = Planned()) -> dict[str, float]:
    """Bytes of weights, gradients (the larger of `gradient_bytes`'s two peaks), the fp32 master
    copy and the optimizer moments on one rank under DeepSpeed's ZeRO-`zero.stage`.

    bf16/fp8: bf16 weights; the master copy (fp32) and the moments are partitioned over the
    data-parallel group of each parameter: DP for the dense ones, EDP for the experts. fp32: fp32
    weights and gradients, no master copy. Moments: AdamW 2 fp32 per parameter; muon and aurora
    keep one momentum buffer for the matrices they orthogonalise (attention, MLPs, experts; the
    router too under aurora) and AdamW's two for the rest. Planned only (`planned`): the moments
    in bf16 (2 bytes each); the master copy and moments offloaded to the CPU ("offloaded", not on
    the GPU)."""
    half = value_bytes(cfg.precision) == 2
    moment_bytes = 2 if planned.optimizer_states == "bf16" else 4
    grads = gradient_bytes(params, cfg, layout, planned)
    out = dict(weights=0.0, gradients=max(grads["backward"], grads["step"]), master=0.0, moments=0.0)
    matrices = {"attention", "dense_mlp", "shared_experts", "experts"} | (
        {"router"} if cfg.train.optimizer == "aurora" else set())
    for kind, n in params.items():
        d = layout.edp if kind in EXPERT_KINDS else layout.zero_dp
        out["weights"] += value_bytes(cfg.precision) * n
        out["master"] += 4 * n / d if half else 0
        moments = 1 if (cfg.train.optimizer != "adamw" and kind in matrices) else 2
        out["moments"] += moments * moment_bytes * n / d
    if planned.offload_optimizer:
        out["offloaded"] = out["master"] + out["moments"]
        out["master"] = out["moments"] = 0.0
    return out


def bucket_bytes(cfg: Config) -> float:
    """DeepSpeed's reduce bucket: `reduce_bucket_size` (5e8) elements in the gradients' dtype,
    allocated whole at the first gradient of each backward pass and released after it. (The
    updated weights are all-gathered in place, so there is no all-gather bucket.)"""
    return REDUCE_BUCKET_ELEMENTS * value_bytes(cfg.precision)


# --- the plan -----------------------------------------------------------------------------------

def plan_stage(cfg: Config, layout: Layout, stage: int, recompute: str | None = None, imbalance: float = 1.0,
               planned: Planned = Planned()) -> dict:
    """One rank of pipeline stage `stage` (under DualPipe: pipeline rank `stage`, holding two)."""
    dual = dualpipe.applies(planned, layout)
    params = dualpipe.rank_params(cfg, layout, stage) if dual else stage_params(cfg, layout, stage)
    recompute = recompute or cfg.model.recompute
    states = state_bytes(params, cfg, layout, planned)
    offloaded = states.pop("offloaded", 0.0)
    grads = gradient_bytes(params, cfg, layout, planned)
    buckets = bucket_bytes(cfg)
    keeps = dualpipe.rank_activations if dual else activation_bytes
    activations = {mode: keeps(cfg, layout, stage, mode, cfg.train.micro_batch, imbalance, planned)
                   for mode in ("none", "selective", "full")}
    total = sum(states.values()) + buckets + activations[recompute]
    return {"stage": stage, "params": params, "param_count": sum(params.values()), "cpu_bytes": offloaded,
            "bytes": {**states, "buckets": buckets, "activations": activations[recompute]},
            "gradient_peaks": {"backward": grads["backward"], "step": grads["step"]},
            "activations_by_recompute": activations, "recompute": recompute, "total_bytes": total}


def plan(cfg: Config, layout: Layout, gpu_mem_gib: float, gpus_per_node: int = 8,
         rates: speed.Rates = speed.Rates(), imbalance: float = 1.0, planned: Planned = Planned()) -> dict:
    """The most-loaded rank of `layout` (by total bytes, over the pipeline stages), a verdict, and
    the estimated step time (megatron_kappa.plan.speed). `imbalance`: the busiest EP rank's routed
    rows over the average, under dropless routing (1: balanced). `planned`: settings the trainer
    does not run (and the layout's CP and VPP), listed as "planned_only"."""
    check(cfg, layout)
    dual = dualpipe.applies(planned, layout)
    if dual:
        dualpipe.check(layout, cfg.train.global_batch // (cfg.train.micro_batch * layout.dp))
    shown = planned  # zero.offload_optimizer: the trainer runs it, so it is not "planned only"
    if cfg.zero.offload_optimizer:
        shown, planned = dataclasses.replace(planned, offload_optimizer=False), \
            dataclasses.replace(planned, offload_optimizer=True)
    stages = [plan_stage(cfg, layout, s, imbalance=imbalance, planned=planned) for s in range(layout.pp)]
    worst = max(stages, key=lambda r: r["total_bytes"])
    budget = HEADROOM * gpu_mem_gib * GIB
    return {"layout": dataclasses.asdict(layout) | {"dp": layout.dp, "edp": layout.edp},
            "label": layout.label(), "gpu_mem_gib": gpu_mem_gib, "gpus_per_node": gpus_per_node,
            "zero_stage": cfg.zero.stage, "precision": cfg.precision, "most_loaded": worst,
            "stage_totals_gib": [r["total_bytes"] / GIB for r in stages],
            "fits": worst["total_bytes"] <= budget, "budget_gib": budget / GIB,
            "ep_inside_node": layout.ep * layout.etp <= gpus_per_node,
            "tp_inside_node": layout.tp <= gpus_per_node,
            "micro_batch": cfg.train.micro_batch,
            "expert_imbalance": imbalance,
            "planned_only": shown.labels(layout) + ["stages without decoder layers"] * bool(
                cfg.parallel.layout and stage_layout.empty_entries(cfg.parallel.layout)), "dualpipe": dual,
            "speed": speed.step_time(cfg, layout, rates, gpus_per_node,
                                     [stage_params(cfg, layout, s) for s in range(layout.pp)] if dual
                                     else [r["params"] for r in stages],
                                     imbalance=imbalance, overlap=planned.overlap,
                                     node_dispatch=planned.node_dispatch, dualpipe=dual)}


def where(stage: int, pp: int, dual: bool) -> str:
    """The most-loaded rank's place in the pipeline, for the output."""
    if dual:
        return "rank {} of {} (stages {} and {}: DualPipe)".format(stage, pp, *dualpipe.stages_of(pp, stage))
    return f"stage {stage} of {pp}"


def render(p: dict) -> str:
    w = p["most_loaded"]
    lines = [f"layout        {p['label']}  on {p['layout']['world']} GPUs ({p['gpus_per_node']} per node)"
             + ("" if p["ep_inside_node"] else "  [EP × ETP crosses nodes]"),
             f"precision     {p['precision']}, ZeRO-{p['zero_stage']}, recompute {w['recompute']}",
             f"most loaded   pipeline {where(w['stage'], p['layout']['pp'], p['dualpipe'])}: "
             f"{w['param_count'] / 1e9:.3f} B parameters",
             "  by kind     " + ", ".join(f"{k} {v / 1e9:.3f} B" for k, v in w["params"].items() if v)]
    for key, value in w["bytes"].items():
        lines.append(f"  {key:<12}{value / GIB:>9.2f} GiB" + ("  (the larger of: backward {:.2f}, step {:.2f})".format(
            *(v / GIB for v in w["gradient_peaks"].values())) if key == "gradients" else ""))
    lines.append("  activations by recompute: " + ", ".join(
        f"{k} {v / GIB:.2f} GiB" for k, v in w["activations_by_recompute"].items()))
    lines.append(f"  total       {w['total_bytes'] / GIB:>9.2f} GiB of {p['gpu_mem_gib']:g} GiB "
                 f"({HEADROOM:.0%} usable: {p['budget_gib']:.1f})")
    if w["cpu_bytes"]:
        lines.append(f"  offloaded   {w['cpu_bytes'] / GIB:>9.2f} GiB of master copy and moments in CPU memory")
    lines.append(f"verdict       {'fits' if p['fits'] else 'does NOT fit'}")
    if p["planned_only"]:
        lines.append("planned only  " + ", ".join(p["planned_only"]) + " (the trainer does not run these)")
    v = p["speed"]
    lines.append(f"step time     {v['seconds']:.3f} s estimated ({v['tokens_per_s']:,.0f} tokens/s, "
                 f"{v['tokens_per_s_per_gpu']:,.0f} per GPU; micro-batch {p['micro_batch']}, "
                 f"{v['micro_batches']} per step): " + ", ".join(f"{k} {t:.3f}" for k, t in v["terms"].items()))
    return "\n".join(lines)
