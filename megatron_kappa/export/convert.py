"""A run's config and weights as a Hugging Face model's: which class takes it, its config.json, and
every tensor under that class's name.

Three targets (`target_for` picks one, or checks the one asked for):
  kappa_moe   modeling_kappa_moe.py beside the weights (trust_remote_code): every model this
              project trains but SoftMoE (κ or plain experts, softmax or sigmoid routers, shared
              experts, any layout, the nanochat block)
  qwen3_moe   transformers' Qwen3MoeForCausalLM: plain SwiGLU experts, a softmax router, q/k norms
              with gains, no nanochat parts; dense layers are its `mlp_only_layers`
  mixtral     transformers' MixtralForCausalLM: the same without q/k norms, every layer MoE
  deepseek_v3 transformers' DeepseekV3ForCausalLM: MLA with its latent norms, the sigmoid router
              with its balance bias (group-limited or not), shared experts a multiple of an
              expert's width, dense first layers, no κ
The native classes are written in the hub's per-expert layout, which transformers and the
serving tools that take those classes read as they are.

Megatron's tensors, in the full (one-process) layout: linear_qkv holds, per query group, that
group's query heads, then its key head, then its value head; linear_fc1 holds [gate; up]. The
vocabulary padding (128 × TP) is cut off: the exported vocabulary is the tokenizer's.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from megatron_kappa.config import Config, ConfigError
from megatron_kappa.kappa import inputs as kappa_inputs
from megatron_kappa.model.layout import ModelLayout, has_value_embedding

TARGETS = ("auto", "kappa_moe", "qwen3_moe", "mixtral", "deepseek_v3")
CUSTOM_FILE = "modeling_kappa_moe.py"


def native_refusals(cfg: Config, layout: ModelLayout, target: str) -> list[str]:
    """Why transformers' `target` class cannot hold this model (empty: it can)."""
    m, moe = cfg.model, cfg.model.moe
    why = []
    need = lambda ok, msg: None if ok else why.append(msg)  # noqa: E731
    need(not m.kappa.enabled, "model.kappa.enabled is true (κ-SwiGLU experts need the kappa_moe code)")
    need(m.norm_gains, "model.norm_gains is false (its norms have gains)")
    for key in ("value_embeddings", "embedding_norm", "residual_scalars"):
        need(not getattr(m, key), f"model.{key} is true (a nanochat-block part it lacks)")
    need(not m.logit_softcap, "model.logit_softcap is set (it has no softcap)")
    if target == "deepseek_v3":
        need(m.mla.enabled, "model.mla.enabled is false (DeepSeek-V3 has multi-head latent attention)")
        need(m.qk_layernorm, "model.qk_layernorm is false (DeepSeek-V3 norms its latents)")
        # transformers builds the latent norms with RMSNorm's default epsilon, not rms_norm_eps
        need(m.norm_eps == 1e-6, f"model.norm_eps is {m.norm_eps} (its latent norms use 1e-6, as published)")
        need(moe.router == "sigmoid", f"model.moe.router is {moe.router} (its router is sigmoid with a balance bias)")
        need(m.layout == "moe", f"model.layout is {m.layout} (its dense layers come first)")
        expert = ffn_sizes(cfg)[1]
        shared = moe.shared_ffn_hidden_size or 0
        need(shared > 0 and shared % expert == 0, f"model.moe.shared_ffn_hidden_size is {shared or 'null'} (its "
             f"shared experts are n × the expert width {expert})")
        return why
    need(not m.mla.enabled, "model.mla.enabled is true (it has no latent attention; --target deepseek_v3)")
    need(moe.router == "softmax", f"model.moe.router is {moe.router} (its router is a softmax top-k)")
    need(moe.route_scale == 1.0, f"model.moe.route_scale is {moe.route_scale} (expected 1)")
    need(moe.num_groups is None, "model.moe.num_groups is set (it has no group-limited routing)")
    need(not moe.shared_ffn_hidden_size, "model.moe.shared_ffn_hidden_size is set (it has no shared expert)")
    if target == "qwen3_moe":
        need(m.qk_layernorm, "model.qk_layernorm is false (Qwen3-MoE norms q and k)")
        need(layout.has_moe, "model.layout is dense (no MoE layer)")
    if target == "mixtral":
        need(not m.qk_layernorm, "model.qk_layernorm is true (Mixtral has no q/k norms)")
        need(all(layout.moe_layers), "not every layer is MoE (Mixtral has no dense layers)")
    return why


def target_for(cfg: Config, layout: ModelLayout, requested: str = "auto") -> str:
    """The export target: `requested`, checked, or for auto the native class that holds the model
    (Qwen3-MoE, Mixtral, DeepSeek-V3), else kappa_moe."""
    if requested not in TARGETS:
        raise ConfigError(f"--target: expected one of {list(TARGETS)}, got {requested!r}")
    if cfg.model.moe.router == "softmoe" and layout.has_moe:
        raise ConfigError("model.moe.router: softmoe: the export does not implement the SoftMoE router "
                          "(its variable experts per token and learned budgets); export a top-k router's run")
    if requested == "kappa_moe":
        return requested
    if requested != "auto":
        why = native_refusals(cfg, layout, requested)
        if why:
            raise ConfigError(f"--target {requested}: " + "; ".join(why))
        return requested
    for native in ("qwen3_moe", "mixtral", "deepseek_v3"):
        if not native_refusals(cfg, layout, native):
            return native
    return "kappa_moe"


