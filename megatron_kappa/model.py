"""Config → megatron-core TransformerConfig + layer specs → GPTModel.

Only the model: process groups come from megatron_kappa.parallel, training from megatron_kappa.train.
The κ experts enter through megatron-core's spec slots (MoESubmodules.router/experts) and a
MoELayer subclass; with `model.kappa.enabled: false` the MoE layers are stock megatron-core.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_kappa.config import Config, ConfigError
from megatron_kappa.moe import KappaMoELayer, KappaRouter, KappaSequentialMLP, KappaSettings


class SPTorchNorm:
    """torch RMSNorm whose weight is tagged for the TP gradient all-reduce.

    megatron's WrappedTorchNorm refuses sequence parallelism (which MoE + TP requires); the norm
    itself is the same, only its gradient needs summing over the TP group, which is what the
    `sequence_parallel` tag asks for (megatron_kappa.grads).
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        # q/k norms see only this rank's heads, sequence-parallel norms only its tokens: both
        # need the sum over TP.
        for p in norm.parameters():
            p.sequence_parallel = config.tensor_model_parallel_size > 1
        return norm


def moe_layer_pattern(cfg: Config) -> list[int]:
    """1 for an MoE layer, 0 for a dense one, per layer."""
    m = cfg.model
    if m.layout == "dense":
        return [0] * m.num_layers
    if m.layout == "moe":
        return [0] * m.first_dense + [1] * (m.num_layers - m.first_dense)
    middle = m.num_layers // 2
    return [1 if i in (middle - 1, middle) else 0 for i in range(m.num_layers)]


def padded_vocab_size(cfg: Config) -> int:
    multiple = 128 * cfg.parallel.tp
    return int(math.ceil(cfg.model.vocab_size / multiple) * multiple)


def transformer_config(cfg: Config) -> TransformerConfig:
    m, moe, par = cfg.model, cfg.model.moe, cfg.parallel
    if cfg.precision == "fp8" and not torch.cuda.is_available():
        raise ConfigError("config: precision: fp8 needs Transformer Engine on a GPU (use fp32 or bf16)")
    has_moe = any(moe_layer_pattern(cfg))
    dtype = torch.bfloat16 if cfg.precision in ("bf16", "fp8") else torch.float32
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    kwargs = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, kv_channels=m.head_dim, ffn_hidden_size=ffn,
        normalization="RMSNorm", qk_layernorm=m.qk_layernorm, add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, init_method_std=m.init_std,
        hidden_dropout=0.0, attention_dropout=0.0,
        # Fused paths are GPU-only or would bypass the κ activation.
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=par.tp, sequence_parallel=par.tp > 1,
        expert_model_parallel_size=par.ep, expert_tensor_parallel_size=par.etp or par.tp,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
        fp8="hybrid" if cfg.precision == "fp8" else None,
    )
    if has_moe:
        kwargs.update(
            num_moe_experts=moe.num_experts, moe_router_topk=moe.topk,
            moe_ffn_hidden_size=moe.ffn_hidden_size or ffn,
            moe_layer_freq=moe_layer_pattern(cfg), moe_token_dispatcher_type=moe.dispatcher,
            moe_router_score_function=moe.router, moe_router_dtype="fp32",
            moe_z_loss_coeff=moe.z_loss or None,
            moe_router_topk_scaling_factor=moe.route_scale if moe.route_scale != 1.0 else None,
            moe_expert_capacity_factor=moe.capacity_factor,
            moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
        )
        if moe.router == "softmax":
            kwargs.update(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=moe.aux_loss)
        else:  # Trinity: aux-loss-free balancing through a non-trained expert bias
            kwargs.update(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                          moe_router_enable_expert_bias=True,
                          moe_router_bias_update_rate=moe.bias_update_rate)
    return TransformerConfig(**kwargs)


def _with_sp_norms(spec):
    """The layer spec with every norm (input, pre-MLP, q/k) built by SPTorchNorm."""
    sub = spec.submodules
    attn = sub.self_attention
    qk = {name: SPTorchNorm for name in ("q_layernorm", "k_layernorm")
          if getattr(attn.submodules, name) is not IdentityOp}
    attention = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, **qk))
    sub = dataclasses.replace(sub, input_layernorm=SPTorchNorm, pre_mlp_layernorm=SPTorchNorm,
                              self_attention=attention)
    return dataclasses.replace(spec, submodules=sub)


def layer_specs(cfg: Config, tconfig: TransformerConfig) -> TransformerBlockSubmodules:
    """Local (plain torch) specs per layer; κ routers/experts in the MoE layers when enabled."""
    spec = partial(get_gpt_layer_local_spec, qk_layernorm=cfg.model.qk_layernorm,
                   normalization="RMSNorm")
    dense = _with_sp_norms(spec(num_experts=None))
    moe = None
    if any(moe_layer_pattern(cfg)):
        moe = _with_sp_norms(spec(num_experts=cfg.model.moe.num_experts))
        if cfg.model.kappa.enabled:
            stock = moe.submodules.mlp.keywords["submodules"]  # MoESubmodules of the stock layer
            k = cfg.model.kappa
            settings = KappaSettings(U=k.U, use_alpha=k.use_alpha, use_bias=k.use_bias,
                                     logit_scale=k.logit_scale, tanh_gain=k.tanh_gain)
            experts = partial(KappaSequentialMLP, submodules=stock.experts.keywords["submodules"],
                              kappa=settings)
            mlp = partial(KappaMoELayer, submodules=MoESubmodules(experts=experts, router=KappaRouter))
            moe = dataclasses.replace(moe, submodules=dataclasses.replace(moe.submodules, mlp=mlp))
    layers = [moe if is_moe else dense for is_moe in moe_layer_pattern(cfg)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=SPTorchNorm)


def build_model(cfg: Config, meta: bool = False) -> GPTModel:
    """The GPT model of `cfg` on this rank (megatron parallel state must be initialised).

    meta=True builds shapes only (no memory, no initialisation), for counting parameters.
    """
    tconfig = transformer_config(cfg)
    if meta:
        tconfig.perform_initialization = False
    with torch.device("meta") if meta else contextlib.nullcontext():
        return GPTModel(
            config=tconfig, transformer_layer_spec=layer_specs(cfg, tconfig),
            vocab_size=padded_vocab_size(cfg), max_sequence_length=cfg.model.seq_length,
            share_embeddings_and_output_weights=False, position_embedding_type="rope",
            rotary_base=cfg.model.rotary_base,
        )
