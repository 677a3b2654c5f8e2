"""What an export target is: a state-dict adapter between megatron's tensors and one Hugging Face
class's (torchtitan's `StateDictAdapter` is the model), and the hub layout most of them share.

An adapter says what its class is (`architecture`, `model_type`, whether transformers ships it),
what it can hold (`refusals`, the router score functions it runs), its config.json (`config`, and
`settings`, the project's model settings read back from one: megatron_kappa.import_hf), and maps
the tensors both ways: `to_hf` for the export, `from_hf`, its exact inverse, for reading
a Hugging Face model back. Both directions are one table (`Rule`: a megatron tensor ↔ its Hugging
Face tensors, a split and the join that undoes it), so neither can drift from the other.

Megatron's tensors, in the full (one-process) layout: linear_qkv holds, per query group, that
group's query heads, then its key head, then its value head; linear_fc1 holds [gate; up]. The
vocabulary padding (128 × TP) is cut off: the exported vocabulary is the tokenizer's, and
`from_hf` gives the unpadded rows (the padding belongs to the layout that reads them).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from megatron_kappa import attention_kinds, routers
from megatron_kappa.config import ModelConfig
from megatron_kappa.model.layout import ModelLayout


def ffn_sizes(model: ModelConfig) -> tuple[int, int]:
    """(dense MLP, expert) hidden sizes."""
    dense = model.ffn_hidden_size or 4 * model.hidden_size
    return dense, model.moe.ffn_hidden_size or dense


def head_sizes(model: ModelConfig) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim)."""
    return model.num_attention_heads, model.num_query_groups or model.num_attention_heads, \
        model.head_dim or model.hidden_size // model.num_attention_heads


def native_refusals(model: ModelConfig, need):
    """What none of transformers' classes has: κ and the nanochat block's parts."""
    need(not model.kappa.enabled, "model.kappa.enabled is true (κ-SwiGLU experts need the kappa_moe code)")
    need(model.norm_gains, "model.norm_gains is false (its norms have gains)")
    for key in ("value_embeddings", "embedding_norm", "residual_scalars"):
        need(not getattr(model, key), f"model.{key} is true (a nanochat-block part it lacks)")
    need(not model.logit_softcap, "model.logit_softcap is set (it has no softcap)")


def router_refusal(adapter, model: ModelConfig, need):
    """The model's router, unless the class runs its score function (megatron_kappa.routers: hf_score)."""
    moe = model.moe
    need(routers.lookup(moe.router).hf_score in adapter.scores,
         f"model.moe.router is {moe.router} ({adapter.router_note})")


def attention_refusal(adapter, model: ModelConfig, need):
    """The model's attention kind, unless the class runs it (megatron_kappa.attention_kinds)."""
    need(attention_kinds.name_of(model) in adapter.attention,
         f"{attention_kinds.described(model)} ({adapter.attention_note})")


def rope(model: ModelConfig) -> dict:
    return {"rope_type": "default", "rope_theta": float(model.rotary_base)}


def rotary_base(theta) -> int | float:
    """model.rotary_base (an integer) for a Hugging Face RoPE θ; a fractional θ stays as it is, for
    the config to refuse in one line."""
    return int(theta) if theta is not None and float(theta).is_integer() else theta


