"""The config schema: one dataclass per YAML section, each value with its default and help text.

This is the one place every settable value, its default and its facts live (its range, whether it
shapes the parameters or optimizer state: megatron_kappa.config.facts); docs/config.md is generated
from it by `python -m megatron_kappa.config --markdown`. Reading YAML and `--set` overrides is in
megatron_kappa.config.loading, the cross-field checks in megatron_kappa.config.checks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

from megatron_kappa import attention_kinds, routers
from megatron_kappa.config import recompute as selective
from megatron_kappa.config.facts import (AT_LEAST_ONE, BEYOND_ONE, FRACTION, NON_NEGATIVE, OPEN_FRACTION,
                                         OPEN_UNIT, POSITIVE, PROBABILITY)
from megatron_kappa.config.facts import key as _f
from megatron_kappa.config.facts import section as _section
from megatron_kappa.kappa import DEFAULTS as KAPPA
from megatron_kappa.kappa import inputs as kappa_inputs


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the key."""


@dataclass
class KappaConfig:
    enabled: bool = _f(True, "κ-SwiGLU experts (false: plain SwiGLU experts, the baseline)", state=True)
    # input: a name in megatron_kappa.kappa.inputs.VARIANTS, which may grow at run time
    # (`register`), so it is checked when the config is validated (config/checks.py), not here
    input: str = _f(KAPPA.input, kappa_inputs.input_help(), allowed="a κ input's name (megatron_kappa.kappa.inputs)")
    U: Optional[float] = _f(None, f"κ range: κ ∈ (1/U, U) ({kappa_inputs.null_help('U')})", range=BEYOND_ONE)
    use_alpha: bool = _f(KAPPA.use_alpha, "learn α (false: the paper's κ-SwiGLU₋α ablation)", state=True)
    use_bias: bool = _f(KAPPA.use_bias, "learn b (false: the paper's κ-SwiGLU₋b ablation)", state=True)
    logit_scale: float = _f(KAPPA.logit_scale, "multiplies the router logit "
                                               f"({kappa_inputs.scale_help('logit_scale')})", range=POSITIVE)
    tanh_gain: float = _f(KAPPA.tanh_gain, f"gain inside tanh ({kappa_inputs.scale_help('tanh_gain')})", range=POSITIVE)
    router_grad_scale: Optional[float] = _f(
        None, "the κ path's gradient into the router logit is multiplied by this (forward unchanged; the "
              f"routing probabilities' gradient is not) ({kappa_inputs.null_help('router_grad_scale')})",
              range=NON_NEGATIVE)
    u_warmup: Optional[float] = _f(
        None, "U ramps linearly from 1 to U over this fraction of the iterations, starting when α, b "
              f"unfreeze ({kappa_inputs.null_help('u_warmup', {0.0: 'U constant'})})", range=PROBABILITY)
    backend: Literal["auto", "triton", "torch"] = _f(
        KAPPA.backend, "κ-SwiGLU implementation: fused Triton kernels (triton), the row-chunked torch op "
                       "(torch), or auto: Triton for CUDA tensors, torch otherwise; a Triton kernel that "
                       "cannot compile on the machine stops naming this key")
    schedule: Literal["paper", "authors"] = _f(
        "paper", "κ freeze and learning rate: paper (freeze 10 %; warmup to lr, linear to lr_end) or authors "
                 "(freeze max(200 steps, 5 %); lr × (hidden_size/768)^-0.5 × the main LR multiplier × "
                 "[0 → 1 over warmup, then → lr_end/lr]; docs/recipe.md)")
    freeze_fraction: Optional[float] = _f(None, "α, b held at exactly 0 for this fraction of iterations "
                                                "(null: 0.1 paper, 0.05 authors)", range=FRACTION)
    freeze_min_steps: Optional[int] = _f(None, "α, b held at 0 for at least this many steps (null: 0 paper, "
                                               "200 authors)", range=NON_NEGATIVE)
    freeze_optimizer_state: Literal["drop", "keep"] = _f(
        "drop", "AdamW's state of α, b at the unfreeze: drop (start fresh: step 1, zero moments) or keep "
                "(14c9b04: its AdamW counts a step for every parameter with a gradient, the frozen ones' zero "
                "gradients included, so the first updates use the bias corrections of step delay + 1 on; "
                "nanochat/optim.py 919-934)")
    alpha_optimizer: Literal["adamw", "matrix"] = _f(
        "adamw", "α's optimizer: adamw (κ's group with b: κ's schedule, freeze and learning rate; the paper's "
                 "prose and 02b8de3) or matrix (14c9b04: the 2-D α joins the matrices' group, their optimizer, "
                 "lr, weight decay and schedule, no κ warm-up; orthogonalised as one [E, F] matrix per layer, "
                 "its EP×ETP shards gathered; under train.optimizer adamw the AdamW matrix group); the freeze "
                 "still holds α at 0 (docs/optimizer.md)", state=True)
    lr: Optional[float] = _f(None, "κ learning-rate peak, reached after `warmup` iterations past unfreezing "
                                   "(authors: before their width scaling and main-LR multiplier) "
                                   f"({kappa_inputs.null_help('lr')})", range=NON_NEGATIVE)
    lr_end: Optional[float] = _f(None, "κ learning rate at the last iteration (linear decay; authors: likewise, "
                                       f"before the main-LR multiplier) ({kappa_inputs.null_help('lr_end')})",
                                       range=NON_NEGATIVE)
    warmup: int = _f(1000, "κ learning-rate warmup iterations after unfreezing", range=NON_NEGATIVE)
    batch_lr_scaling: bool = _f(False, "κ's learning rate × √(tokens per step / 2¹⁹), as the authors' κ group "
                                       "takes the batch-scaled embedding rate as its base")
    l2_alpha: Optional[float] = _f(None, "L2 penalty weight λ_α of α² (paper §3.4 and the authors' code at the "
                                         f"paper's date: 2e-2) ({kappa_inputs.null_help('l2_alpha')})",
                                         range=NON_NEGATIVE)
    l2_bias: float = _f(1e-2, "L2 penalty weight λ_b of b² (paper §3.4 and the authors' code: 1e-2)",
                        range=NON_NEGATIVE)
    l2_reduction: Literal["mean", "sum"] = _f(
        "mean", "per MoE layer λ_α·mean(α²) + λ_b·mean(b²) over the layer's [E, F] entries, summed over "
                "layers (the authors' code); sum: λ_α Σα² + λ_b Σb² over every entry (the paper's text, "
                "~E·F times stronger per entry: κ cannot leave 1; docs/recipe.md)")


