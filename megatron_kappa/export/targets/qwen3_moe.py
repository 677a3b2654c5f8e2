"""transformers' Qwen3MoeForCausalLM as an export target: plain SwiGLU experts, a softmax router,
q/k norms with gains, no nanochat parts; dense layers are its `mlp_only_layers`."""
from __future__ import annotations

from megatron_kappa.config import ModelConfig
from megatron_kappa.export.adapter import (
    StateDictAdapter,
    attention_refusal,
    ffn_sizes,
    layout_settings,
    native_refusals,
    rope,
    router_refusal,
)
from megatron_kappa.model.layout import ModelLayout


class Qwen3Moe(StateDictAdapter):
    name, architecture, model_type = "qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe"
    scores, router_note = ("softmax",), "its router is a softmax top-k"
    attention_note = "it has no latent attention; --target deepseek_v3"

    def refusals(self, model: ModelConfig, layout: ModelLayout) -> list[str]:
        moe = model.moe
        why = []
        def need(ok, msg):
            return None if ok else why.append(msg)
        native_refusals(model, need)
        attention_refusal(self, model, need)
        router_refusal(self, model, need)
        need(moe.route_scale == 1.0, f"model.moe.route_scale is {moe.route_scale} (expected 1)")
        need(moe.num_groups is None, "model.moe.num_groups is set (it has no group-limited routing)")
        need(not moe.shared_ffn_hidden_size, "model.moe.shared_ffn_hidden_size is set (it has no shared expert)")
        self.own_refusals(model, layout, need)
        return why

    def own_refusals(self, model: ModelConfig, layout: ModelLayout, need):
        need(model.qk_layernorm, "model.qk_layernorm is false (Qwen3-MoE norms q and k)")
        need(layout.has_moe, "model.layout is dense (no MoE layer)")

    def own_config(self, model: ModelConfig, layout: ModelLayout, kappa) -> dict:
        dense, expert = ffn_sizes(model)
        dense_layers = [i for i, is_moe in enumerate(layout.moe_layers) if not is_moe]
        return dict(intermediate_size=dense, moe_intermediate_size=expert, num_experts=model.moe.num_experts,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=dense_layers,
                    rope_parameters=rope(model), use_sliding_window=False, attention_bias=False)

    def own_settings(self, hf) -> dict:
        return {"model.ffn_hidden_size": hf.intermediate_size, "model.moe.ffn_hidden_size": hf.moe_intermediate_size,
                "model.moe.num_experts": hf.num_experts, "model.moe.router": "softmax", "model.qk_layernorm": True,
                **layout_settings(list(hf.mlp_only_layers or []), hf.num_hidden_layers)}
