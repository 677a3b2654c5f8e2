"""A step-time estimate per layout: compute from FLOPs, the pipeline bubble, and the traffic of
tensor, expert, pipeline and data parallelism at stated bandwidths.

Per step, for one rank of the slowest pipeline stage:
  compute   the stage's matmul FLOPs for the rank's tokens (forward, 2x in backward, one more
            forward of each layer under full recompute, of the selective modules' parts otherwise)
            at `Rates.tflops` per GPU (FP8 GEMMs `Rates.fp8_speedup` x faster); causal attention
            counts half of its s² scores, as flash attention computes them (at
            `Rates.attention_tflops` if set)
  fixed     `Rates.layer_ms` per layer and micro-batch: launches and host syncs, what does not
            grow with the tokens (default 0); no traffic hides behind it
  memory    the routed experts' GEMMs as a roofline: where a GEMM's bytes at `Rates.hbm_tbs` take
            longer than its FLOPs at `Rates.tflops` (few rows per expert: fine-grained experts at
            small EP, small micro-batches), the difference (expert_memory_seconds); GEMM time,
            like compute, that the traffic can hide behind
  bubble    1F1B's idle share: compute x (p - 1) / (v · m), m micro-batches per step, v virtual
            stages (parallel.vpp: megatron's interleaved schedule); planned only, DualPipe's
            (p/2 - 1)(F&B + B - 3W), each rank running two stages (plan.dualpipe)
  context   context parallelism's exchange of K and V (plan.context): the trainer all-gathers
            them over CP in each layer's forward and reduce-scatters their gradient in backward,
            once more where the core attention is recomputed: (2 + r)(cp - 1) x the rank's tokens
            x the TP-split K and V width, r = 1 for a recomputed core; planned only, the ring
            (Planned.ring_attention): 3 (cp - 1) x the same
  tensor    sequence parallelism's collectives of the rank's tokens x hidden: 5 per TP-split
            block, the embedding's and the output layer's (tensor_collectives)
  expert    the token dispatcher's all-to-all, dispatch and combine, forward and backward: 4 x
            the rank's routed rows x hidden per MoE layer, the share (EP - 1) / EP leaving the rank,
            across nodes the other nodes' share over InfiniBand beside the node's over NVLink
            (planned only, node-limited dispatch: a token crosses to each node once; _dispatch_seconds),
            and with expert TP the rows' all-gather and reduce-scatter over ETP
  pipeline  each micro-batch's activation forward and its gradient backward between stages (v
            times with v virtual stages: each chunk boundary is crossed)
  data      ZeRO-1: the gradients' reduce-scatter and the updated weights' all-gather, (D - 1) / D
            of them on the wire (dense over DP x CP, experts over EDP), each in the dtype the
            state holds (plan.state): the gradients 4 bytes a parameter where they are reduced
            in fp32 (train.grad_accum_dtype fp32, the default with bf16/fp8 weights, as
            DeepSpeed's communication_data_type; fp32 weights), 2 in bf16; the weights 2 bytes
            (bf16/fp8), 4 in fp32
Each collective also pays `Rates.latency_us` per message: a ring over n ranks, or an all-to-all
among n, sends n - 1 (tensor: tensor_collectives per micro-batch, the loss's all-reduces with
them; context: one per step of its all-gathers and reduce-scatters, or the ring's hops; expert: dispatcher_messages per
MoE layer and micro-batch;
pipeline: one message per boundary crossing; data: a reduce-scatter and an all-gather per step).
The tensor and expert counts are megatron's own (tests/test_plan.py counts its calls).
A group talks over NVLink when its ranks sit in one node, over InfiniBand otherwise; megatron
orders the ranks TP, CP, DP, PP for dense groups (CP ranks TP apart, DP ranks TP·CP apart, stages
TP·CP·DP apart) and ETP, EP,
EDP, PP for the experts' (EP ranks ETP apart, EDP ranks EP·ETP apart).
The trainer overlaps one term: with parallel.overlap_moe_expert_parallel_comm, megatron's combined
1F1B hides the expert all-to-all of one micro-batch behind another's compute, but in its warm-up
and cool-down (plan.ep_overlap: the stage saves min(expert, compute + memory) x the share of its
passes that run paired). Otherwise the step is compute + bubble + traffic (its DeepSpeed runs
without overlap_comm). Planned only, `overlap` names the terms that run beside the compute
(plan.planned.Planned.overlap):
  tensor, context, expert, pipeline   hidden behind the stage's compute as far as it lasts: the
            stage is busy max(compute, those terms) + the others (an upper bound on the hiding)
  data      a layer at a time, while the rest computes: one layer's share stays exposed, as NeMo's
            documentation of megatron's overlap says, or what exceeds the stage's compute
and the bubble is that busy time x (p - 1) / (v · m). The "overlapped" term (negative) is the
traffic hidden (by either), so that the terms, the traffic counted in full, still add up to the step.
Bytes are 2 per value (bf16, and fp8 layers keep bf16 activations on the wire), but ZeRO's (data).

Arithmetic only, like the memory plan; docs/plan.md gives the defaults' sources.
"""
from __future__ import annotations