@dataclass
class FP8Config:
    """model.fp8: which GEMMs run in FP8 when `precision: fp8` (docs/fp8.md)."""
    backend: Literal["torchao", "te"] = _f(
        "torchao", "torchao's float8 training GEMMs inside megatron's parallel linears and the grouped "
                   "experts; te is refused (Transformer Engine does not import without CUDA, and without it "
                   "megatron-core's fp8 flag silently stays bf16)")
    recipe: Literal["rowwise", "tensorwise", "rowwise_with_gw_hp"] = _f(
        "rowwise", "torchao's Float8LinearConfig recipe for the linears (the experts' grouped GEMMs are always "
                   "rowwise e4m3 with power-of-2 scales: torchao's only FP8 grouped GEMM)")
    attention: bool = _f(True, "FP8 for the attention projections (linear_qkv, linear_proj)")
    dense_mlp: bool = _f(True, "FP8 for the dense layers' MLP (linear_fc1, linear_fc2)")
    experts: bool = _f(True, "FP8 for the routed experts' grouped GEMMs (fc1, fc2; needs "
                             "model.moe.grouped_gemm); κ, the router, norms, embedding and output stay bf16")


@dataclass
class SoftMoEConfig:
    """model.moe.router: softmoe (docs/softmoe.md; defaults marked there as reconstructions)."""
    budget: Optional[float] = _f(None, "mean over the MoE layers of k_l, each layer's mean active experts "
                                       "per token; held exactly (null: model.moe.topk)", range=POSITIVE)
    allocation: Literal["softmax", "lapsum"] = _f(
        "softmax", "k_l from one learned θ_l per layer: L·budget·softmax(θ)_l clamped to [1e-3, E − 1e-3], "
                   "or E·LapSum(θ; L·budget/E)_l, inside (0, E) with no clamp")
    temperature: float = _f(0.1, "LapSum scale α (→ 0: hard top-k of the logits; large: k_l/E everywhere)",
                            range=POSITIVE)
    threshold: float = _f(0.05, "truncation τ: experts with p < τ are not run (0: every expert runs)", range=FRACTION)
    normalize: Literal["none", "sum", "budget"] = _f(
        "none", "routing weights: the truncated p as is, divided by their sum, or scaled to sum to k_l")
    max_experts: Optional[int] = _f(None, "cap on experts run per token (memory); the largest p are kept, "
                                          "and tokens over it are counted in metrics (null: num_experts)",
                                          range=POSITIVE)


