"""The activations one rank of a pipeline stage keeps for backward: an estimate, per recompute mode.

Per layer and micro-batch, with s·b/cp tokens on the rank (context parallelism splits the
sequence), sequence parallelism (the tensors outside the attention and MLP cores split by TP) and
SDPA (no s² scores kept; but `local` below):
  attention  norm input, qkv input, q k v, core output: s·b·(3h + (heads + 2·groups)·d + heads·d)/tp
             (MLA: the latents, q and k of nope + rope width per head, v:
             s·b·(3h + latents + heads·(2·qk + 2·v))/tp)
  context    with CP > 1 the trainer's all-gather keeps, in place of the rank's own K and V, the
             gathered K and V its two query chunks see and their masks (plan.context:
             (2cp + 1)/(2cp)·s·b·kv/tp + (2cp + 1)·(s/(2cp))², s the whole sequence here);
             the ring (planned only) keeps the rank's own
  dense MLP  norm input, fc1 input, fc1 output [gate; up], and megatron's unfused glu (as this
             trainer runs it) keeps silu(gate), up + glu_linear_offset (a copy even at offset 0)
             and their product: s·b·(2h + 5·ffn/tp); a fused SwiGLU (planned only) keeps fc1's
             output and the product: 3·ffn/tp. The shared experts likewise.
  MoE        norm input and router input s·b·2h/tp, the s·b·k·etp/tp routed rows (each rank routes
             its sequence-parallel share, the dispatcher gathers them over expert TP; times the
             capacity factor when set, else `imbalance`: the busiest rank's share over the average)
             with their fc1 input, fc1 output and activation: rows·(h + 3·F/etp) (κ-SwiGLU
             or megatron's weighted SwiGLU, which keep no unscaled copy); megatron's SequentialMLP
             of plain experts (model.moe.grouped_gemm: false) runs each expert's unfused glu and
             scales its output: rows·(h + 6·F/etp)
  local      (model.attention: local, megatron's DotProductAttention) the [s, s] probabilities
             of each head, s·b·s·heads/tp in 4 bytes (fp32 softmax) and, in bf16, their 2-byte
             cast; GQA's key and value heads repeated: s·b·2·(heads − groups)·d/tp more
in 2 bytes (4 in fp32). Selective recompute drops what its modules (model.recompute_modules) keep:
core_attn the core's output (and CP's gathered K/V and masks: its checkpoint keeps the rank's own
q, k, v), mla_up_proj MLA's q, k, v (under CP's all-gather q alone: the own K and V are not kept), moe_act the experts'
activation, mlp a
dense MLP's fc1 output and glu's tensors, moe the routed rows' tensors and the shared expert's,
shared_experts the shared expert's (core_attn also local's probabilities and repeated heads).
Full keeps only each layer's input (s·b·h/tp; only the stage's first model.recompute_layers
layers when set, the rest keep everything) plus one layer's activations while it is recomputed. The output layer's
logits add one loss chunk
(model.cross_entropy_chunk tokens, or all s·b) × vocab/tp in fp32.

In flight: under 1F1B stage i holds pp − i micro-batches (at most the micro-batches per step);
under interleaved 1F1B with v virtual stages, megatron's warm-up of 2·(pp − i − 1) + (v − 1)·pp
chunks plus the one in backward, each 1/v of the stage's layers (at most v × the micro-batches).

Planned only (plan.planned): norm recompute drops the qkv and fc1/router inputs
(the norms' outputs); fp8 activations keep their tensors in 1 byte ("linear": the qkv and the
fc1 or router inputs, the core output, the dense and routed activations, the routed rows' fc1
input, the shared expert's activation; "moe": the routed rows' fc1 input and fc1 output, the SwiGLU's
input; "linear+moe" both, the fc1 input once);
activation offload leaves two chunks on the GPU.
"""
from __future__ import annotations

from megatron_kappa import attention_kinds
from megatron_kappa.config import Config
from megatron_kappa.config import recompute as selective
from megatron_kappa.plan import context
from megatron_kappa.plan.layout import model_shape
from megatron_kappa.plan.planned import Planned
from megatron_kappa.plan.routing import routed_rows_per_rank
from megatron_kappa.plan.units import value_bytes


def in_flight(pp: int, stage: int, micro_batches: int, vpp: int = 1) -> float:
    """Micro-batches' worth of the stage's layers kept at the peak (1F1B, or interleaved)."""
    if vpp == 1:
        return min(pp - stage, micro_batches)
    chunks = 2 * (pp - stage - 1) + (vpp - 1) * pp + 1
    return min(chunks, vpp * micro_batches) / vpp