import dataclasses

from megatron_kappa import attention_kinds
from megatron_kappa.config import Config, ModelConfig, TrainConfig
from megatron_kappa.config import recompute as selective
from megatron_kappa.plan import context as cp_exchange
from megatron_kappa.plan import dualpipe as dual
from megatron_kappa.plan import ep_overlap
from megatron_kappa.plan.layout import model_shape
from megatron_kappa.plan.params import EXPERT_KINDS
from megatron_kappa.plan.planned import OVERLAP
from megatron_kappa.plan.routing import routed_rows
from megatron_kappa.plan.state import reduced_bytes
from megatron_kappa.plan.units import value_bytes


@dataclasses.dataclass(frozen=True)
class Rates:
    """What the estimate divides by (the planner's --tflops, --nvlink-gbs, --ib-gbs, ...;
    bench/plan_rates.py measures the GEMM, attention and per-layer figures on one GPU)."""
    tflops: float = 400.0  # achievable dense bf16 TFLOP/s per GPU: ~40 % of an H100/H200's 989
    nvlink_gbs: float = 450.0  # GB/s one way per GPU inside a node (NVLink 4: 900 GB/s both ways)
    ib_gbs: float = 50.0  # GB/s per GPU across nodes (one 400 Gb/s NDR link per GPU)
    latency_us: float = 10.0  # per message of a collective (a stated assumption: NCCL's small-message scale)
    hbm_tbs: float = 3.35  # TB/s of GPU memory bandwidth (H100/H800 SXM: 3.35; H200: 4.8)
    fp8_speedup: float = 2.0  # FP8 GEMMs' rate over bf16's: the peak ratio (NVIDIA measured 1.2 for Mixtral)
    attention_tflops: float | None = None  # the attention cores' (QKᵀ, AV) rate; None: the GEMMs' (fp8's for fp8)
    layer_ms: float = 0.0  # ms per layer and micro-batch, forward + backward, whatever the tokens (launches, syncs)


WIRE_BYTES = 2


def layer_flops(m: ModelConfig, is_moe: bool, tokens: float, tp: int, imbalance: float = 1.0) -> dict[str, float]:
    """Forward matmul FLOPs of one layer on one rank for `tokens` tokens of its data-parallel
    replica (TP ranks share them), by part: "attention" (the projections, by the attention kind:
    megatron_kappa.attention_kinds; its recomputable share of them besides, "mla_up" for MLA's
    up-projections), "scores" (the attention cores' QKᵀ and AV, causal: half of s²), "mlp" (a dense
    layer's), "router", "experts", "shared"; "matmul" is every part but the scores. Routed experts
    on the busiest rank (routed_rows): the stage's routed rows spread over its ranks, whatever EP
    and ETP are, at `imbalance` x the average."""
    moe = m.moe
    h, s = m.hidden_size, m.seq_length
    out = dict.fromkeys(("attention", *attention_kinds.flop_parts(), "scores", "mlp", "router", "experts", "shared"),
                        0.0)
    per_token, score_width, parts = attention_kinds.of(m).flops(m)  # projections, the cores' width, sub-parts
    for part, elements in parts.items():
        out[part] = 2 * tokens * elements / tp
    out["attention"] = 2 * tokens * per_token / tp
    out["scores"] = 2 * tokens * s * score_width / tp * 0.5  # QKᵀ and AV over the causal half
    ffn = m.ffn_hidden_size or 4 * h
    if not is_moe:
        out["mlp"] = 2 * tokens * 3 * h * ffn / tp
    else:
        rows = routed_rows(moe, tokens, imbalance)
        out["router"] = 2 * tokens * h * moe.num_experts / tp  # on the rank's sequence-parallel share
        out["experts"] = 2 * rows * 3 * h * (moe.ffn_hidden_size or ffn) / tp
        out["shared"] = 2 * tokens * 3 * h * (moe.shared_ffn_hidden_size or 0) / tp
    out["matmul"] = out["attention"] + out["mlp"] + out["router"] + out["experts"] + out["shared"]
    return out