@dataclass
class MoEConfig:
    num_experts: int = _f(8, "routed experts per MoE layer", range=POSITIVE, state=True)
    topk: int = _f(2, "experts per token", range=POSITIVE)
    ffn_hidden_size: Optional[int] = _f(None, "expert hidden size (default: model.ffn_hidden_size)",
                                        range=POSITIVE, state=True)
    shared_ffn_hidden_size: Optional[int] = _f(
        None, "hidden size of a shared expert that every token passes through beside the routed ones "
              "(megatron's moe_shared_expert_intermediate_size: a plain SwiGLU MLP, TP-sharded like a "
              "dense one; null: none)", range=POSITIVE, state=True)
    # router: a name in megatron_kappa.routers.ROUTERS, which may grow at run time (`register`), so
    # it is checked when the config is validated (config/checks.py), not here
    router: str = _f(routers.DEFAULT, routers.router_help(),
                     allowed="a router's name (megatron_kappa.routers)", state=True)
    aux_loss: Optional[float] = _f(1e-3, "Switch load-balancing loss weight (softmax and softmoe routers); null: "
                                         "14c9b04's rule, 1e-3 halved to 5e-4 when model.kappa.enabled (its "
                                         "base_train.py 355-356; config/presets.py resolves it when the config "
                                         "is read)", range=NON_NEGATIVE)
    z_loss: float = _f(1e-5, "router z-loss weight", range=NON_NEGATIVE)
    aux_loss_form: Literal["megatron", "authors"] = _f(
        "megatron", "megatron: megatron-core's Switch loss E·Σ_e P_e·f_e with f_e the share of the top-k "
                    "assignments (Σf = 1); authors: f_e per token (Σf = topk), i.e. topk × megatron's (the "
                    "authors' compute_aux_loss; docs/recipe.md); top-k routers")
    aux_loss_warmup_scale: float = _f(
        1.0, "the aux-loss weight starts at this multiple of aux_loss and moves linearly to aux_loss over "
             "aux_loss_warmup_steps (authors: 2.0 over 500)", range=NON_NEGATIVE)
    aux_loss_warmup_steps: int = _f(0, "steps of the aux-loss weight's anneal (0: aux_loss throughout)",
                                    range=NON_NEGATIVE)
    z_loss_form: Literal["megatron", "authors"] = _f(
        "megatron", "megatron: mean over tokens of lse(l)²; authors: of lse(l − l̄)² + l̄², l̄ the token's mean "
                    "logit over the experts (the authors' compute_z_loss); top-k routers")
    z_loss_input_grad_scale: float = _f(
        1.0, "the z-loss gradient into the router's input (the hidden state) × this, the router weight's "
             "kept (authors: 0.1); top-k routers", range=NON_NEGATIVE)
    router_dtype: Literal["fp32", "params"] = _f(
        "fp32", "the router's logits in fp32, or in the parameters' dtype (bf16 under precision bf16, as the "
                "authors' code runs its router)")
    route_scale: float = _f(1.0, "constant multiplying the routing weights (Trinity-Large: 2.448; DeepSeek-V3: 2.5)",
                            range=POSITIVE)
    num_groups: Optional[int] = _f(None, "group-limited routing (DeepSeek-V2/V3): the experts in this many equal "
                                         "groups; a token picks its top-k among the experts of its group_topk best "
                                         "groups, a group scored by the sum of its topk / group_topk best experts "
                                         "(megatron's moe_router_num_groups; DeepSeek-V3: 8, one per node; null: none)",
                                         range=POSITIVE)
    group_topk: Optional[int] = _f(None, "groups each token may use under num_groups (DeepSeek-V3: 4)", range=POSITIVE)
    seq_aux_loss: float = _f(0.0, "weight of the sequence-wise balance loss (DeepSeek-V3: 1e-4 beside its aux-free "
                                  "bias; megatron's seq_aux_loss); sigmoid router", range=NON_NEGATIVE)
    bias_update_rate: float = _f(1e-3, "expert-bias update rate (sigmoid router)", range=NON_NEGATIVE)
    dispatcher: Literal["alltoall", "allgather", "sorted"] = _f(
        "alltoall", "token dispatcher: megatron-core's alltoall or allgather, or sorted (no host sync; "
                    "all experts on one rank: EP = TP = ETP = 1, a top-k router, no capacity factor)")
    capacity_factor: Optional[float] = _f(None, "expert capacity factor in training (null: no token "
                                                "dropping; authors: 1.0, tokens over capacity dropped)", range=POSITIVE)
    capacity: Literal["megatron", "authors"] = _f(
        "megatron", "expert capacity of a group of T tokens (one router call: a rank's micro-batch, / tp under "
                    "sequence parallelism) with capacity_factor f: megatron: ceil(T·k/E·f); authors: "
                    "floor(k·f·T/E) rounded up to even, at least 4 (14c9b04 gpt.py 679-687; "
                    "megatron_kappa/model/capacity.py)")
    drop_order: Literal["probs", "position", "authors"] = _f(
        "probs", "which tokens an expert over capacity drops: probs: the lowest routing weights, position: the "
                 "latest tokens (megatron-core's policies); authors: the top-1 choices fill the experts first, "
                 "then the top-2, each in the order of the tokens, batch row by batch row (14c9b04 gpt.py "
                 "577-600)")
    grouped_gemm: bool = _f(True, "all local experts in two grouped GEMMs (torch.nn.functional.grouped_mm) "
                                  "instead of megatron's per-expert loop (SequentialMLP); needs d_model and "
                                  "the expert ffn size / etp to be multiples of 4 (fp32) or 8 (bf16)", state=True)
    softmoe: SoftMoEConfig = _section(SoftMoEConfig)

    @property
    def aux_loss_weight(self) -> float:
        """aux_loss as megatron-core's coefficient: × topk for aux_loss_form authors."""
        return self.aux_loss * (self.topk if self.aux_loss_form == "authors" else 1)

    @property
    def active_experts(self) -> float:
        """Experts per token, by the router's rule (megatron_kappa.routers): topk, or the SoftMoE
        budget (its mean over layers)."""
        return routers.lookup(self.router).active_experts(self)


@dataclass
class MLAConfig:
    """model.mla: multi-head latent attention (DeepSeek-V2/V3), megatron-core's MLASelfAttention."""
    enabled: bool = _f(False, "multi-head latent attention instead of (grouped-query) attention, megatron's "
                              "multi_latent_attention flag (model.attention_kind mla): queries and keys/values "
                              "projected through low-rank latents, a RoPE part of the key shared by all heads "
                              "(model.num_query_groups and model.head_dim are not used; model.qk_layernorm norms "
                              "the two latents, as DeepSeek-V3)")
    q_lora_rank: Optional[int] = _f(None, "rank of the query latent (null: queries projected directly, as "
                                          "DeepSeek-V2-Lite; DeepSeek-V3 and Kimi K2: 1536)", range=POSITIVE)
    kv_lora_rank: int = _f(512, "rank of the joint key/value latent (DeepSeek-V3: 512)", range=POSITIVE)
    qk_head_dim: int = _f(128, "per-head query/key width without position (DeepSeek-V3: 128)", range=POSITIVE)
    qk_pos_emb_head_dim: int = _f(64, "per-head query/key width that carries RoPE; the key's is one per token, "
                                      "shared by the heads (DeepSeek-V3: 64)", range=POSITIVE)
    v_head_dim: int = _f(128, "per-head value width (DeepSeek-V3: 128)", range=POSITIVE)


@dataclass
class MTPConfig:
    """model.mtp: multi-token prediction (DeepSeek-V3), megatron-core's MultiTokenPredictionBlock."""
    num_layers: int = _f(0, "MTP modules after the model, each predicting one token further: the previous depth's "
                            "hidden state and the next token's embedding, normed, projected, through one layer of the "
                            "last layer's kind, into the shared output layer (DeepSeek-V3: 1; 0: none)",
                            range=NON_NEGATIVE, state=True)
    loss_weight: float = _f(0.3, "λ: the MTP losses' mean, times this, joins the objective (DeepSeek-V3: 0.3, "
                                 "then 0.1 for the last 4.8T tokens)", range=NON_NEGATIVE)


