"""This project's own class as an export target: modeling_kappa_moe.py beside the weights
(trust_remote_code), for every model this project trains but SoftMoE (κ or plain experts, softmax
or sigmoid routers, shared experts, any layout, the nanochat block, MLA)."""
from __future__ import annotations

import textwrap
from pathlib import Path

from megatron_kappa import attention_kinds, routers
from megatron_kappa.config import ConfigError, ModelConfig
from megatron_kappa.export.adapter import (
    StateDictAdapter,
    attention_refusal,
    ffn_sizes,
    layout_settings,
    rotary_base,
    router_refusal,
)
from megatron_kappa.kappa import inputs as kappa_inputs
from megatron_kappa.model.layout import ModelLayout, has_value_embedding

CODE = "modeling_kappa_moe.py"


class KappaMoe(StateDictAdapter):
    name, architecture, model_type = "kappa_moe", "KappaMoeForCausalLM", "kappa_moe"
    native, code_files = False, (CODE,)

    def code(self, name: str) -> str:
        return modeling_source() if name == CODE else super().code(name)
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


    def own_settings(self, hf) -> dict:
        types = list(hf.mlp_layer_types)
        score = [name for name, r in routers.ROUTERS.items() if r.hf_score == hf.router_score and r.hf_score]
        attention = attention_kinds.lookup("mla").from_hf_config(hf.mla) if hf.mla else {}
        return {"model.ffn_hidden_size": hf.intermediate_size, "model.moe.ffn_hidden_size": hf.moe_intermediate_size,
                "model.moe.shared_ffn_hidden_size": hf.shared_expert_intermediate_size,
                "model.moe.num_experts": hf.num_experts, **({"model.moe.router": score[0]} if score else {}),
                "model.moe.route_scale": hf.route_scale, "model.moe.num_groups": hf.n_group,
                "model.moe.group_topk": hf.topk_group, "model.qk_layernorm": hf.qk_norm,
                "model.norm_gains": hf.norm_gains,
                "model.embedding_norm": hf.embedding_norm, "model.residual_scalars": hf.residual_scalars,
                "model.value_embeddings": bool(hf.value_embedding_layers), "model.logit_softcap": hf.logit_softcap,
                "model.rotary_base": rotary_base(hf.rope_theta),
                **layout_settings([i for i, t in enumerate(types) if t == "dense"], hf.num_hidden_layers),
                **attention, **kappa_settings(hf.kappa)}


def kappa_settings(kappa: dict | None) -> dict:
    """model.kappa's keys for the modeling file's `kappa` entry: the registered input variant whose
    own scales these are (scaled: 0.15 and 2), else the variant whose scales are the config's."""
    if not kappa:
        return {"model.kappa.enabled": False}
    out = {"model.kappa.enabled": True, "model.kappa.U": float(kappa["U"]), "model.kappa.use_alpha": kappa["use_alpha"],
           "model.kappa.use_bias": kappa["use_bias"]}
    scales = (float(kappa["logit_scale"]), float(kappa["tanh_gain"]))
    kinds = {name: v for name, v in kappa_inputs.VARIANTS.items() if v.hf_input == kappa["input"]}
    own = [name for name, v in kinds.items() if not v.config_scales and (v.logit_scale, v.tanh_gain) == scales]
    free = [name for name, v in kinds.items() if v.config_scales]
    if own:  # the variant's own scales: the config's keys stay at their defaults
        return {**out, "model.kappa.input": own[0], "model.kappa.logit_scale": 1.0, "model.kappa.tanh_gain": 1.0}
    return {**out, "model.kappa.input": (free or [kappa["input"]])[0], "model.kappa.logit_scale": scales[0],
            "model.kappa.tanh_gain": scales[1]}


def kappa_input_kind(name: str) -> str:
    """The modeling file's name for what variant `name` makes κ see: its registry entry's hf_input
    (`logit`, the raw logit that the scales then multiply, for logit and scaled; `normalized`)."""
    hf_input = kappa_inputs.lookup(name).hf_input
    if hf_input is None:
        raise ConfigError(f"model.kappa.input: {name}: no exported model computes this variant (its registry "
                          "entry names no modeling-file input, hf_input)")
    return hf_input


# modeling_kappa_moe.py is written from the κ input variants' entries: its kappa_logit is generated
# from their hf_code, so a variant registered with its code exports; the file in this package is
# what the built-in variants generate (tests/test_export_adapters.py), so it imports on its own
DOC_WIDTH = 92  # the generated docstring's wrap (the file's)


def kappa_logit_source() -> str:
    """modeling_kappa_moe.py's kappa_logit: the raw logit, or each exported variant's hf_code."""
    coded: dict[str, kappa_inputs.Variant] = {}
    for name, v in kappa_inputs.VARIANTS.items():
        if v.hf_input is not None and v.hf_code is not None:
            if coded.setdefault(v.hf_input, v).hf_code != v.hf_code:
                raise ConfigError(f"model.kappa.input: {name}: its hf_code differs from another variant's of "
                                  f"hf_input {v.hf_input}")
    doc = "What κ sees of the router logits [T, E]: the logit" + "".join(
        f", or ({kind}) {v.hf_doc}" for kind, v in coded.items()) + "."
    lines = ["def kappa_logit(logits, router_weight, kind: str):",
             textwrap.fill(f'"""{doc}"""', width=DOC_WIDTH, initial_indent="    ", subsequent_indent="    ",
                           break_long_words=False, break_on_hyphens=False)]
    for i, (kind, v) in enumerate(coded.items()):
        if i < len(coded) - 1:
            lines += [f'    if kind == "{kind}":', textwrap.indent(v.hf_code.rstrip("\n"), " " * 8)]
        else:  # the last one: the raw logit for every other kind
            lines += [f'    if kind != "{kind}":', "        return logits",
                      textwrap.indent(v.hf_code.rstrip("\n"), " " * 4)]
    if not coded:
        lines.append("    return logits")
    return "\n".join(lines) + "\n"


def modeling_source() -> str:
    """modeling_kappa_moe.py as exported: this package's file with kappa_logit generated from the registry."""
    text = (Path(__file__).parents[1] / CODE).read_text(encoding="utf-8")
    start = text.index("def kappa_logit(")
    end = text.index("\n\n\n", start) + 1
    return text[:start] + kappa_logit_source() + text[end:]