def recomputed_flops(f: dict[str, float], recompute: str, modules: tuple[str, ...]) -> float:
    """The forward FLOPs of one layer (layer_flops) done again in backward: the whole layer under
    full recompute, the selective modules' parts otherwise (moe_act: elementwise, no matmul)."""
    if recompute == "full":
        return f["matmul"] + f["scores"]
    if recompute != "selective":
        return 0.0
    chosen = {p for mod in modules for p in selective.MODULES[mod].flops}
    return sum(f[p] for p in chosen)


def stage_layers(m: ModelConfig, shape, stage: int, recompute: str):
    """Each layer of `stage`: (whether it is a MoE layer, the FLOPs its backward does again as a
    function of its layer_flops). Full recompute covers the stage's first model.recompute_layers
    layers (all without it), selective recompute every layer (recomputed_flops)."""
    modules = selective.selected(m, shape.has_moe)
    blocks = m.recompute_layers if m.recompute_layers is not None else len(shape.moe_layers)
    for i, is_moe in enumerate(shape.stage_moe_layers(stage)):
        again = recompute != "full" or i < blocks
        yield is_moe, (lambda f, again=again: recomputed_flops(f, recompute, modules) if again else 0.0)


def stage_flops(m: ModelConfig, shape, stage: int, tokens: float, tp: int, recompute: str, imbalance: float = 1.0,
                scores_only: bool = False) -> float:
    """One step's FLOPs on one rank of `stage` (forward, backward = 2 x forward, recompute);
    `scores_only`: of the attention cores alone (QKᵀ and AV, done again where recomputed)."""

    def part(f):  # with scores_only, the layer's attention cores alone
        return {**dict.fromkeys(f, 0.0), "scores": f["scores"]} if scores_only else f
    total = 0.0
    for is_moe, again in stage_layers(m, shape, stage, recompute):
        f = part(layer_flops(m, is_moe, tokens, tp, imbalance))
        total += 3 * (f["matmul"] + f["scores"]) + again(f)
    if stage == shape.pp - 1:
        output = 0.0 if scores_only else 2 * tokens * m.hidden_size * shape.padded_vocab / tp
        eh_proj = 0.0 if scores_only else 2 * tokens * 2 * m.hidden_size ** 2 / tp
        total += 3 * output
        last = shape.moe_layers[-1]
        for _ in range(m.mtp.num_layers):  # a layer of the last kind, eh_proj and the output layer again
            f = part(layer_flops(m, last, tokens, tp, imbalance))
            total += 3 * (f["matmul"] + f["scores"] + eh_proj + output)
    return total


def expert_gemm_rows(m: ModelConfig, train: TrainConfig, layout, imbalance: float = 1.0) -> float:
    """M of each local expert's GEMMs per micro-batch on the busiest rank: the micro-batch's tokens
    on a CP rank, each TP rank routing its sequence-parallel share, k rows a token; an EP rank
    receives as many rows as it sends (balanced), gathers its ETP peers' too, and spreads them
    over its E / EP experts: etp · ep · k · s·b / (cp · tp · E)."""
    tokens = m.seq_length * train.micro_batch / layout.cp
    return routed_rows(m.moe, tokens, imbalance) / layout.tp * layout.etp * layout.ep / m.moe.num_experts