@dataclass
class ModelConfig:
    block: Literal["megatron", "nanochat"] = _f(
        "megatron", "the transformer block, a preset of the block keys below that the config does not set "
                    "itself (megatron_kappa.config.presets): megatron (megatron-core's GPT block) or nanochat "
                    "(the authors' block at 14c9b04: value_embeddings, embedding_norm, residual_scalars, "
                    "norm_gains false, norm_eps 1.19e-7, logit_softcap 15, init nanochat; docs/recipe.md)", state=True)
    num_layers: int = _f(4, "transformer layers", range=POSITIVE, state=True)
    aspect_ratio: Optional[int] = _f(
        None, "hidden_size = ⌈num_layers · aspect_ratio / head_dim⌉ · head_dim and num_attention_heads = "
              "hidden_size / head_dim (head_dim null: 128), the authors' width rule (14c9b04 "
              "scripts/base_train.py 548-556); it also sets the automatic batch's depth-12 reference width "
              "(null: hidden_size and heads as given; the reference at the authors' default 96)",
              range=POSITIVE, state=True)
    hidden_size: int = _f(128, "d_model", range=POSITIVE, state=True)
    num_attention_heads: int = _f(4, "attention heads", range=POSITIVE, state=True)
    num_query_groups: Optional[int] = _f(None, "GQA groups (null: no GQA)", range=POSITIVE, state=True)
    head_dim: Optional[int] = _f(None, "per-head width (null: hidden_size / heads)", range=POSITIVE, state=True)
    ffn_hidden_size: Optional[int] = _f(None, "dense MLP hidden size (null: 4 × hidden_size)",
                                        range=POSITIVE, state=True)
    vocab_size: int = _f(32768, "vocabulary size (padded to a multiple of 128 × TP in the model)",
                         range=POSITIVE, state=True)
    seq_length: int = _f(2048, "training sequence length", range=POSITIVE)
    layout: Literal["dense", "moe", "sandwich"] = _f(
        "moe", "dense: no MoE; moe: first `first_dense` layers dense, the rest MoE; "
               "sandwich: only the middle two layers MoE", state=True)
    first_dense: int = _f(2, "dense layers before the MoE layers (layout: moe)", range=NON_NEGATIVE, state=True)
    qk_layernorm: bool = _f(True, "RMSNorm on queries and keys", state=True)
    norm_gains: bool = _f(True, "learnable RMSNorm gains (false: parameter-free RMSNorm everywhere, as the "
                                "authors' nanochat block: 14c9b04 nanochat/gpt.py 315-317)", state=True)
    norm_eps: float = _f(1e-5, "RMSNorm epsilon (the authors' F.rms_norm default: the fp32 machine epsilon, "
                               "1.1920929e-07)", range=POSITIVE)
    logit_softcap: Optional[float] = _f(
        None, "logits → c·tanh(logits / c) before the loss and in evaluation (the authors' nanochat block: 15, "
              "14c9b04 nanochat/gpt.py 2447; null: none)", range=POSITIVE)
    value_embeddings: bool = _f(
        False, "on every other layer (i % 2 == (num_layers − 1) % 2, the last one included) an embedding of "
               "the input tokens, [vocab, kv heads · head_dim], added to the attention values as "
               "v + 2σ(W·x[..., :32])·ve, W one zero-initialised gate row per kv head (14c9b04 nanochat/gpt.py "
               "319-321, 360-379); trained with the input embedding's AdamW rate", state=True)
    embedding_norm: bool = _f(False, "RMSNorm (parameter-free) on the input embedding's output (14c9b04 "
                                     "nanochat/gpt.py 2432)")
    residual_scalars: bool = _f(
        False, "before every layer x = λ_resid·x + λ_x0·x0, x0 the (normed) input embedding, one learned "
               "λ_resid (init 1) and λ_x0 (init 0) per layer (14c9b04 nanochat/gpt.py 2436; AdamW at "
               "train.lr_resid_scalar and train.lr_x0_scalar); refuses model.recompute full", state=True)
    rotary_base: int = _f(10000, "RoPE base", range=POSITIVE)
    init_std: float = _f(0.02, "weight init standard deviation (init megatron)", range=POSITIVE)
    init: Literal["megatron", "nanochat"] = _f(
        "megatron", "megatron: normal(0, init_std), the output projections scaled by depth; nanochat (the authors' "
                    "block, 14c9b04 nanochat/gpt.py 2030-2120): the matrices U(±√3/√hidden_size), the attention "
                    "and MLP/expert output projections 0, the embedding N(0, 1), the output layer N(0, 0.001); the "
                    "router, which the authors leave uninitialised, as the matrices")
    cross_entropy_chunk: int = _f(4096, "tokens per chunk of the loss (megatron_kappa.model.loss): the "
                                        "fp32 softmax exists for one chunk at a time; 0: megatron-core's "
                                        "vocab_parallel_cross_entropy (fp32 logits of the whole micro-batch)",
                                        range=NON_NEGATIVE)
    recompute: Literal["none", "selective", "full"] = _f(
        "none", "activation recomputation: none; selective (core attention, and the experts' "
                "activation with grouped GEMMs, recomputed in backward); full (every layer's input "
                "kept, the layer recomputed: megatron's uniform method, one layer per checkpoint)")
    recompute_layers: int | None = _f(
        None, "with recompute: full, recompute only the first N layers of each pipeline stage (megatron's block "
              "method); the others keep their activations. null: every layer (the uniform method)", range=POSITIVE)
    recompute_modules: list | None = _f(
        None, "with recompute: selective, megatron's modules to recompute in backward (null: core_attn, and "
              f"moe_act with grouped GEMMs): {selective.describe()}. megatron's layernorm needs Transformer Engine "
              "(megatron_kappa/config/recompute.py)")
    attention: Literal["sdpa", "local", "te"] = _f(
        "sdpa", "core attention: torch's scaled_dot_product_attention (flash/cuDNN/memory-efficient "
                "kernels), megatron's local DotProductAttention (materialises the scores; for "
                "comparison), or Transformer Engine's (GPU, where TE imports)")
    # attention_kind: a name in megatron_kappa.attention_kinds.KINDS, which may grow at run time
    # (`register`), so it is checked when the config is validated (config/checks.py), not here
    attention_kind: Optional[str] = _f(
        None, f"the attention kind (megatron_kappa.attention_kinds): {attention_kinds.help_text()}; null: mla when "
              "model.mla.enabled, else gqa. Not model.attention, the core-attention kernel inside either kind",
        allowed="null or a kind's name (megatron_kappa.attention_kinds)", state=True)
    compile: Literal["auto", True, False] = _f(
        "auto", "torch.compile each transformer layer, as torchtitan compiles its blocks "
                "(megatron_kappa/model/compile.py: the MoE dispatch stays eager at one named boundary; the "
                "start line counts the graph breaks): auto (on for CUDA, off on CPU, where eager is the "
                "faster start), true or false")
    mla: MLAConfig = _section(MLAConfig, state=True)
    mtp: MTPConfig = _section(MTPConfig)
    moe: MoEConfig = _section(MoEConfig)
    kappa: KappaConfig = _section(KappaConfig)
    fp8: FP8Config = _section(FP8Config)


