"""The memory planner: what the most-loaded rank of a layout holds, and whether it fits.

    python -m megatron_kappa.plan --config X --world N [--gpu-mem 80] [--gpus-per-node 8] [--search] [--json]

Arithmetic only (no torch, no model): the parameters each rank builds, counted from the shapes
the way megatron-core shards them (tests/test_plan.py checks the counts against meta-device
builds of every rank of a grid of layouts), then bytes for them under DeepSpeed's bf16 ZeRO-1/2
as this project configures it (megatron_kappa.parallel.engine.ds_config), and an activation
estimate per recompute mode. docs/plan.md says where each number comes from.

Modules:
  __main__.py  `python -m megatron_kappa.plan`: the command line of megatron_kappa.plan
  search.py    `--search`: the layouts that fit, fastest first, each at its fastest micro-batch and
               recompute mode (the step-time estimate of megatron_kappa.plan.speed)
  speed.py     A step-time estimate per layout: compute from FLOPs, the pipeline bubble, and the
               traffic of tensor, expert, pipeline and data parallelism at stated bandwidths
"""
from __future__ import annotations

import dataclasses

from megatron_kappa import routers
from megatron_kappa.config import Config, ConfigError
from megatron_kappa.model.layout import (VALUE_GATE_CHANNELS, ModelLayout, has_value_embedding, model_layout,
                                         recompute_modules)
from megatron_kappa.plan import speed

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

    @property
    def dp(self) -> int:
        """Data-parallel size of the dense parameters."""
        return self.world // (self.tp * self.pp)

    @property
    def edp(self) -> int:
        """Data-parallel size of the experts (megatron's expert-data-parallel group)."""
        return self.world // (self.ep * self.etp * self.pp)

    def label(self) -> str:
        return f"TP{self.tp} PP{self.pp} EP{self.ep} ETP{self.etp} DP{self.dp} (EDP{self.edp})"


def layout_of(cfg: Config, world: int) -> Layout:
    par = cfg.parallel
    return Layout(world=world, tp=par.tp, pp=par.pp, ep=par.ep, etp=par.expert_tp)


def with_layout(cfg: Config, layout: Layout) -> Config:
    """`cfg` in `layout`; the config's uneven stage split only for its own number of stages."""
    same_pp = layout.pp == cfg.parallel.pp
    par = dataclasses.replace(cfg.parallel, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp,
                              first_stage_layers=cfg.parallel.first_stage_layers if same_pp else None,
                              last_stage_layers=cfg.parallel.last_stage_layers if same_pp else None)
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
    split = with_layout(cfg, layout)
    try:
        validate(split)
        check_layout(split.parallel, layout.world, shape.experts)
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
    first, _ = shape.stage_layers(stage)
    for index, is_moe in enumerate(shape.stage_moe_layers(stage), first):
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
            d = layout.edp if apart and name in ("experts", "kappa") else layout.dp
            out.append({"name": name, "elements": n, "d": d,
                        "largest": min(n, max(largest[k] for k in kinds if params.get(k, 0)))})
    return out