def expert_memory_seconds(m: ModelConfig, train: TrainConfig, precision: str, layout, rate: float, hbm: float,
                          imbalance: float = 1.0) -> float:
    """What one pass (a forward, or one of backward's two GEMMs of each weight) of one MoE layer's
    local experts for one micro-batch takes beyond its FLOPs at `rate` where HBM bounds it (a
    roofline: each GEMM takes the longer of its FLOPs at `rate` and its bytes at `hbm`). A GEMM of
    M x K by K x N does 2 MKN FLOPs and moves its operands (2 bytes a value, 1 in fp8, 4 in fp32)
    and its M x N result (2 bytes, 4 in fp32); backward's input and weight gradients move as much
    and do as many FLOPs. An expert's fc1 is M x h by h x 2F' (gate and up, F' = F / ETP), its fc2 M x F' by
    F' x h; the rank holds E / EP experts, M = expert_gemm_rows. With few rows per expert
    (fine-grained experts at small EP) reading the weights dominates, which FLOPs alone leave free."""
    moe = m.moe
    rows, h = expert_gemm_rows(m, train, layout, imbalance), m.hidden_size
    f = (moe.ffn_hidden_size or m.ffn_hidden_size or 4 * h) / layout.etp
    result = 4 if precision == "fp32" else 2
    operand = 1 if precision == "fp8" else result
    excess = 0.0
    for k, n in ((h, 2 * f), (f, h)):  # fc1, fc2
        excess += max(0.0, (operand * (rows * k + k * n) + result * rows * n) / hbm - 2 * rows * k * n / rate)
    return excess * moe.num_experts / layout.ep


def expert_passes(m: ModelConfig, shape, stage: int) -> float:
    """The passes over the routed experts per micro-batch on `stage` (expert_memory_seconds):
    forward and backward's two for each MoE layer (and each MTP depth of one), one more for each
    layer whose experts recompute (full recompute of that layer, or the selective "moe" module),
    as stage_flops counts their FLOPs (stage_layers)."""
    one_pass = dict.fromkeys(("attention", *attention_kinds.flop_parts(), "scores", "mlp", "router", "shared"),
                             0.0)
    one_pass.update(experts=1.0, matmul=1.0)  # a layer_flops of the experts' one forward alone
    passes = sum(3 + again(one_pass) for is_moe, again in stage_layers(m, shape, stage, m.recompute) if is_moe)
    if stage == shape.pp - 1 and shape.moe_layers[-1]:
        passes += 3 * m.mtp.num_layers
    return passes


def _span(group: int, stride: int, gpus_per_node: int) -> bool:
    """Whether a group of `group` ranks `stride` apart crosses a node."""
    return group > 1 and group * stride > gpus_per_node


# hidden behind the stage's compute; ZeRO's traffic ("data") has its own rule (_exposed_data)
OVERLAPPABLE = tuple(t for t in OVERLAP if t != "data")