@dataclass
class ParallelConfig:
    tp: int = _f(1, "tensor parallel size (sequence parallelism is on when tp > 1)", range=POSITIVE)
    ep: int = _f(1, "expert parallel size", range=POSITIVE)
    etp: Optional[int] = _f(None, "expert tensor parallel size (null: same as tp)", range=POSITIVE)
    pp: int = _f(1, "pipeline parallel size: model.num_layers split evenly over pp stages (or as first_stage_layers / "
                    "last_stage_layers say), the embedding on "
                    "the first and the output layer on the last; megatron-core's 1F1B schedule with ZeRO-1 "
                    "(ZeRO-2, softmoe and eval.core_every are refused with pp > 1; docs/pipeline.md)", range=POSITIVE)
    first_stage_layers: Optional[int] = _f(
        None, "uneven pipeline stages: layers on the first stage (megatron's num_layers_in_first_pipeline_stage; "
              "the stages without a set count split the rest evenly; null: an even split)", range=POSITIVE)
    last_stage_layers: Optional[int] = _f(
        None, "layers on the last stage (megatron's num_layers_in_last_pipeline_stage), e.g. fewer, to leave room "
              "for the output layer and the loss", range=POSITIVE)
    layout: Optional[str] = _f(
        None, "megatron's pipeline_model_parallel_layout instead of first/last_stage_layers: each stage's layers, "
              "stages separated by '|': E the embedding (opens the first), t a decoder layer, m an MTP layer, L the "
              "loss (closes the last); x*n and (...)*n repeat, e.g. 'Et*3|t*2mL'; one entry per stage and virtual stage "
              "(pp × vpp, megatron's order: entry c on rank c mod pp); an entry without a t (e.g. 'Et|(tt|)*30mL') "
              "is the planner's only: the trainer refuses it (megatron_kappa/config/stage_layout.py)")
    vpp: int = _f(1, "virtual pipeline stages per pipeline rank (megatron's virtual_pipeline_model_parallel_size): "
                     "interleaved 1F1B over pp × vpp model chunks, chunk c on rank c mod pp; the layers split evenly "
                     "over the chunks, or as parallel.layout says with pp × vpp entries; the micro-batches per step "
                     "must be a multiple of pp (docs/pipeline.md)", range=POSITIVE)
    cp: int = _f(1, "context parallel size: each sequence split over cp ranks in megatron's load-balanced causal "
                    "layout (2·cp chunks, rank r holds chunks r and 2·cp−1−r; model.seq_length divisible by 2·cp), "
                    "keys and values all-gathered over them; needs model.attention sdpa, refused with model.mtp and "
                    "the softmoe router (docs/context_parallel.md)", range=POSITIVE)
    overlap_moe_expert_parallel_comm: bool = _f(
        False, "megatron-core's EP communication overlap: each step's micro-batches run through its combined 1F1B "
               "schedule, one micro-batch's forward interleaved layer by layer with the previous one's backward, so "
               "that on a GPU each all-to-all runs on a side stream beside the other micro-batch's compute; needs "
               "ep >= 2, the alltoall dispatcher, precision bf16 or fp8 and, with pp > 1, vpp > 1 (docs/ep_overlap.md)")
    delay_wgrad_compute: bool = _f(
        False, "with overlap_moe_expert_parallel_comm: the grouped experts' weight gradients are computed after the "
               "next micro-batch's dispatch is issued instead of inside their backward (megatron's backward_dw); "
               "needs model.moe.grouped_gemm (docs/ep_overlap.md)")
    timeout_s: float = _f(600.0, "seconds a collective waits for the other ranks before the job fails "
                                 "(a dead or hung rank; torch's defaults: 30 min gloo, 10 min NCCL)", range=POSITIVE)

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size in effect (`etp`, or `tp` when unset)."""
        return self.etp or self.tp

    @property
    def megatron_schedule(self) -> bool:
        """Whether a step runs through megatron-core's schedule (pipeline stages, or the EP overlap's
        combined 1F1B) instead of DeepSpeed's forward and backward per micro-batch."""
        return self.pp > 1 or self.overlap_moe_expert_parallel_comm


