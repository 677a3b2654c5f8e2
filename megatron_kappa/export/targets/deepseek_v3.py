"""transformers' DeepseekV3ForCausalLM as an export target: MLA with its latent norms, the sigmoid
router with its balance bias (group-limited or not), shared experts a multiple of an expert's
width, dense first layers, no κ."""
from __future__ import annotations

from megatron_kappa import attention_kinds
from megatron_kappa.config import ModelConfig
from megatron_kappa.export.adapter import (
    StateDictAdapter,
    attention_refusal,
    ffn_sizes,
    native_refusals,
    rope,
    router_refusal,
)
from megatron_kappa.model.layout import ModelLayout


class DeepseekV3(StateDictAdapter):
    name, architecture, model_type = "deepseek_v3", "DeepseekV3ForCausalLM", "deepseek_v3"
    scores, router_note = ("sigmoid",), "its router is sigmoid with a balance bias"
    attention, attention_note = ("mla",), "DeepSeek-V3 has multi-head latent attention"

    def refusals(self, model: ModelConfig, layout: ModelLayout) -> list[str]:
        moe = model.moe
        why = []
        def need(ok, msg):
            return None if ok else why.append(msg)
        native_refusals(model, need)
        attention_refusal(self, model, need)
        need(model.qk_layernorm, "model.qk_layernorm is false (DeepSeek-V3 norms its latents)")
        # transformers builds the latent norms with RMSNorm's default epsilon, not rms_norm_eps
        need(model.norm_eps == 1e-6, f"model.norm_eps is {model.norm_eps} (its latent norms use 1e-6, as published)")
        router_refusal(self, model, need)
        need(model.layout == "moe", f"model.layout is {model.layout} (its dense layers come first)")
        expert = ffn_sizes(model)[1]
        shared = moe.shared_ffn_hidden_size or 0
        need(shared > 0 and shared % expert == 0, f"model.moe.shared_ffn_hidden_size is {shared or 'null'} (its "
             f"shared experts are n × the expert width {expert})")
        return why

    def own_config(self, model: ModelConfig, layout: ModelLayout, kappa) -> dict:
        moe, mla = model.moe, attention_kinds.of(model).hf_config(model)  # its latents' widths
        dense, expert = ffn_sizes(model)
        return dict(intermediate_size=dense, moe_intermediate_size=expert, n_routed_experts=moe.num_experts,
                    n_shared_experts=moe.shared_ffn_hidden_size // expert, routed_scaling_factor=moe.route_scale,
                    n_group=moe.num_groups or 1, topk_group=moe.group_topk or 1, norm_topk_prob=moe.topk > 1,
                    first_k_dense_replace=model.first_dense, **mla,
                    head_dim=mla["qk_rope_head_dim"], rope_interleave=True, rope_parameters=rope(model),
                    num_key_value_heads=model.num_attention_heads, attention_bias=False, num_nextn_predict_layers=0)

    def own_settings(self, hf) -> dict:
        expert, grouped = hf.moe_intermediate_size, (hf.n_group or 1) > 1
        return {"model.ffn_hidden_size": hf.intermediate_size, "model.moe.ffn_hidden_size": expert,
                "model.moe.num_experts": hf.n_routed_experts,
                "model.moe.shared_ffn_hidden_size": (hf.n_shared_experts or 0) * expert or None,
                "model.moe.route_scale": hf.routed_scaling_factor, "model.moe.router": "sigmoid",
                "model.moe.num_groups": hf.n_group if grouped else None,
                "model.moe.group_topk": hf.topk_group if grouped else None,
                "model.layout": "moe", "model.first_dense": hf.first_k_dense_replace, "model.qk_layernorm": True,
                # MLA: one latent for all heads (no query groups); head_dim is its RoPE part's
                **attention_kinds.lookup("mla").from_hf_config(
                    {k: getattr(hf, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                 "qk_rope_head_dim", "v_head_dim")}),
                "model.head_dim": None, "model.num_query_groups": None}