def _dispatch_seconds(m: ModelConfig, rows: float, layout, gpus_per_node: int, nvlink: float, ib: float,
                      node_dispatch: bool) -> float:
    """One all-to-all (dispatch or combine) of a MoE layer: `rows` routed rows of h values from
    this rank, (EP - 1) / EP of them to other ranks, on NVLink inside a node. With EP across n
    nodes, EP / n ranks in each: (n - 1) / n of the rows go to the other nodes over InfiniBand and
    (EP / n - 1) / EP to the rank's node peers over NVLink, the two links at once (NCCL's
    all-to-all posts every peer's send together). With `node_dispatch` (DeepSeek-V3's §3.2.2,
    DeepEP): a token goes once over InfiniBand to each other node holding one of its experts, at
    most min(top-k, the groups a token may use under num_groups, n) nodes, (n - 1) / n of them
    remote, then on over NVLink to its experts there (every routed row once), the two links at
    once (§3.2.2: "fully overlapped")."""
    moe, h, ep, etp = m.moe, m.hidden_size, layout.ep, layout.etp
    if not _span(ep, etp, gpus_per_node):
        return rows * h * WIRE_BYTES * (ep - 1) / ep / nvlink
    nodes = -(-ep * etp // gpus_per_node)
    if not node_dispatch:
        peers = ep / nodes - 1  # the rank's EP peers in its own node
        return max(rows * h * WIRE_BYTES * (nodes - 1) / nodes / ib, rows * h * WIRE_BYTES * peers / ep / nvlink)
    reach = min(moe.topk, moe.group_topk if moe.num_groups else nodes, nodes)
    remote = rows / moe.topk * reach * (nodes - 1) / nodes
    return max(remote * h * WIRE_BYTES / ib, rows * h * WIRE_BYTES / nvlink)


def tensor_collectives(m: ModelConfig, train: TrainConfig, shape, stage: int, cp: int = 1) -> tuple[float, int]:
    """Sequence parallelism's collectives on the TP group per micro-batch, forward and backward, on
    one rank of `stage`: (their volume in tokens x h collectives, their number). Each TP-split
    block (attention, a dense MLP, a shared expert; the routed experts go through the dispatcher
    instead) all-gathers its input and reduce-scatters its output forward, and backward
    reduce-scatters the input's gradient, all-gathers the output's gradient and all-gathers the
    input again for the weight gradient (megatron's linear layers keep only their sequence
    share): 5. MLA (megatron's MLASelfAttention, model/attention_kinds/mla.py's down projection;
    the attention kind's `tp_gathers`) adds 3 for each of
    its narrow gathers, forward, gradient and again for the weight gradient: the q latent (with
    q_lora_rank) gathered over the heads and over the sequence, [c_kv; k_pe] over the heads, k_pe
    and c_kv over the sequence (counted against megatron's calls with a q latent; without one,
    unmeasured: that MLA needs Transformer Engine); their volume in units of h from their widths.
    The first stage's embedding reduce-scatters forward and all-gathers backward; the last stage's
    output layer is a column-parallel linear (3), and the loss all-reduces the max, the sum of
    exponentials and the target logit of each loss chunk (model.cross_entropy_chunk of the rank's
    tokens, s·b/cp; one chunk under megatron's own loss): a few values per token, counted in
    number only. MTP layers are not counted."""
    shared = bool(m.moe.shared_ffn_hidden_size)
    layers = shape.stage_moe_layers(stage)
    blocks = sum(1 + ((not is_moe) or shared) for is_moe in layers)
    volume = count = 5 * blocks + 2 * (stage == 0)  # each of tokens x h
    narrow = attention_kinds.of(m).tp_gathers(m)
    if narrow:
        volume += 3 * len(layers) * sum(narrow) / m.hidden_size
        count += 3 * len(layers) * len(narrow)
    if stage == shape.pp - 1:
        tokens = m.seq_length * train.micro_batch // cp
        volume += 3
        count += 3 + 3 * (-(-tokens // m.cross_entropy_chunk) if m.cross_entropy_chunk else 1)
    return volume, count


def dispatcher_messages(ep: int, etp: int) -> int:
    """Messages one rank sends per MoE layer and micro-batch, forward and backward, through
    megatron's alltoall dispatcher (token_dispatcher.py): the tokens' all-to-all at dispatch and
    combine and the probabilities' at dispatch, with their backward (6 over EP), the same over
    expert TP (the rows' all-gather and reduce-scatter, the probabilities' all-gather), and the
    tokens-per-expert counts all-gathered over EP x ETP once, forward only. The probabilities
    and counts are small: they cost messages, their bytes are left out."""
    return 6 * (ep - 1) + 6 * (etp - 1) + (ep * etp - 1)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step by term on the slowest stage (TERMS, "bubble", "overlapped"
    where traffic is hidden), and the tokens per second they give."""
    seconds: float
    terms: dict[str, float]
    micro_batches: int
    virtual_stages: int
    tokens_per_s: float
    tokens_per_s_per_gpu: float


def step_time(cfg: Config, layout, *, stage_params: list[dict[str, int]], rates: Rates = Rates(),
              gpus_per_node: int = 8, imbalance: float = 1.0, overlap: tuple[str, ...] = (),
              node_dispatch: bool = False, dualpipe: bool = False, ring_attention: bool = False) -> StepTime:
    """Seconds per optimizer step by term on the slowest stage, and tokens per second.
    `stage_params`: each stage's parameters by kind on one rank (the memory plan's); `imbalance`:
    the busiest EP rank's routed rows over the average (dropless routing); `overlap`: the terms
    that run beside the compute (planned only), `node_dispatch`: each token crosses to a node once,
    `dualpipe`: the pipeline runs DualPipe (planned only; see the module and plan.dualpipe),
    `ring_attention`: CP passes K and V round a ring (planned only; plan.context). The
    config's parallel.overlap_moe_expert_parallel_comm hides the all-to-all as plan.ep_overlap says."""
    m, train = cfg.model, cfg.train
    shape = model_shape(cfg, layout)
    t, p, ep, etp, dp, edp = layout.tp, layout.pp, layout.ep, layout.etp, layout.dp, layout.edp
    cp, v, zero_dp = layout.cp, layout.vpp, layout.zero_dp
    tokens = train.global_batch * m.seq_length / (dp * cp)  # this rank's share of its replica's tokens
    micro = train.global_batch // (train.micro_batch * dp)
    rate = rates.tflops * 1e12 * (rates.fp8_speedup if cfg.precision == "fp8" else 1.0)
    attention = rates.attention_tflops * 1e12 if rates.attention_tflops else rate
    nvlink, ib = rates.nvlink_gbs * 1e9, rates.ib_gbs * 1e9
    alpha = rates.latency_us * 1e-6
    hbm = rates.hbm_tbs * 1e12
    ep_overlapped = ep_overlap.runs(cfg.parallel, overlap, dualpipe)  # the trainer's combined 1F1B
    # ZeRO's traffic per parameter: its gradient reduce-scattered in the dtype it is reduced in
    # (fp32 under fp32 accumulation), the updated weight all-gathered in the weights' dtype
    zero_bytes = reduced_bytes(cfg.precision, train.grad_accum_dtype) + value_bytes(cfg.precision)

    # one pass of one MoE layer's local experts for one micro-batch: the same on every stage
    per_pass = expert_memory_seconds(m, train, cfg.precision, layout, rate, hbm, imbalance) if shape.has_moe else 0.0
    per_stage = []
    for stage in range(p):
        compute = _seconds(m, shape, stage, tokens, t, m.recompute, imbalance, rate, attention)
        forward = _seconds(m, shape, stage, tokens, t, "none", imbalance, rate, attention) / 3
        memory = per_pass * micro * expert_passes(m, shape, stage)
        layers = shape.stage_moe_layers(stage)
        fixed = rates.layer_ms * 1e-3 * micro * (len(layers) + m.mtp.num_layers * (stage == p - 1))
        act = tokens * m.hidden_size * WIRE_BYTES  # the replica's tokens x hidden, once
        volume, count = tensor_collectives(m, train, shape, stage, cp)
        tensor = volume * act * (t - 1) / t / (ib if _span(t, 1, gpus_per_node) else nvlink) \
            + alpha * count * micro * (t - 1) if t > 1 else 0.0
        rows = routed_rows(m.moe, tokens, imbalance) / t
        expert = 4 * sum(layers) * _dispatch_seconds(m, rows, layout, gpus_per_node, nvlink, ib, node_dispatch)
        # expert TP: after the all-to-all megatron's dispatcher all-gathers the rows over the ETP
        # group (each rank receives its ETP peers' rows) and the combine reduce-scatters them:
        # with their backward, 4 collectives per MoE layer of rows x (etp - 1) x h
        expert += 4 * sum(layers) * rows * (etp - 1) * m.hidden_size * WIRE_BYTES \
            / (ib if _span(etp, 1, gpus_per_node) else nvlink)
        expert += alpha * sum(layers) * micro * dispatcher_messages(ep, etp)
        # each exchange sends one share of the rank's K and V (plan.context); a recomputed core gathers again
        steps = cp_exchange.exchanges([again(SCORES) > 0 for _, again in stage_layers(m, shape, stage, m.recompute)],
                                      cp, ring_attention)
        context = steps * tokens * cp_exchange.kv_width(m, t) * WIRE_BYTES \
            / (ib if _span(cp, t, gpus_per_node) else nvlink) + alpha * steps * micro
        boundaries = (stage > 0) + (stage < p - 1)
        pipeline = v * boundaries * (2 * act / t / (ib if _span(p, t * cp * dp, gpus_per_node) else nvlink)
                                     + alpha * 2 * micro) if p > 1 else 0.0
        params = stage_params[stage]
        dense = sum(n for k, n in params.items() if k not in EXPERT_KINDS)
        experts = sum(n for k, n in params.items() if k in EXPERT_KINDS)
        data = (zero_bytes * dense * (zero_dp - 1) / zero_dp / (ib if _span(zero_dp, t, gpus_per_node) else nvlink)
                + zero_bytes * experts * (edp - 1) / edp
                / (ib if _span(edp, ep * etp, gpus_per_node) else nvlink)
                + alpha * 2 * ((zero_dp - 1) + (edp - 1) * (experts > 0)))
        per_stage.append({"compute": compute, "memory": memory, "fixed": fixed, "tensor": tensor, "context": context,
                          "expert": expert, "pipeline": pipeline, "data": data, "layers": len(layers),
                          "params": dense + experts,
                          "forward": forward, "recomputed": compute - 3 * forward,
                          "paired": ep_overlap.paired_share(p, v, stage, micro) if ep_overlapped else 0.0})
    if dualpipe:
        per_stage = dual.ranks(per_stage, layout, gpus_per_node, nvlink, ib, alpha,
                             reduced_bytes(cfg.precision, train.grad_accum_dtype))
    slowest = max(per_stage, key=lambda r: _busy(r, overlap))
    busy = _busy(slowest, overlap)
    if dualpipe:
        bubble = dual.bubble(busy, p, micro, slowest["forward"], slowest["recomputed"])
    else:
        bubble = busy * (p - 1) / (v * micro)
    waited = max(_exposed_data(r, overlap) for r in per_stage)  # of the ZeRO traffic
    terms = {k: value for k, value in slowest.items() if k in TERMS}
    terms.update(bubble=bubble, data=max(r["data"] for r in per_stage))
    seconds = busy + bubble + waited
    if overlap or ep_overlapped:
        terms["overlapped"] = seconds - sum(terms.values())
    return StepTime(seconds=seconds, terms=terms, micro_batches=micro, virtual_stages=v,
                    tokens_per_s=train.global_batch * m.seq_length / seconds,
                    tokens_per_s_per_gpu=train.global_batch * m.seq_length / seconds / layout.world)


TERMS = ("compute", "memory", "fixed", "tensor", "context", "expert", "pipeline", "data")
# a layer_flops of the attention cores alone: what stage_layers' recompute function makes of it says
# whether backward runs a layer's core attention again
SCORES = {**dict.fromkeys(("attention", *attention_kinds.flop_parts(), "mlp", "router", "experts", "shared", "matmul"),
                          0.0), "scores": 1.0}


def _seconds(m: ModelConfig, shape, stage, tokens, tp, recompute, imbalance, rate, attention) -> float:
    """A stage's FLOPs in seconds: the attention cores at `attention`, the rest at `rate`."""
    total = stage_flops(m, shape, stage, tokens, tp, recompute, imbalance)
    if attention == rate:
        return total / rate
    scores = stage_flops(m, shape, stage, tokens, tp, recompute, imbalance, scores_only=True)
    return (total - scores) / rate + scores / attention


def _busy(stage: dict, overlap: tuple[str, ...]) -> float:
    """A stage's compute and traffic per step, the `overlap` terms hidden behind its compute (the
    GEMMs' time, memory-bound experts' included), less the all-to-all the trainer's EP overlap
    hides (plan.ep_overlap; "paired" 0 without it, and in DualPipe's rows), and its fixed
    per-layer time, which hides nothing."""
    gemms = stage["compute"] + stage["memory"]
    hidden = sum(stage[k] for k in OVERLAPPABLE if k in overlap)
    exposed = sum(stage[k] for k in OVERLAPPABLE if k not in overlap)
    trainer = ep_overlap.hidden(stage["expert"], gemms, hidden, stage.get("paired", 0.0))
    return max(gemms, hidden) + exposed - trainer + stage["fixed"]


def _exposed_data(stage: dict, overlap: tuple[str, ...]) -> float:
    """What of a stage's ZeRO traffic the step waits for: all of it, or under "data" overlap one
    layer's share, or what the stage's compute cannot cover, whichever is more."""
    if "data" not in overlap:
        return stage["data"]
    return max(stage["data"] / max(stage["layers"], 1), stage["data"] - stage["compute"] - stage["memory"])