@dataclass
class MuonConfig:
    lr: float = _f(0.01, "peak learning rate of the orthogonalised matrices (train.lr's schedule; authors: 0.01)",
                   range=NON_NEGATIVE)
    momentum: float = _f(0.95, "momentum β of the EMA buffer M ← βM + (1-β)G", range=FRACTION)
    nesterov: bool = _f(True, "Nesterov: orthogonalise (1-β)G + βM instead of M")
    ns_steps: int = _f(5, "Newton–Schulz iterations per polar factor (authors: 5)", range=AT_LEAST_ONE)
    weight_decay: float = _f(0.05, "decoupled weight decay W ← W·(1 - lr·wd) of the orthogonalised matrices",
                             range=NON_NEGATIVE)
    aurora_rounds: int = _f(2, "aurora: row-equilibration rounds of a rectangular matrix (authors' pp_iterations)",
                            range=AT_LEAST_ONE)
    aurora_exponent: float = _f(0.5, "aurora: exponent of the row rescaling D ← D·((n/m)/‖u_i‖²)^exponent (pp_beta)",
                                range=NON_NEGATIVE)
    scale: Optional[Literal["original", "match_rms_adamw", "none"]] = _f(
        None, "step scale per [m, n] matrix: original √max(1, m/n), match_rms_adamw 0.2·√max(m, n) "
              "capped at 1, none (null: original for muon, match_rms_adamw for aurora, as the authors)")
    max_scale: Optional[float] = _f(None, "cap on the step scale (null: 1.0 for match_rms_adamw, none otherwise)",
                                    range=POSITIVE)