def ffn_sizes(cfg: Config) -> tuple[int, int]:
    """(dense MLP, expert) hidden sizes."""
    m = cfg.model
    dense = m.ffn_hidden_size or 4 * m.hidden_size
    return dense, m.moe.ffn_hidden_size or dense


def head_sizes(cfg: Config) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim)."""
    m = cfg.model
    return m.num_attention_heads, m.num_query_groups or m.num_attention_heads, \
        m.head_dim or m.hidden_size // m.num_attention_heads


def hf_config(cfg: Config, layout: ModelLayout, target: str, special: dict, kappa=None) -> dict:
    """config.json of the export. `special`: bos/eos/pad token ids; `kappa`: the KappaSettings in
    effect (model.build.kappa_settings) when κ is on."""
    m, moe = cfg.model, cfg.model.moe
    heads, kv, head_dim = head_sizes(cfg)
    dense, expert = ffn_sizes(cfg)
    common = dict(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                  num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=m.norm_eps,
                  max_position_embeddings=m.seq_length, tie_word_embeddings=False,
                  num_experts_per_tok=moe.topk, bos_token_id=special["bos"], eos_token_id=special["eos"],
                  pad_token_id=special["pad"], hidden_act="silu")
    rope = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
    if target == "mixtral":
        return dict(common, architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=expert,
                    num_local_experts=moe.num_experts, rope_parameters=rope, router_jitter_noise=0.0,
                    sliding_window=None)
    if target == "deepseek_v3":
        a = m.mla
        return dict(common, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", intermediate_size=dense,
                    moe_intermediate_size=expert, n_routed_experts=moe.num_experts,
                    n_shared_experts=moe.shared_ffn_hidden_size // expert, routed_scaling_factor=moe.route_scale,
                    n_group=moe.num_groups or 1, topk_group=moe.group_topk or 1, norm_topk_prob=moe.topk > 1,
                    first_k_dense_replace=m.first_dense, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
                    qk_nope_head_dim=a.qk_head_dim, qk_rope_head_dim=a.qk_pos_emb_head_dim, v_head_dim=a.v_head_dim,
                    head_dim=a.qk_pos_emb_head_dim, rope_interleave=True, rope_parameters=rope,
                    num_key_value_heads=heads, attention_bias=False, num_nextn_predict_layers=0)
    if target == "qwen3_moe":
        dense_layers = [i for i, is_moe in enumerate(layout.moe_layers) if not is_moe]
        return dict(common, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", intermediate_size=dense,
                    moe_intermediate_size=expert, num_experts=moe.num_experts, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=dense_layers, rope_parameters=rope,
                    use_sliding_window=False, attention_bias=False)
    k = None
    if m.kappa.enabled:
        k = dict(U=kappa.U, logit_scale=kappa.logit_scale, tanh_gain=kappa.tanh_gain, use_alpha=kappa.use_alpha,
                 use_bias=kappa.use_bias, input=kappa_input_kind(kappa.input))
    return dict(common, architectures=["KappaMoeForCausalLM"], model_type="kappa_moe",
                auto_map={"AutoConfig": f"{CUSTOM_FILE[:-3]}.KappaMoeConfig",
                          "AutoModelForCausalLM": f"{CUSTOM_FILE[:-3]}.KappaMoeForCausalLM"},
                intermediate_size=dense, moe_intermediate_size=expert,
                shared_expert_intermediate_size=moe.shared_ffn_hidden_size, num_experts=moe.num_experts,
                mlp_layer_types=["moe" if x else "dense" for x in layout.moe_layers], router_score=moe.router,
                route_scale=moe.route_scale, n_group=moe.num_groups, topk_group=moe.group_topk, kappa=k,
                qk_norm=m.qk_layernorm, norm_gains=m.norm_gains,
                embedding_norm=m.embedding_norm, residual_scalars=m.residual_scalars,
                value_embedding_layers=[i for i in range(m.num_layers)
                                        if m.value_embeddings and has_value_embedding(i + 1, m.num_layers)],
                logit_softcap=m.logit_softcap, rope_theta=float(m.rotary_base),
                mla=dataclasses.asdict(m.mla) if m.mla.enabled else None)


def kappa_input_kind(name: str) -> str:
    """The modeling file's name for what κ sees: `logit` (the raw logit, which the scales then
    multiply: the logit and scaled variants) or `normalized`."""
    transform = kappa_inputs.lookup(name).transform
    if transform is kappa_inputs.identity:
        return "logit"
    if transform is kappa_inputs.normalized_logit:
        return "normalized"
    raise ConfigError(f"model.kappa.input: {name}: a variant registered at run time; the export's modeling file "
                      "implements the built-in transforms only (logit, scaled, normalized)")


# MLA: DeepSeek-V3's name ← megatron's (relative to self_attention.); the same tensors, same layouts
MLA_NAMES = {"q_proj.weight": "linear_q_proj.weight", "q_a_proj.weight": "linear_q_down_proj.weight",
             "q_a_layernorm.weight": "q_layernorm.weight", "q_b_proj.weight": "linear_q_up_proj.weight",
             "kv_a_proj_with_mqa.weight": "linear_kv_down_proj.weight",
             "kv_a_layernorm.weight": "kv_layernorm.weight", "kv_b_proj.weight": "linear_kv_up_proj.weight"}

# megatron's per-layer names, relative to decoder.layers.<i>.
QKV, PROJ = "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight"
FC1, FC2 = "linear_fc1.weight", "linear_fc2.weight"


def layer_tensors(cfg: Config, layout: ModelLayout, target: str, i: int, get: Callable[[str], torch.Tensor]) -> dict:
    """{HF name: tensor} of layer i; get(relative megatron name) reads decoder.layers.<i>.<name>
    (None where the model has no such tensor)."""
    m = cfg.model
    heads, kv, d = head_sizes(cfg)
    out = {}
    p = f"model.layers.{i}."
    if m.mla.enabled:  # megatron's MLA projections under DeepSeek-V3's names (the same layouts)
        for hf, mg in MLA_NAMES.items():
            if (t := get("self_attention." + mg)) is not None:
                out[p + "self_attn." + hf] = t
    else:
        qkv = get(QKV).view(kv, heads // kv + 2, d, -1)
        out[p + "self_attn.q_proj.weight"] = qkv[:, : heads // kv].reshape(heads * d, -1)
        out[p + "self_attn.k_proj.weight"] = qkv[:, heads // kv].reshape(kv * d, -1)
        out[p + "self_attn.v_proj.weight"] = qkv[:, heads // kv + 1].reshape(kv * d, -1)
    out[p + "self_attn.o_proj.weight"] = get(PROJ)
    optional = {"input_layernorm.weight": "input_layernorm.weight",
                "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
                "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
                "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
                "self_attn.value_gate.weight": "self_attention.value_gate",
                "resid_lambda": "resid_lambda", "x0_lambda": "x0_lambda"}
    if m.mla.enabled:  # q_layernorm is the query latent's norm there (MLA_NAMES)
        del optional["self_attn.q_norm.weight"], optional["self_attn.k_norm.weight"]
    for hf, mg in optional.items():
        if (t := get(mg)) is not None:
            out[p + hf] = t
    if (t := get("self_attention.value_embedding")) is not None:
        out[p + "self_attn.value_embedding.weight"] = t[: m.vocab_size]
    if not layout.moe_layers[i]:
        out.update(swiglu(p + "mlp.", get("mlp." + FC1), get("mlp." + FC2)))
    else:
        out[p + "mlp.gate.weight"] = get("mlp.router.weight")
        if (t := get("mlp.router.expert_bias")) is not None:
            out[p + "mlp.gate.e_score_correction_bias"] = t
        for e in range(m.moe.num_experts):
            pre = f"mlp.experts.local_experts.{e}."
            out.update(swiglu(f"{p}mlp.experts.{e}.", get(pre + FC1), get(pre + FC2)))
        for name in ("kappa_alpha", "kappa_bias"):
            if (t := get("mlp.experts." + name)) is not None:
                out[p + "mlp." + name] = t
        if m.moe.shared_ffn_hidden_size:
            out.update(swiglu(p + "mlp.shared_experts.", get("mlp.shared_experts." + FC1),
                              get("mlp.shared_experts." + FC2)))
    if target == "mixtral":  # the hub's Mixtral names
        renames = (("mlp.gate.", "block_sparse_moe.gate."), ("mlp.experts.", "block_sparse_moe.experts."),
                   ("gate_proj.", "w1."), ("down_proj.", "w2."), ("up_proj.", "w3."))
        renamed = {}
        for name, t in out.items():
            for old, new in renames:
                name = name.replace(old, new)
            renamed[name] = t
        out = renamed
    return out


def swiglu(prefix: str, fc1: torch.Tensor, fc2: torch.Tensor) -> dict:
    gate, up = fc1.chunk(2, dim=0)
    return {prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up, prefix + "down_proj.weight": fc2}


def outer_tensors(cfg: Config, get: Callable[[str], torch.Tensor]) -> dict:
    """The embedding, the final norm and the output layer."""
    v = cfg.model.vocab_size
    out = {"model.embed_tokens.weight": get("embedding.word_embeddings.weight")[:v],
           "lm_head.weight": get("output_layer.weight")[:v]}
    if (t := get("decoder.final_layernorm.weight")) is not None:
        out["model.norm.weight"] = t
    return out
