"""This project's own class as an export target: modeling_kappa_moe.py beside the weights
(trust_remote_code), for every model this project trains but SoftMoE (κ or plain experts, softmax
or sigmoid routers, shared experts, any layout, the nanochat block, MLA)."""
from __future__ import annotations

from megatron_kappa import attention_kinds, routers
from megatron_kappa.config import ConfigError, ModelConfig
from megatron_kappa.export.adapter import StateDictAdapter, attention_refusal, ffn_sizes, router_refusal
from megatron_kappa.kappa import inputs as kappa_inputs
from megatron_kappa.model.layout import ModelLayout, has_value_embedding

CODE = "modeling_kappa_moe.py"


class KappaMoe(StateDictAdapter):
    name, architecture, model_type = "kappa_moe", "KappaMoeForCausalLM", "kappa_moe"
    native, code_files = False, (CODE,)
    scores = ("softmax", "sigmoid")  # modeling_kappa_moe.py's router_score
    router_note = "modeling_kappa_moe.py scores by softmax or sigmoid"
    attention = ("gqa", "mla")  # modeling_kappa_moe.py's Attention and LatentAttention
    attention_note = "modeling_kappa_moe.py runs grouped-query or latent attention"

    def refusals(self, model: ModelConfig, layout: ModelLayout) -> list[str]:
        why = []
        attention_refusal(self, model, lambda ok, msg: None if ok else why.append(msg))
        if layout.has_moe:
            router_refusal(self, model, lambda ok, msg: None if ok else why.append(msg))
        return why

    def own_config(self, model: ModelConfig, layout: ModelLayout, kappa) -> dict:
        moe = model.moe
        dense, expert = ffn_sizes(model)
        k = None
        if model.kappa.enabled:
            k = dict(U=kappa.U, logit_scale=kappa.logit_scale, tanh_gain=kappa.tanh_gain, use_alpha=kappa.use_alpha,
                     use_bias=kappa.use_bias, input=kappa_input_kind(kappa.input))
        return dict(auto_map={"AutoConfig": f"{CODE[:-3]}.KappaMoeConfig",
                              "AutoModelForCausalLM": f"{CODE[:-3]}.KappaMoeForCausalLM"},
                    intermediate_size=dense, moe_intermediate_size=expert,
                    shared_expert_intermediate_size=moe.shared_ffn_hidden_size, num_experts=moe.num_experts,
                    mlp_layer_types=["moe" if x else "dense" for x in layout.moe_layers],
                    router_score=routers.lookup(moe.router).hf_score,  # None for a dense model's unexported router
                    route_scale=moe.route_scale, n_group=moe.num_groups, topk_group=moe.group_topk, kappa=k,
                    qk_norm=model.qk_layernorm, norm_gains=model.norm_gains,
                    embedding_norm=model.embedding_norm, residual_scalars=model.residual_scalars,
                    value_embedding_layers=[i for i in range(model.num_layers)
                                            if model.value_embeddings and has_value_embedding(i + 1, model.num_layers)],
                    logit_softcap=model.logit_softcap, rope_theta=float(model.rotary_base),
                    **attention_kinds.of(model).modeling(model))  # its keys there (mla: its widths, or None)


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