@dataclass
class TrainConfig:
    steps: Optional[int] = _f(None, "optimizer steps (null: the token budget 5 × N_eff)", range=POSITIVE)
    seed: int = _f(24, "random seed (paper: 24, 26, 28)", range=NON_NEGATIVE)
    micro_batch: int = _f(1, "sequences per rank per forward", range=POSITIVE)
    global_batch: int = _f(8, "sequences per optimizer step (gradient accumulation fills the rest; "
                              "the authors' automatic size is printed by megatron_kappa.summary)", range=POSITIVE)
    tokens_per_param: float = _f(5.0, "token budget = tokens_per_param × N_eff when train.steps is null "
                                      "(paper App. 8; authors' --target-param-data-ratio 5)", range=POSITIVE)
    budget_discount: Optional[bool] = _f(
        None, "count the routed experts at √(k/E) in N_eff (true/false); null: the authors' rule, "
              "true only when MoE layers ≥ num_layers / 5 (false for the sandwich models)")
    optimizer: Literal["adamw", "muon", "aurora"] = _f(
        "adamw", "matrix optimizer: adamw, or the orthogonalised update of Muon (KellerJordan/Muon, as DeepSpeed "
                 "has it; not the authors' Muon variant) or of the authors' Aurora (train.muon; attention, "
                 "dense-MLP and expert matrices, AdamW for the rest; docs/optimizer.md)", state=True)
    router_optimizer: Literal["adamw", "matrix"] = _f(
        "adamw", "muon/aurora: the routers' optimizer: adamw (train.lr, train.weight_decay) or matrix (the "
                 "orthogonalised update with the matrices, as the authors' code does); adamw: no effect", state=True)
    lr: float = _f(3e-4, "peak learning rate of matrix parameters under AdamW (muon/aurora: of the routers "
                         "when train.router_optimizer is adamw)", range=NON_NEGATIVE)
    lr_non_matrix: float = _f(3e-4, "peak AdamW learning rate of norms and other non-matrix parameters, and of "
                                    "the embedding and output layer unless lr_embedding/lr_output are set",
                                    range=NON_NEGATIVE)
    lr_embedding: Optional[float] = _f(None, "peak AdamW learning rate of the input embedding (null: "
                                             "lr_non_matrix; authors: 0.3)", range=NON_NEGATIVE)
    lr_output: Optional[float] = _f(None, "peak AdamW learning rate of the output layer (null: lr_non_matrix; "
                                          "authors: 0.004)", range=NON_NEGATIVE)
    adamw_width_scaling: bool = _f(False, "multiply the embedding, output and non-matrix learning rates by "
                                          "(hidden_size / 768)^-0.5 (the authors' dmodel_lr_scale)")
    batch_lr_scaling: bool = _f(False, "multiply every learning rate but κ's by sqrt(global_batch · seq_length "
                                       "/ 2^19) (the authors' batch_lr_scale)")
    lr_decay_style: Literal["cosine", "wsd"] = _f(
        "cosine", "cosine: linear warmup, cosine decay to min_lr_ratio at the last step; wsd (Megatron's "
                  "name): linear warmup, constant, then linear decay over the last lr_wsd_decay_fraction of "
                  "the steps towards min_lr_ratio (the authors' get_lr_multiplier)")
    lr_wsd_decay_fraction: float = _f(0.5, "wsd: fraction of the steps in the final decay (authors' "
                                           "--warmdown-ratio 0.5)", range=OPEN_FRACTION)
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of the peak (authors: 0)", range=PROBABILITY)
    warmup: int = _f(100, "learning-rate warmup steps (authors: 0)", range=NON_NEGATIVE)
    weight_decay: float = _f(0.05, "AdamW weight decay on matrices (muon/aurora: on the routers when they "
                                   "stay on AdamW)", range=NON_NEGATIVE)
    wd_decay_style: Literal["constant", "linear"] = _f(
        "constant", "weight decay over the run: constant, or linear: × (1 - step / steps), towards 0 at the "
                    "end (the authors' get_weight_decay)")
    wd_depth_scaling: bool = _f(False, "multiply the weight decay by (12 / num_layers)^2 (the authors' "
                                       "weight_decay_scaled, tuned at depth 12)")
    lr_resid_scalar: float = _f(0.005, "peak AdamW learning rate of model.residual_scalars' λ_resid (authors: "
                                       "0.01 × their scalar_lr 0.5; no width scaling)", range=NON_NEGATIVE)
    lr_x0_scalar: float = _f(0.5, "peak AdamW learning rate of model.residual_scalars' λ_x0 (authors: 0.5; no "
                                  "width scaling)", range=NON_NEGATIVE)
    x0_betas: list = _f([0.96, 0.95], "AdamW betas of λ_x0 (the authors' x0 group)", allowed='two numbers in [0, 1)')
    betas: list = _f([0.9, 0.95], "AdamW betas (every AdamW group, also under muon/aurora; authors: [0.8, 0.95])",
                     allowed='two numbers in [0, 1)')
    adam_eps: float = _f(1e-8, "AdamW epsilon of every AdamW group (authors: 1e-10)", range=NON_NEGATIVE)
    nonfinite_steps: int = _f(1, "consecutive steps with a non-finite loss or gradient norm (or skipped by DeepSpeed "
                                 "for one) that end the run, in one line and without a checkpoint of them "
                                 "(Megatron-LM's --check-for-nan-in-loss-and-grad: the first; 0: never; read on "
                                 "logging and checkpoint steps: megatron_kappa/train/divergence.py)", range=NON_NEGATIVE)
    grad_clip: Optional[float] = _f(None, "global gradient-norm clip (0: off; null: 1.0 for adamw, off for "
                                          "muon/aurora, which refuse a nonzero clip)", range=NON_NEGATIVE)
    qk_clip: Optional[float] = _f(
        None, "QK-Clip τ (Kimi K2's MuonClip, arXiv 2507.20534 §2.1; megatron-core's qk_clip_threshold; K2: 100): "
              "after each optimizer step, the query/key weights of a head whose largest pre-softmax logit in the "
              "step's training forwards S exceeds τ are scaled so that its logits shrink by γ = τ/S (GQA: the "
              "group's largest, its key being shared; MLA: q_C × γ^α, k_C × γ^(1-α), q_R × γ, the shared k_R "
              "untouched), in the weights and in ZeRO's fp32 master copy; any optimizer; model.attention sdpa, "
              "and for gqa model.qk_layernorm false (megatron_kappa/optim/qk_clip.py). null: off",
        range=POSITIVE)
    qk_clip_alpha: float = _f(0.5, "QK-Clip's split α of γ between query (γ^α) and key (γ^(1-α)) weights "
                                   "(megatron-core's qk_clip_alpha; K2: 0.5, √γ each)", range=OPEN_UNIT)
    grad_accum_dtype: Literal["fp32", "bf16"] = _f(
        "fp32", "precision bf16/fp8: dtype in which the micro-batches' gradients are summed and reduced over "
                "data-parallel ranks (fp32 precision: fp32 always). fp32, Megatron-LM's default: every optimizer "
                "update sees an fp32 gradient (Muon/Aurora momentum in fp32 too), at the cost of an fp32 "
                "gradient copy (4 instead of 2 bytes per parameter) and fp32 reductions (twice the gradient "
                "traffic). bf16 saves that memory and traffic but rounds every addition to 8 bits of mantissa "
                "(DeepSpeed: not safe with many accumulation steps) and Muon/Aurora keep a bf16 momentum "
                "(megatron_kappa/parallel/grad_precision.py, docs/optimizer.md)")
    init_weights: Optional[str] = _f(None, "full-layout state dict (.pt, launch/consolidate.py's) or Hugging Face "
                                          "model folder (the export's classes: python -m megatron_kappa.import_hf "
                                          "prints the model settings it needs) to start from instead of a random "
                                          "init; ignored when resuming from a checkpoint", derived=True)
    deterministic: bool = _f(False, "deterministic kernels (torch.use_deterministic_algorithms): "
                                    "bit-exact resume and reruns on GPUs, at some speed; CPU runs "
                                    "are deterministic anyway")
    muon: MuonConfig = _section(MuonConfig)

    @property
    def clip(self) -> float:
        """The gradient clip in effect: grad_clip, or by optimizer when it is null."""
        if self.grad_clip is not None:
            return self.grad_clip
        return 1.0 if self.optimizer == "adamw" else 0.0


@dataclass
class ZeroConfig:
    stage: int = _f(1, "DeepSpeed ZeRO stage for optimizer state: 1 or 2 (3 is refused with expert parallelism)",
                    range=POSITIVE, derived=True)
    offload_optimizer: bool = _f(False, "DeepSpeed's ZeRO-Offload: the fp32 master copy and the optimizer's "
                                 "state in CPU memory, the step on the CPU (the configured torch optimizer)")