def rope_theta(hf) -> float | None:
    """The θ of a Hugging Face config's default RoPE (rope_parameters, or the older rope_theta)."""
    return (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", getattr(hf, "rope_theta", None))


def layout_settings(dense_layers: list[int], num_layers: int) -> dict:
    """model.layout and model.first_dense whose pattern has exactly these dense layers (the first
    of dense, moe with n dense layers first, sandwich that does); when none does, the moe guess,
    which the import's comparison then refuses naming the field."""
    from megatron_kappa.model.layout import moe_layer_pattern
    candidates = [("dense", 0), ("moe", len(dense_layers)), ("sandwich", 0)]
    for layout, first in candidates:
        probe = ModelConfig(num_layers=num_layers, layout=layout, first_dense=first)
        if [i for i, m in enumerate(moe_layer_pattern(probe)) if not m] == sorted(dense_layers):
            return {"model.layout": layout, "model.first_dense": first}
    return {"model.layout": "moe", "model.first_dense": len(dense_layers)}


def _whole(t):
    return (t,)


def _only(ts):
    return ts[0]


@dataclass(frozen=True)
class Rule:
    """One megatron tensor ↔ its Hugging Face tensors: `split` cuts the first into the second (in
    `hf`'s order), `join` puts them back. A `required` tensor missing is an error; any other is
    simply not in that model."""
    megatron: str
    hf: tuple[str, ...]
    split: Callable[[torch.Tensor], tuple] = _whole
    join: Callable[[list], torch.Tensor] = _only
    required: bool = False


def rename(megatron: str, hf: str, required: bool = False) -> Rule:
    return Rule(megatron, (hf,), required=required)


def vocab_rows(megatron: str, hf: str, vocab: int, required: bool = False) -> Rule:
    """A [padded vocabulary, ...] tensor without its padding rows (from_hf: the unpadded rows)."""
    return Rule(megatron, (hf,), split=lambda t: (t[:vocab],), required=required)


def swiglu(megatron: str, hf: str) -> list[Rule]:
    """megatron's linear_fc1 = [gate; up] and linear_fc2 under `megatron` ↔ gate/up/down_proj under `hf`."""
    return [Rule(megatron + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"),
                 split=lambda t: tuple(t.chunk(2, dim=0)), join=lambda ts: torch.cat(ts, dim=0), required=True),
            rename(megatron + "linear_fc2.weight", hf + "down_proj.weight", required=True)]


def qkv(model: ModelConfig) -> Rule:
    """linear_qkv (per query group: its query heads, its key head, its value head) ↔ q/k/v_proj."""
    heads, kv, d = head_sizes(model)
    per_group = heads // kv

    def split(t):
        t = t.view(kv, per_group + 2, d, -1)
        return (t[:, :per_group].reshape(heads * d, -1), t[:, per_group].reshape(kv * d, -1),
                t[:, per_group + 1].reshape(kv * d, -1))

    def join(ts):
        q, k, v = ts
        return torch.cat([q.view(kv, per_group, d, -1), k.view(kv, 1, d, -1), v.view(kv, 1, d, -1)], 1) \
            .reshape((per_group + 2) * kv * d, -1)
    return Rule("self_attention.linear_qkv.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                      "self_attn.v_proj.weight"), split=split, join=join,
                required=True)


def hub_layer_rules(model: ModelConfig, layout: ModelLayout, i: int) -> list[Rule]:
    """Layer i in the hub's layout (Qwen3-MoE's and DeepSeek-V3's names, per-expert tensors):
    megatron names relative to decoder.layers.<i>., Hugging Face names in full, in the order the
    export writes them."""
    p = f"model.layers.{i}."
    kind = attention_kinds.of(model)  # its tensors' names (MLA: DeepSeek-V3's, the same layouts)
    rules = []
    if kind.hf_split_qkv:
        attention = qkv(model)
        rules.append(Rule(attention.megatron, tuple(p + n for n in attention.hf), attention.split, attention.join,
                          required=True))
    rules += [rename("self_attention." + mg, p + "self_attn." + hf) for hf, mg in kind.hf_names.items()]
    rules.append(rename("self_attention.linear_proj.weight", p + "self_attn.o_proj.weight", required=True))
    optional = {"input_layernorm.weight": "input_layernorm.weight",
                "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
                "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
                "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
                "self_attn.value_gate.weight": "self_attention.value_gate",
                "resid_lambda": "resid_lambda", "x0_lambda": "x0_lambda"}
    if not kind.hf_qk_norms:  # MLA: q_layernorm is the query latent's norm (its hf_names)
        del optional["self_attn.q_norm.weight"], optional["self_attn.k_norm.weight"]
    rules += [rename(mg, p + hf) for hf, mg in optional.items()]
    rules.append(vocab_rows("self_attention.value_embedding", p + "self_attn.value_embedding.weight", model.vocab_size))
    if not layout.moe_layers[i]:
        return rules + swiglu("mlp.", p + "mlp.")
    rules += [rename("mlp.router.weight", p + "mlp.gate.weight", required=True),
              rename("mlp.router.expert_bias", p + "mlp.gate.e_score_correction_bias")]
    for e in range(model.moe.num_experts):
        rules += swiglu(f"mlp.experts.local_experts.{e}.", f"{p}mlp.experts.{e}.")
    rules += [rename("mlp.experts." + name, p + "mlp." + name) for name in ("kappa_alpha", "kappa_bias")]
    if model.moe.shared_ffn_hidden_size:
        rules += swiglu("mlp.shared_experts.", p + "mlp.shared_experts.")
    return rules


def outer_rules(model: ModelConfig) -> list[Rule]:
    """The embedding, the output layer and the final norm (full names on both sides)."""
    v = model.vocab_size
    return [vocab_rows("embedding.word_embeddings.weight", "model.embed_tokens.weight", v, required=True),
            vocab_rows("output_layer.weight", "lm_head.weight", v, required=True),
            rename("decoder.final_layernorm.weight", "model.norm.weight")]


class StateDictAdapter:
    """One export target (`--target <name>`). Subclasses set the class attributes and `own_config`,
    and the checks their class needs (`own_refusals`); a target whose names differ from the hub's
    overrides `renames`."""
    name: str  # --target's value
    architecture: str  # config.json's architectures[0]: the class that loads the folder
    model_type: str
    native: bool = True  # transformers' own class (auto tries these first); else code shipped beside the weights
    code_files: tuple[str, ...] = ()  # files of megatron_kappa/export copied beside the weights
    scores: tuple[str, ...] = ()  # the router score functions its class runs (megatron_kappa.routers: hf_score)
    attention: tuple[str, ...] = ("gqa",)  # the attention kinds its class runs (megatron_kappa.attention_kinds)
    attention_note: str = ""  # what attention it has, for the refusal of another
    router_note: str = ""  # how its router scores, for the refusal of another
    # (hub fragment, this class's fragment) in the order they apply to a name; undone in reverse
    renames: tuple[tuple[str, str], ...] = ()

    def code(self, name: str) -> str:
        """The text of `code_files`' file `name` as exported (the package's file)."""
        return Path(__file__).with_name(name).read_text(encoding="utf-8")

    # --- what it holds ---------------------------------------------------------------------------
    def refusals(self, model: ModelConfig, layout: ModelLayout) -> list[str]:
        """Why this class cannot hold the model (empty: it can)."""
        return []

    def own_config(self, model: ModelConfig, layout: ModelLayout, kappa) -> dict:
        """config.json's keys beyond those every target writes (`config`)."""
        raise NotImplementedError

    def config(self, model: ModelConfig, layout: ModelLayout, special: dict, kappa=None) -> dict:
        """config.json. `special`: bos/eos/pad token ids; `kappa`: the KappaSettings in effect
        (model.build.kappa_settings) when κ is on."""
        moe = model.moe
        heads, kv, head_dim = head_sizes(model)
        common = dict(vocab_size=model.vocab_size, hidden_size=model.hidden_size, num_hidden_layers=model.num_layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=model.norm_eps,
                      max_position_embeddings=model.seq_length, tie_word_embeddings=False,
                      num_experts_per_tok=moe.topk, bos_token_id=special["bos"], eos_token_id=special["eos"],
                      pad_token_id=special["pad"], hidden_act="silu")
        return dict(common, architectures=[self.architecture], model_type=self.model_type,
                    **self.own_config(model, layout, kappa))

    # --- the config read back (megatron_kappa.import_hf) ---------------------------------------------
    def settings(self, hf) -> dict:
        """The project's model settings ({dotted config key: value}) for a Hugging Face config of
        this class (`hf`: its transformers config object): `config`'s inverse. The import checks
        them the other way: `config` of the model they make must give `hf`'s fields back."""
        heads = hf.num_attention_heads
        kv = getattr(hf, "num_key_value_heads", None) or heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        common = {"model.vocab_size": hf.vocab_size, "model.hidden_size": hf.hidden_size,
                  "model.num_layers": hf.num_hidden_layers, "model.num_attention_heads": heads,
                  "model.num_query_groups": None if kv == heads else kv,
                  "model.head_dim": None if head_dim * heads == hf.hidden_size else head_dim,
                  "model.norm_eps": hf.rms_norm_eps, "model.moe.topk": hf.num_experts_per_tok,
                  "model.rotary_base": rotary_base(rope_theta(hf)),
                  # what transformers' classes lack (kappa_moe sets its own)
                  "model.block": "megatron", "model.kappa.enabled": False, "model.norm_gains": True,
                  "model.value_embeddings": False, "model.embedding_norm": False, "model.residual_scalars": False,
                  "model.logit_softcap": None, **attention_kinds.settings_off(),
                  "model.moe.route_scale": 1.0, "model.moe.num_groups": None, "model.moe.group_topk": None,
                  "model.moe.shared_ffn_hidden_size": None}
        return {**common, **self.own_settings(hf)}

    def own_settings(self, hf) -> dict:
        """`settings` beyond the keys every target writes: `own_config`'s inverse."""
        raise NotImplementedError

    # --- names and tensors, both ways --------------------------------------------------------------
    def hf_name(self, hub: str) -> str:
        """The hub layout's name as this class names it."""
        for old, new in self.renames:
            hub = hub.replace(old, new)
        return hub

    def hub_name(self, hf: str) -> str:
        """`hf_name`'s inverse."""
        for old, new in reversed(self.renames):
            hf = hf.replace(new, old)
        return hf

    def layer_rules(self, model: ModelConfig, layout: ModelLayout, i: int) -> list[Rule]:
        """Layer i's tensors: megatron names relative to decoder.layers.<i>., this class's in full."""
        return [Rule(r.megatron, tuple(self.hf_name(n) for n in r.hf), r.split, r.join, r.required)
                for r in hub_layer_rules(model, layout, i)]

    def outer_rules(self, model: ModelConfig) -> list[Rule]:
        return [Rule(r.megatron, tuple(self.hf_name(n) for n in r.hf), r.split, r.join, r.required)
                for r in outer_rules(model)]

    def to_hf(self, model: ModelConfig, layout: ModelLayout, i: int, get: Callable[[str], torch.Tensor]) -> dict:
        """{Hugging Face name: tensor} of layer i; get(relative megatron name) reads
        decoder.layers.<i>.<name> (None where the model has no such tensor)."""
        return apply(self.layer_rules(model, layout, i), get, f"decoder.layers.{i}.")

    def from_hf(self, model: ModelConfig, layout: ModelLayout, i: int, tensors: dict) -> dict:
        """{megatron name relative to decoder.layers.<i>.: tensor} from layer i's Hugging Face
        tensors (all of them, nothing else): `to_hf`'s inverse."""
        return invert(self.layer_rules(model, layout, i), tensors, f"layer {i}")

    def outer_to_hf(self, model: ModelConfig, get: Callable[[str], torch.Tensor]) -> dict:
        """The embedding, the final norm and the output layer; get(full megatron name)."""
        return apply(self.outer_rules(model), get, "")

    def outer_from_hf(self, model: ModelConfig, tensors: dict) -> dict:
        return invert(self.outer_rules(model), tensors, "the embedding, final norm and output layer")


def apply(rules: list[Rule], get: Callable[[str], torch.Tensor], prefix: str) -> dict:
    out = {}
    for rule in rules:
        t = get(rule.megatron)
        if t is None:
            if rule.required:
                raise KeyError(f"{prefix}{rule.megatron}: not in the checkpoint")
            continue
        out.update(zip(rule.hf, rule.split(t), strict=True))
    return out


def invert(rules: list[Rule], tensors: dict, where: str) -> dict:
    out, left = {}, dict(tensors)
    for rule in rules:
        found = [n for n in rule.hf if n in left]
        if found and len(found) < len(rule.hf) or not found and rule.required:
            missing = [n for n in rule.hf if n not in left]
            raise KeyError(f"{where}: {', '.join(missing)} missing (needed for {rule.megatron})")
        if found:
            out[rule.megatron] = rule.join([left.pop(n) for n in rule.hf])
    if left:
        raise KeyError(f"{where}: no megatron tensor for {', '.join(sorted(left))}")
    return out
