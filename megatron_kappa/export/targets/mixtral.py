"""transformers' MixtralForCausalLM as an export target: Qwen3-MoE's model without q/k norms, every
layer MoE, under the hub's Mixtral names (`block_sparse_moe.experts.<j>.w1`)."""
from __future__ import annotations

from megatron_kappa.config import ModelConfig
from megatron_kappa.export.adapter import ffn_sizes, rope
from megatron_kappa.export.targets.qwen3_moe import Qwen3Moe
from megatron_kappa.model.layout import ModelLayout


class Mixtral(Qwen3Moe):
    name, architecture, model_type = "mixtral", "MixtralForCausalLM", "mixtral"
    renames = (("mlp.gate.", "block_sparse_moe.gate."), ("mlp.experts.", "block_sparse_moe.experts."),
               ("gate_proj.", "w1."), ("down_proj.", "w2."), ("up_proj.", "w3."))

    def own_refusals(self, model: ModelConfig, layout: ModelLayout, need):
        need(not model.qk_layernorm, "model.qk_layernorm is true (Mixtral has no q/k norms)")
        need(all(layout.moe_layers), "not every layer is MoE (Mixtral has no dense layers)")

    def own_config(self, model: ModelConfig, layout: ModelLayout, kappa) -> dict:
        return dict(intermediate_size=ffn_sizes(model)[1], num_local_experts=model.moe.num_experts,
                    rope_parameters=rope(model), router_jitter_noise=0.0, sliding_window=None)

    def own_settings(self, hf) -> dict:
        return {"model.moe.ffn_hidden_size": hf.intermediate_size, "model.moe.num_experts": hf.num_local_experts,
                "model.moe.router": "softmax", "model.qk_layernorm": False, "model.layout": "moe",
                "model.first_dense": 0}