def gradient_bytes(params: dict[str, int], cfg: Config, layout: Layout) -> dict[str, float]:
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
    The reduce bucket (`bucket_bytes`) comes on top during backward."""
    size = value_bytes(cfg.precision)
    groups = optimizer_groups(params, cfg, layout)
    partitions = sum(g["elements"] / g["d"] for g in groups)
    edges = sum(min(g["elements"] - g["elements"] / g["d"], 2 * g["largest"]) for g in groups)
    largest_group = max((g["elements"] / g["d"] for g in groups), default=0)
    step = size * (partitions + edges) + 4 * largest_group
    if cfg.zero.stage == 1:
        backward = size * sum(params.values())
    else:
        backward = size * (partitions + edges + max((g["largest"] for g in groups), default=0))
    return {"backward": backward, "step": step, "partitions": size * partitions, "edges": size * edges,
            "largest_group": largest_group}


def state_bytes(params: dict[str, int], cfg: Config, layout: Layout) -> dict[str, float]:
    """Bytes of weights, gradients (the larger of `gradient_bytes`'s two peaks), the fp32 master
    copy and the optimizer moments on one rank under DeepSpeed's ZeRO-`zero.stage`.

    bf16/fp8: bf16 weights; the master copy (fp32) and the moments are partitioned over the
    data-parallel group of each parameter: DP for the dense ones, EDP for the experts. fp32: fp32
    weights and gradients, no master copy. Moments: AdamW 2 fp32 per parameter; muon and aurora
    keep one momentum buffer for the matrices they orthogonalise (attention, MLPs, experts; the
    router too under aurora) and AdamW's two for the rest."""
    half = value_bytes(cfg.precision) == 2
    grads = gradient_bytes(params, cfg, layout)
    out = dict(weights=0.0, gradients=max(grads["backward"], grads["step"]), master=0.0, moments=0.0)
    matrices = {"attention", "dense_mlp", "shared_experts", "experts"} | (
        {"router"} if cfg.train.optimizer == "aurora" else set())
    for kind, n in params.items():
        d = layout.edp if kind in EXPERT_KINDS else layout.dp
        out["weights"] += value_bytes(cfg.precision) * n
        out["master"] += 4 * n / d if half else 0
        moments = 4 if (cfg.train.optimizer != "adamw" and kind in matrices) else 8
        out["moments"] += moments * n / d
    return out


def bucket_bytes(cfg: Config) -> float:
    """DeepSpeed's reduce bucket: `reduce_bucket_size` (5e8) elements in the gradients' dtype,
    allocated whole at the first gradient of each backward pass and released after it. (The
    updated weights are all-gathered in place, so there is no all-gather bucket.)"""
    return REDUCE_BUCKET_ELEMENTS * value_bytes(cfg.precision)


def activation_bytes(cfg: Config, layout: Layout, stage: int, recompute: str, micro_batch: int,
                     imbalance: float = 1.0) -> float:
    """An estimate of the activations one rank of `stage` keeps for backward, in bytes.

    Per layer and micro-batch, with s·b tokens, sequence parallelism (the tensors outside the
    attention and MLP cores split by TP) and SDPA (no s² scores kept):
      attention: norm input, qkv input, q k v, core output: s·b·(3h + (heads + 2·groups)·d + heads·d)/tp
        (MLA: the latents, q and k of nope + rope width per head, v: s·b·(3h + latents + heads·(2·qk + 2·v))/tp)
      dense MLP: norm input, fc1 input, fc1 output [gate; up], activation: s·b·(2h + 3·ffn/tp)
      MoE: norm input and router input s·b·2h/tp, the s·b·k routed rows (times the capacity
      factor when set, else `imbalance`: the busiest rank's share over the average) with their fc1
      input, fc1 output and activation: rows·(h + 3·F/etp)
    in 2 bytes (4 in fp32). selective recompute drops what its modules (model.recompute_modules)
    would keep: core_attn the core's output, mla_up_proj MLA's q, k, v, moe_act the experts'
    activation, mlp a dense MLP's fc1 output and activation, moe the routed rows' tensors and the
    shared expert's, shared_experts the shared expert's; full keeps only each layer's input (s·b·h/tp; only
    the stage's first model.recompute_layers layers when set, the rest keep everything) plus one
    layer's activations while it is recomputed. The output layer's logits add one loss chunk
    (model.cross_entropy_chunk tokens, or all s·b) × vocab/tp in fp32. Under 1F1B the first
    stage holds pp micro-batches in flight, stage i holds pp − i (at most the micro-batches
    per step)."""
    m, moe, t = cfg.model, cfg.model.moe, layout.tp
    h, tokens = m.hidden_size, cfg.model.seq_length * micro_batch
    head_dim = m.head_dim or h // m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    ffn = m.ffn_hidden_size or 4 * h
    size = value_bytes(cfg.precision)
    per = model_shape(cfg, layout).stage_counts()[stage]
    core = tokens * head_dim * m.num_attention_heads / t
    attention = tokens * (3 * h + head_dim * (m.num_attention_heads + 2 * groups)) / t + core
    if m.mla.enabled:  # the latents, then q, k (nope + rope per head) and v; the core's output is v-wide
        a = m.mla
        core = tokens * a.v_head_dim * m.num_attention_heads / t
        qk = a.qk_head_dim + a.qk_pos_emb_head_dim
        latents = (a.q_lora_rank or 0) + a.kv_lora_rank + a.qk_pos_emb_head_dim
        attention = tokens * (3 * h + latents + m.num_attention_heads * (2 * qk + a.v_head_dim)) / t + core
    up = 0.0  # MLA's q, k and v (the up-projections' outputs)
    if m.mla.enabled:
        up = tokens * m.num_attention_heads * (2 * (m.mla.qk_head_dim + m.mla.qk_pos_emb_head_dim)
                                               + m.mla.v_head_dim) / t
    rows = speed.routed_rows(cfg, tokens, imbalance)
    expert_ffn = (moe.ffn_hidden_size or ffn) / layout.etp
    shared = 3 * tokens * (moe.shared_ffn_hidden_size or 0) / t
    shape = model_shape(cfg, layout)
    modules = set(recompute_modules(m, shape.has_moe))
    layers = []
    for is_moe in shape.stage_moe_layers(stage):
        dropped = core * ("core_attn" in modules) + up * ("mla_up_proj" in modules)
        if is_moe:
            mlp = 2 * tokens * h / t + rows * (h + 3 * expert_ffn) + shared
            if "moe" in modules:
                dropped += rows * (h + 3 * expert_ffn) + shared
            else:
                dropped += rows * expert_ffn * ("moe_act" in modules) + shared * ("shared_experts" in modules)
        else:
            mlp = tokens * (2 * h + 3 * ffn / t)
            dropped += tokens * 3 * ffn / t * ("mlp" in modules)
        full_layer = attention + mlp
        layers.append({"none": full_layer, "selective": full_layer - dropped}.get(recompute, full_layer))
    if recompute == "full":  # model.recompute_layers: only the stage's first N layers (megatron's block method)
        n = per if m.recompute_layers is None else min(m.recompute_layers, per)
        kept = n * tokens * h / t + sum(layers[n:]) + max(layers[:n], default=0)
    else:
        kept = sum(layers)
    if stage == layout.pp - 1:
        chunk = min(m.cross_entropy_chunk or tokens, tokens)
        kept += chunk * shape.padded_vocab / t * 4 / size
    in_flight = min(layout.pp - stage, max(1, cfg.train.global_batch // (micro_batch * layout.dp)))
    return kept * size * in_flight


# --- the plan -----------------------------------------------------------------------------------

def plan_stage(cfg: Config, layout: Layout, stage: int, recompute: str | None = None, imbalance: float = 1.0) -> dict:
    params = stage_params(cfg, layout, stage)
    recompute = recompute or cfg.model.recompute
    states = state_bytes(params, cfg, layout)
    grads = gradient_bytes(params, cfg, layout)
    buckets = bucket_bytes(cfg)
    activations = {mode: activation_bytes(cfg, layout, stage, mode, cfg.train.micro_batch, imbalance)
                   for mode in ("none", "selective", "full")}
    total = sum(states.values()) + buckets + activations[recompute]
    return {"stage": stage, "params": params, "param_count": sum(params.values()),
            "bytes": {**states, "buckets": buckets, "activations": activations[recompute]},
            "gradient_peaks": {"backward": grads["backward"], "step": grads["step"]},
            "activations_by_recompute": activations, "recompute": recompute, "total_bytes": total}


def plan(cfg: Config, layout: Layout, gpu_mem_gib: float, gpus_per_node: int = 8,
         rates: speed.Rates = speed.Rates(), imbalance: float = 1.0) -> dict:
    """The most-loaded rank of `layout` (by total bytes, over the pipeline stages), a verdict, and
    the estimated step time (megatron_kappa.plan.speed). `imbalance`: the busiest EP rank's routed
    rows over the average, under dropless routing (1: balanced)."""
    check(cfg, layout)
    stages = [plan_stage(cfg, layout, s, imbalance=imbalance) for s in range(layout.pp)]
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
            "speed": speed.step_time(cfg, layout, rates, gpus_per_node, [r["params"] for r in stages],
                                     imbalance=imbalance)}


def render(p: dict) -> str:
    w = p["most_loaded"]
    lines = [f"layout        {p['label']}  on {p['layout']['world']} GPUs ({p['gpus_per_node']} per node)"
             + ("" if p["ep_inside_node"] else "  [EP × ETP crosses nodes]"),
             f"precision     {p['precision']}, ZeRO-{p['zero_stage']}, recompute {w['recompute']}",
             f"most loaded   pipeline stage {w['stage']} of {p['layout']['pp']}: "
             f"{w['param_count'] / 1e9:.3f} B parameters",
             "  by kind     " + ", ".join(f"{k} {v / 1e9:.3f} B" for k, v in w["params"].items() if v)]
    for key, value in w["bytes"].items():
        lines.append(f"  {key:<12}{value / GIB:>9.2f} GiB" + ("  (the larger of: backward {:.2f}, step {:.2f})".format(
            *(v / GIB for v in w["gradient_peaks"].values())) if key == "gradients" else ""))
    lines.append("  activations by recompute: " + ", ".join(
        f"{k} {v / GIB:.2f} GiB" for k, v in w["activations_by_recompute"].items()))
    lines.append(f"  total       {w['total_bytes'] / GIB:>9.2f} GiB of {p['gpu_mem_gib']:g} GiB "
                 f"({HEADROOM:.0%} usable: {p['budget_gib']:.1f})")
    lines.append(f"verdict       {'fits' if p['fits'] else 'does NOT fit'}")
    v = p["speed"]
    lines.append(f"step time     {v['seconds']:.3f} s estimated ({v['tokens_per_s']:,.0f} tokens/s, "
                 f"{v['tokens_per_s_per_gpu']:,.0f} per GPU; micro-batch {p['micro_batch']}, "
                 f"{v['micro_batches']} per step): " + ", ".join(f"{k} {t:.3f}" for k, t in v["terms"].items()))
    return "\n".join(lines)
