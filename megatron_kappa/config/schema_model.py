"""The config schema's model sub-sections: model.kappa, model.fp8, model.moe, model.mla, model.mtp.

megatron_kappa.config.schema gathers them into ModelConfig and re-exports them: import them from
there."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megatron_kappa import routers
from megatron_kappa.config.facts import BEYOND_ONE, FRACTION, NON_NEGATIVE, POSITIVE, PROBABILITY
from megatron_kappa.config.facts import key as _f
from megatron_kappa.config.facts import section as _section
from megatron_kappa.kappa import DEFAULTS as KAPPA
from megatron_kappa.kappa import inputs as kappa_inputs


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
    """model.mla: the widths of multi-head latent attention (DeepSeek-V2/V3), megatron-core's
    MLASelfAttention, which model.attention_kind mla picks: queries and keys/values projected through
    low-rank latents, a RoPE part of the key shared by all heads (model.num_query_groups and
    model.head_dim are not used; model.qk_layernorm norms the two latents, as DeepSeek-V3)."""
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