def activation_bytes(cfg: Config, layout, stage: int, recompute: str, micro_batch: int, *,
                     imbalance: float = 1.0, planned: Planned = Planned(), held: float | None = None) -> float:
    """An estimate of the activations one rank of `stage` keeps for backward, in bytes (the
    module's docstring gives the count); `held`: that many micro-batches of the stage instead of
    the schedule's in-flight count (plan.dualpipe gives its own)."""
    m, moe, t = cfg.model, cfg.model.moe, layout.tp
    h, tokens = m.hidden_size, cfg.model.seq_length * micro_batch / layout.cp
    ffn = m.ffn_hidden_size or 4 * h
    size = value_bytes(cfg.precision)
    per = model_shape(cfg, layout).stage_counts()[stage]
    # the attention kind's (megatron_kappa.attention_kinds): the layer's attention tensors with its
    # core's output, the core's output alone, MLA's q, k and v (`up`, the up-projections' outputs)
    # and GQA's key and value heads as local attention repeats them
    kept = attention_kinds.of(m).activations(m, tokens, t)
    attention, core, up = kept["attention"], kept["core"], kept["up"]
    scores = 0.0  # local attention's probabilities (and GQA's repeated heads), in values of `size` bytes
    if m.attention == "local":
        probability_bytes = 4 + (2 if size == 2 else 0)  # softmax in fp32, then cast back for AV
        scores = tokens * m.seq_length * m.num_attention_heads / t * probability_bytes / size
        scores += kept["repeated"]
    norm_out = tokens * h / t  # a norm's output: the qkv input, the fc1 or router input
    # CP's all-gather: the gathered K/V and masks beyond the rank's own K and V, which it does not keep
    gathered = context.kept_values(cfg.model, tokens, t, layout.cp, planned.ring_attention)
    own_kv = context.own_values(cfg.model, tokens, t, layout.cp, planned.ring_attention)
    rows = routed_rows_per_rank(cfg.model.moe, layout, tokens, imbalance)
    expert_ffn = (moe.ffn_hidden_size or ffn) / layout.etp
    glu = 3 if planned.fused_swiglu else 5  # F-wide tensors a dense MLP or shared expert keeps a token
    shared_ffn = tokens * (moe.shared_ffn_hidden_size or 0) / t
    # F-wide tensors a routed row keeps: fc1's output and fc2's input (the grouped experts, κ or
    # plain, keep no unscaled activation: kappa/reference.py's op scales by p itself, Triton's
    # through model/experts.py ScaledByProbs, plain through megatron's weighted SwiGLU);
    # megatron's SequentialMLP of plain experts, its MLPs' unfused glu and the scaling
    routed = 3 if moe.grouped_gemm or m.kappa.enabled else 6
    shape = model_shape(cfg, layout)
    modules = set(selective.selected(m, shape.has_moe)) if recompute == "selective" else set()
    norms = planned.recompute_norms and recompute == "selective"  # a selective module, as in megatron
    linear, moe_fp8 = "linear" in planned.fp8_activations, "moe" in planned.fp8_activations
    layers = []
    for is_moe in shape.stage_moe_layers(stage):
        core_again = "core_attn" in modules
        dropped = ((core + scores + gathered) * core_again + up * ("mla_up_proj" in modules)
                   - own_kv * ("mla_up_proj" in modules) * (not core_again) + 2 * norm_out * norms)
        # tensors kept in fp8: counted again at -1/2 (1 byte instead of 2)
        fp8 = linear * (2 * norm_out * (not norms) + core * ("core_attn" not in modules))
        if is_moe:
            mlp = 2 * tokens * h / t + rows * (h + routed * expert_ffn) + glu * shared_ffn
            routed_dropped = "moe" in modules
            act_dropped = routed_dropped or "moe_act" in modules
            shared_dropped = routed_dropped or "shared_experts" in modules
            if routed_dropped:
                dropped += rows * (h + routed * expert_ffn) + glu * shared_ffn
            else:
                dropped += rows * expert_ffn * act_dropped + glu * shared_ffn * shared_dropped
            fp8 += linear * (rows * h * (not routed_dropped) + rows * expert_ffn * (not act_dropped)
                             + shared_ffn * (not shared_dropped))
            fp8 += moe_fp8 * rows * (h * (not linear) + 2 * expert_ffn) * (not routed_dropped)
        else:
            mlp = tokens * (2 * h + glu * ffn / t)
            dropped += tokens * glu * ffn / t * ("mlp" in modules)
            fp8 += linear * tokens * ffn / t * ("mlp" not in modules)
        full_layer = attention + scores + gathered + mlp
        kept_layer = {"none": full_layer, "selective": full_layer - dropped}.get(recompute, full_layer)
        if size == 2 and recompute != "full":
            kept_layer -= fp8 / 2
        layers.append(kept_layer)
    if recompute == "full":  # model.recompute_layers: only the stage's first N layers (megatron's block method)
        n = per if m.recompute_layers is None else min(m.recompute_layers, per)
        kept = n * tokens * h / t + sum(layers[n:]) + max(layers[:n], default=0)
    else:
        kept = sum(layers)
    if stage == layout.pp - 1:
        chunk = min(m.cross_entropy_chunk or tokens, tokens)
        kept += chunk * shape.padded_vocab / t * 4 / size
    if held is None:
        micro_batches = max(1, cfg.train.global_batch // (micro_batch * layout.dp))
        held = in_flight(layout.pp, stage, micro_batches, layout.vpp)
        if planned.offload_activations:
            held = min(held, 2 / layout.vpp)
    return kept * size * held