@dataclass
class DataConfig:
    paths: list = _f([], "Megatron .bin/.idx prefixes, optionally weighted: [0.7, a, 0.3, b]",
                     allowed='shard prefixes, optionally weighted')
    valid_paths: list = _f([], "held-out prefixes for validation (empty: split from `paths`)",
                           allowed='shard prefixes, optionally weighted')
    split: str = _f("99,1,0", "train,valid,test split of `paths` when no `valid_paths`",
                    allowed='three numbers: train,valid,test')
    tokenizer: Optional[str] = _f(None, "SentencePiece .model used to make the shards")
    mock: bool = _f(False, "megatron-core's mock dataset instead of files (smoke tests, benchmarks; "
                           "synthetic sequences, whatever data.packing says)")
    packing: Literal["concat", "bestfit"] = _f(
        "concat", "how documents fill the rows of seq_length + 1 tokens. concat: megatron-core's GPTDataset "
                  "(documents back to back, each ending in EOD, a row may start mid-document, rows "
                  "shuffled). bestfit: 14c9b04's BOS-aligned best fit (megatron_kappa/data/bestfit.py): "
                  "every row starts at a document's BOS, the largest buffered document that fits goes "
                  "next, a gap no document fits takes the shortest one cropped (≈35 % of tokens cropped "
                  "at 2048, reported at start); the trailing EOD is dropped; needs documents that start "
                  "with BOS and data.tokenizer")
    packing_buffer: int = _f(1000, "documents bestfit chooses among (14c9b04's buffer_size; refilled 128 at "
                                   "a time below it)", range=POSITIVE)
    seed: Optional[int] = _f(None, "seed of the document order (megatron-core's shuffle, bestfit's permutation, "
                                   "mock data; null: train.seed, so another train.seed also reorders the data). "
                                   "14c9b04's order does not depend on its --seed (a corpus shuffled once on disk, "
                                   "read in order): the paper configs fix it", range=NON_NEGATIVE)
    cache_dir: Optional[str] = _f(None, "index cache folder (default: <run.dir>/data_cache)")
    bos: Optional[bool] = _f(None, "the training documents start with BOS (null: read \"bos\" from the "
                                   "data prep manifest.json beside data.paths at training start, false "
                                   "without one or with mock data; the run's config.yaml records the "
                                   "answer, and CORE puts BOS first exactly when it is true)", derived=True)


@dataclass
class WandbConfig:
    mode: Literal["disabled", "offline", "online"] = _f(
        "disabled", "Weights & Biases beside metrics.jsonl (global rank 0): the resolved config and the same "
                    "records, into <run.dir>/wandb, one W&B run per run.dir (a resume continues it); offline: "
                    "`wandb sync` later; needs the `wandb` extra (pip install -e '.[wandb]'); disabled: wandb is "
                    "never imported")
    project: str = _f("megatron_kappa", "W&B project")
    entity: Optional[str] = _f(None, "W&B entity (team or user; null: the account's default)")


@dataclass
class LogConfig:
    interval: int = _f(10, "steps between metric lines", range=POSITIVE)
    tensorboard: bool = _f(True, "also write TensorBoard events to <run.dir>/tb: the scalars of metrics.jsonl, "
                                 "the resolved config as text, κ and tokens-per-expert histograms per MoE layer")
    peak_tflops: Optional[float] = _f(None, "the device's dense bf16 peak (TFLOP/s per GPU) for MFU "
                                            "(null: looked up by GPU name for H100/H200/A100 and "
                                            "others; no MFU on the CPU)", range=POSITIVE)
    wandb: WandbConfig = _section(WandbConfig)


@dataclass
class ProfileConfig:
    steps: list = _f([], "[first, last]: trace these steps (as the step line numbers them, both included) with "
                         "torch.profiler into <run.dir>/profile/ (Chrome / TensorBoard trace; on CUDA also "
                         "cudaProfilerStart/Stop for nsys --capture-range=cudaProfilerApi); []: no profiling",
                     allowed="[] or two step numbers, 1 <= first <= last")
    ranks: list = _f([0], "the global ranks that profile", allowed="global ranks below the world size")
    memory_snapshot: bool = _f(False, "on CUDA, also a memory snapshot of the profiled steps (torch.cuda.memory."
                                      "_dump_snapshot; open at pytorch.org/memory_viz)")


@dataclass
class CheckpointConfig:
    interval: int = _f(1000, "steps between checkpoints (one is always written at the end)", range=POSITIVE)
    keep: int = _f(2, "checkpoints kept", range=POSITIVE)


@dataclass
class EvalConfig:
    valid_every: int = _f(500, "steps between validation losses, and one at the last step (0: no validation)",
                          range=NON_NEGATIVE)
    valid_iters: int = _f(10, "micro-batches per validation", range=POSITIVE)
    core_every: int = _f(0, "steps between quick CORE subsets (0: never during training)", range=NON_NEGATIVE)
    core_max_per_task: int = _f(100, "examples per task in the quick CORE subset", range=POSITIVE)
    core_bundle: Optional[str] = _f(None, "CORE bundle folder or .zip for the quick subset")
    capacity_factor: Optional[float] = _f(None, "expert capacity factor while evaluating (validation, "
                                                "CORE, eval/*.py); null: model.moe.capacity_factor "
                                                "(authors: 3.0)", range=POSITIVE)


@dataclass
class RunConfig:
    dir: str = _f("runs/default", "run directory: checkpoints, metrics.jsonl, tb/",
                  allowed='a folder that is or can be made writable', derived=True)


@dataclass
class Config:
    run: RunConfig = _section(RunConfig)
    model: ModelConfig = _section(ModelConfig)
    parallel: ParallelConfig = _section(ParallelConfig, derived=True)
    precision: Literal["fp32", "bf16", "fp8"] = _f("fp32", "parameter/compute precision: fp8 keeps bf16 parameters and runs the GEMMs chosen in "
                    "model.fp8 in FP8 (torchao; emulated off CUDA; docs/fp8.md)", state=True)
    train: TrainConfig = _section(TrainConfig)
    zero: ZeroConfig = _section(ZeroConfig)
    data: DataConfig = _section(DataConfig)
    log: LogConfig = _section(LogConfig)
    profile: ProfileConfig = _section(ProfileConfig)
    checkpoint: CheckpointConfig = _section(CheckpointConfig)
    eval: EvalConfig = _section(EvalConfig)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def flat_keys(tree: dict, prefix: str = "") -> dict:
    """A nested config mapping (to_dict's) as {dotted key: value}."""
    out = {}
    for key, value in tree.items():
        out.update(flat_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out
