"""The attention kinds, each one entry of one registry (`KINDS`; `register` adds one at run time).

  gqa   megatron-core's SelfAttention: grouped-query attention over model.num_query_groups key/value
        heads, multi-head attention when that is null (the default).
  mla   multi-head latent attention (DeepSeek-V2/V3), megatron-core's MLASelfAttention: queries and
        keys/values through low-rank latents, a RoPE part of the key shared by all heads; its keys
        are the section model.mla.

The kind is a different axis from `model.attention` (sdpa | local | te), the core-attention
kernel that runs QKᵀ and AV inside whichever kind.

How a config names its kind: `model.attention_kind: <name>`, one switch for every kind (gqa by
default); a kind's own settings are its section (MLA's: model.mla, widths only). megatron has a
flag for MLA (`--multi-latent-attention`) and a name for the other variants
(`--experimental-attention-variant`); here one key names them all, so no two keys can disagree.
`model.mla.enabled`, the flag this project once had beside the name, is refused in one line that
says what to write instead (`RETIRED`, read by config/loading.py), and a run's config recorded
with it reads as its kind (`recorded`: the resume check, and config.load_recorded for the export
and the evaluations of older runs).

Everything that depends on the kind asks its entry (`of(model)`), and nothing else reads the
MLA section:
  config.checks      the kind's own rules (`validate`), its FP8 GEMM widths (`fp8_widths`)
  config.recompute   megatron's recompute modules that exist only with it (`recompute`)
  model.build        megatron's TransformerConfig values (`megatron`), the local spec's keywords
                     (`local_spec`), the linears built in FP8 (`fp8_linears`), and its pieces: the
                     TransformerConfig class (`transformer_config`) and the self-attention spec
                     (`attention`)
  plan/              parameters (`matrices`, `norm_gains`), FLOPs (`flops`), ring attention's K/V
                     (`kv_elements`), its narrow TP gathers (`tp_gathers`), activations (`activations`)
  export             the Hugging Face names of its tensors (`hf_names`, `hf_split_qkv`, `hf_qk_norms`),
                     DeepSeek's config keys (`hf_config`), the kappa_moe file's (`modeling`), or why
                     it is refused (`export_refusal`)
  resume             its section (`section`) shapes the parameters: the schema marks it `state`
                     (config/facts.py; tests/test_attention_kinds.py checks every kind's), and so is
                     model.attention_kind

Facts and pieces, as in megatron_kappa.routers: the facts (rules, counts, names) are torch-free
functions written here, read by the config, the preflight and the planner without torch. The
pieces need megatron-core: a built-in kind's live in megatron_kappa/model/attention_kinds/<name>.py,
which hands them over when imported (`implement`; build_model imports the package first); the
entry holds a placeholder for each (`KINDS.piece`: megatron_kappa.registry's mechanism, the one
every kind's registry uses), so a copy made with dataclasses.replace still reaches them. gqa has
no pieces (megatron's stock SelfAttention and TransformerConfig). This module imports nothing of
the package but that registry. A kind registered at run time gives its pieces itself: one
`register(name, Kind(...))`; what it leaves out is refused where it is needed (the planner, the
export), in one line naming model.attention_kind.

megatron's recompute module names are megatron's (a closed set): a kind owns those that exist only
with it (MLA: mla_up_proj); config/recompute.py reads the built-in kinds' when imported.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megatron_kappa.registry import Registry

DEFAULT = "gqa"
KEY = "model.attention_kind"


QKV_LINEARS = {"linear_qkv": "column", "linear_proj": "row"}


@dataclass(frozen=True)
class Kind:
    """A `model.attention_kind`. `model` is a ModelConfig, `par` a ParallelConfig, `t` the tensor-
    parallel size. The planner's and the export's fields are None for a kind they do not know."""
    help: str  # docs/config.md: "<name> <what it is>"
    # model → megatron TransformerConfig values of this kind's attention (beyond those every kind sets)
    megatron: Callable[[Any], dict]
    local_spec: dict = field(default_factory=dict)  # get_gpt_layer_local_spec's keywords for its stock layer
    fp8_linears: dict = field(default_factory=lambda: dict(QKV_LINEARS))  # its linears → column | row (FP8)
    # pieces (megatron-core): **kwargs → its TransformerConfig (None: megatron's TransformerConfig);
    # (the stock self-attention ModuleSpec, the attention projections' FP8Settings or None) → its spec
    # (None: the stock one)
    transformer_config: Optional[Callable[..., Any]] = None
    attention: Optional[Callable[[Any, Any], Any]] = None
    section: Optional[str] = None  # model.<section>: its own keys (marked `state` in the schema)
    validate: Optional[Callable[[Any, Any, Callable], None]] = None  # (model, par, need(ok, key, msg))
    fp8_widths: Optional[Callable[[Any, int], dict]] = None  # (model, t) → {key words: width} of its FP8 GEMMs
    # megatron's recompute modules that exist only with it: {name: (what, plan.speed.layer_flops parts)}
    recompute: dict = field(default_factory=dict)
    # the planner (None: not planned)
    matrices: Optional[Callable[[Any, int], dict]] = None  # (model, t) → {megatron module: elements} per layer
    norm_gains: Optional[Callable[[Any], int]] = None  # model → its q/k (or latent) norms' gains per layer
    # model → (projection elements per token, the cores' QKᵀ + AV width, {flops part: elements per token})
    flops: Optional[Callable[[Any], tuple]] = None
    kv_elements: Optional[Callable[[Any], int]] = None  # model → K and V elements per token (ring attention)
    tp_gathers: Callable[[Any], list] = lambda model: []  # widths of its narrow collectives over TP, per layer
    # (model, tokens, t) → {attention, core, up, repeated}: values kept per layer (plan.activations)
    activations: Optional[Callable[[Any, float, int], dict]] = None
    # the export (hub names, relative to self_attn. and self_attention.); None: refused
    hf_names: Optional[dict] = None
    hf_split_qkv: bool = False  # linear_qkv splits into q/k/v_proj (per query group)
    hf_qk_norms: bool = True  # q_layernorm / k_layernorm are q_norm / k_norm
    hf_config: Callable[[Any], dict] = lambda model: {}  # DeepSeek's config.json keys for it
    modeling: Callable[[Any], dict] = lambda model: {"mla": None}  # modeling_kappa_moe.py's config keys
    # the import (both hf_config's and modeling's inverse): those keys → its --set settings
    from_hf_config: Callable[[dict], dict] = lambda keys: {}
    export_refusal: str = ("no exported model computes this attention kind (its registry entry names no Hugging "
                           "Face tensors, hf_names); export a run of gqa or mla")

    @property
    def planned(self) -> bool:
        return None not in (self.matrices, self.norm_gains, self.flops, self.kv_elements, self.activations)

    @property
    def exported(self) -> bool:
        return self.hf_names is not None


KINDS: Registry[Kind] = Registry(KEY, Kind, noun="kind", needs=("megatron",), default=DEFAULT,
                                 pieces_in="model/attention_kinds")
# the registry's verbs, under the names model/attention_kinds/<kind>.py and a run-time kind call
register, unregister, lookup, names, implement = KINDS.register, KINDS.unregister, KINDS.lookup, KINDS.names, \
    KINDS.implement


def name_of(model) -> str:
    """The model's kind: model.attention_kind."""
    return model.attention_kind


def of(model) -> Kind:
    """The model's kind's entry."""
    return lookup(name_of(model))


def key_of(name: str) -> str:
    """The config key an error about kind `name` names: its section, or model.attention_kind."""
    kind = lookup(name)
    return f"model.{kind.section}" if kind.section else KEY


def described(model) -> str:
    """How the config chose the model's kind, for a refusal ("model.attention_kind is mla")."""
    return f"{KEY} is {name_of(model)}"


def settings_off() -> dict:
    """--set settings that select the default kind (an imported model's base, which its own kind's
    `from_hf_config` then overrides)."""
    return {KEY: DEFAULT}


def check(model, par, need):
    """The kind named, and the kind's own rules (config.checks)."""
    name = name_of(model)
    need(name in KINDS, KEY, f"expected one of {names()}, got {name!r}")
    kind = KINDS[name]
    if kind.validate is not None:
        kind.validate(model, par, need)


# keys a config may no longer hold: {dotted key: what to write instead} (config/loading.py refuses them)
RETIRED = {"model.mla.enabled": f"{KEY} alone picks the attention: write `{KEY}: mla` for true, and "
                                "nothing for false (gqa is the default)"}


def recorded(config: dict) -> dict:
    """A config recorded before model.attention_kind was the one switch (a checkpoint's, as a
    mapping), in today's keys: mla.enabled true is attention_kind mla, and the key goes."""
    model = config.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("mla"), dict) or "enabled" not in model["mla"]:
        return config
    mla = {k: v for k, v in model["mla"].items() if k != "enabled"}
    kind = "mla" if model["mla"]["enabled"] else (model.get("attention_kind") or DEFAULT)
    return {**config, "model": {**model, "mla": mla, "attention_kind": kind}}


def recompute_modules() -> dict[str, tuple[str, str, tuple]]:
    """{megatron recompute module: (its kind, what, flops parts)} of the registered kinds."""
    return {module: (name, what, parts) for name, kind in KINDS.items() for module, (what,
                                                                                     parts) in kind.recompute.items()}


def flop_parts() -> tuple[str, ...]:
    """The planner's sub-parts of the attention FLOPs that some kind's recompute module does again."""
    return tuple(dict.fromkeys(p for _, _, parts in recompute_modules().values() for p in parts))


def help_text() -> str:
    """model.attention_kind's help: every kind's line."""
    return "; ".join(kind.help for kind in KINDS.values())


# --- gqa: megatron's SelfAttention ----------------------------------------------------------------


def _heads(model) -> tuple[int, int, int]:
    """(heads, key/value groups, head width)."""
    n = model.num_attention_heads
    return n, model.num_query_groups or n, model.head_dim or model.hidden_size // n


def _gqa_megatron(model) -> dict:
    return dict(num_query_groups=model.num_query_groups, kv_channels=model.head_dim)


def _gqa_fp8_widths(model, t: int) -> dict:
    n, groups, d = _heads(model)
    return {"model.num_attention_heads × head_dim / tp": n * d // t,
            "model.num_query_groups × head_dim / tp": groups * d // t}


def _gqa_matrices(model, t: int) -> dict:
    h = model.hidden_size
    n, groups, d = _heads(model)
    return {"linear_qkv": h * d * (n + 2 * groups) // t, "linear_proj": h * d * n // t}


def _gqa_norm_gains(model) -> int:
    return 2 * _heads(model)[2] if model.qk_layernorm else 0


def _gqa_flops(model) -> tuple:
    h = model.hidden_size
    n, groups, d = _heads(model)
    return h * d * (n + 2 * groups) + n * d * h, 2 * n * d, {}


def _gqa_kv(model) -> int:
    n, groups, d = _heads(model)
    return 2 * groups * d


def _gqa_activations(model, tokens: float, t: int) -> dict:
    """norm input, qkv input, q k v, core output; local attention repeats the key/value heads."""
    h = model.hidden_size
    n, groups, d = _heads(model)
    core = tokens * d * n / t
    return dict(attention=tokens * (3 * h + d * (n + 2 * groups)) / t + core, core=core, up=0.0,
                repeated=tokens * 2 * (n - groups) * d / t)


register("gqa", Kind(
    help="gqa: megatron's grouped-query attention over model.num_query_groups key/value heads (null: multi-head)",
    megatron=_gqa_megatron, fp8_widths=_gqa_fp8_widths, matrices=_gqa_matrices, norm_gains=_gqa_norm_gains,
    flops=_gqa_flops, kv_elements=_gqa_kv, activations=_gqa_activations, hf_names={}, hf_split_qkv=True))


# --- mla: megatron's MLASelfAttention (model/attention_kinds/mla.py) -------------------------------


def _mla_megatron(model) -> dict:
    """Plain RoPE on its positional part (no YaRN); one latent for all heads: no query groups."""
    a = model.mla
    return dict(multi_latent_attention=True, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
                qk_head_dim=a.qk_head_dim, qk_pos_emb_head_dim=a.qk_pos_emb_head_dim, v_head_dim=a.v_head_dim,
                rope_type="rope", rotary_base=model.rotary_base, kv_channels=None, num_query_groups=None)


def _mla_rules(model, par, need):
    """What megatron-core's MLASelfAttention and our SDPA core attention support."""
    a = model.mla
    need(model.num_query_groups is None, "model.num_query_groups",
         "must be null with model.attention_kind mla (MLA has one latent for all heads, no query groups)")
    need(model.attention == "sdpa", "model.attention",
         f"must be sdpa with model.attention_kind mla (MLA's core attention takes separate key and value widths, which "
         f"megatron's local attention does not), got {model.attention}")
    need(not model.value_embeddings, "model.value_embeddings",
         "must be false with model.attention_kind mla (the value embedding is added to grouped-query attention's "
         "values)")
    need(a.q_lora_rank is None or a.q_lora_rank % par.tp == 0, "model.mla.q_lora_rank",
         f"must be null or divisible by tp={par.tp} (its down projection is split over TP), got {a.q_lora_rank}")
    need((a.kv_lora_rank + a.qk_pos_emb_head_dim) % par.tp == 0, "model.mla.kv_lora_rank",
         f"kv_lora_rank + qk_pos_emb_head_dim = {a.kv_lora_rank + a.qk_pos_emb_head_dim} must be divisible by "
         f"tp={par.tp} (the key/value down projection is split over TP)")
    need(a.q_lora_rank is not None or not model.qk_layernorm, "model.mla.q_lora_rank",
         "null (no query latent) needs model.qk_layernorm: false: megatron-core 0.19 then norms the query "
         "inside Transformer Engine's fused norm+linear, which the CPU path does not have")
    need(a.qk_pos_emb_head_dim % 2 == 0, "model.mla.qk_pos_emb_head_dim",
         f"must be even (RoPE rotates pairs), got {a.qk_pos_emb_head_dim}")


def _mla_fp8_widths(model, t: int) -> dict:
    a = model.mla
    heads = model.num_attention_heads // t
    widths = {"model.num_attention_heads × (mla.qk_head_dim + mla.qk_pos_emb_head_dim) / tp":
              heads * (a.qk_head_dim + a.qk_pos_emb_head_dim),
              "model.num_attention_heads × (mla.qk_head_dim + mla.v_head_dim) / "
              "tp": heads * (a.qk_head_dim + a.v_head_dim),
              "model.num_attention_heads × mla.v_head_dim / tp": heads * a.v_head_dim,
              "(mla.kv_lora_rank + mla.qk_pos_emb_head_dim) / tp": (a.kv_lora_rank + a.qk_pos_emb_head_dim) // t,
              "mla.kv_lora_rank": a.kv_lora_rank}
    if a.q_lora_rank:
        widths["mla.q_lora_rank"] = a.q_lora_rank
        widths["mla.q_lora_rank / tp"] = a.q_lora_rank // t
    return widths


def _mla_matrices(model, t: int) -> dict:
    """Its projections on one TP rank (each split over TP by its output, linear_proj by its input)."""
    a = model.mla
    h, n = model.hidden_size, model.num_attention_heads
    q = n * (a.qk_head_dim + a.qk_pos_emb_head_dim)
    out = {"linear_q_down_proj": a.q_lora_rank * h // t, "linear_q_up_proj": q * a.q_lora_rank // t} \
        if a.q_lora_rank else {"linear_q_proj": q * h // t}
    out["linear_kv_down_proj"] = (a.kv_lora_rank + a.qk_pos_emb_head_dim) * h // t
    out["linear_kv_up_proj"] = n * (a.qk_head_dim + a.v_head_dim) * a.kv_lora_rank // t
    out["linear_proj"] = h * n * a.v_head_dim // t
    return out


def _mla_norm_gains(model) -> int:
    """The latents' norms: the query's (with a query latent) and the key/value one."""
    return ((model.mla.q_lora_rank or 0) + model.mla.kv_lora_rank) if model.qk_layernorm else 0


def _mla_flops(model) -> tuple:
    a, h, n = model.mla, model.hidden_size, model.num_attention_heads
    qk, v = a.qk_head_dim + a.qk_pos_emb_head_dim, a.v_head_dim
    q_up = a.q_lora_rank * n * qk if a.q_lora_rank else 0
    q = h * a.q_lora_rank + q_up if a.q_lora_rank else h * n * qk
    kv_up = a.kv_lora_rank * n * (a.qk_head_dim + v)
    per_token = q + h * (a.kv_lora_rank + a.qk_pos_emb_head_dim) + kv_up + n * v * h
    return per_token, n * (qk + v), {"mla_up": q_up + kv_up}


def _mla_kv(model) -> int:
    """megatron's MLA rings the up-projected K (nope + rope) and V."""
    a = model.mla
    return model.num_attention_heads * (a.qk_head_dim + a.qk_pos_emb_head_dim + a.v_head_dim)


def _mla_gathers(model) -> list:
    """The q latent (with q_lora_rank) gathered over the heads and over the sequence, [c_kv; k_pe]
    over the heads, k_pe and c_kv over the sequence (plan.speed.tensor_collectives)."""
    a = model.mla
    return [a.kv_lora_rank + a.qk_pos_emb_head_dim, a.qk_pos_emb_head_dim, a.kv_lora_rank] + \
        ([a.q_lora_rank] * 2 if a.q_lora_rank else [])


def _mla_activations(model, tokens: float, t: int) -> dict:
    """The latents, then q, k (nope + rope per head) and v; the core's output is v-wide; `up`: the
    up-projections' outputs q, k and v."""
    a, h, n = model.mla, model.hidden_size, model.num_attention_heads
    core = tokens * a.v_head_dim * n / t
    qk = a.qk_head_dim + a.qk_pos_emb_head_dim
    latents = (a.q_lora_rank or 0) + a.kv_lora_rank + a.qk_pos_emb_head_dim
    return dict(attention=tokens * (3 * h + latents + n * (2 * qk + a.v_head_dim)) / t + core, core=core,
                up=tokens * n * (2 * (a.qk_head_dim + a.qk_pos_emb_head_dim) + a.v_head_dim) / t, repeated=0.0)


# DeepSeek-V3's name ← megatron's (relative to self_attn. and self_attention.); the same tensors,
# same layouts; q_layernorm is the query latent's norm there
MLA_NAMES = {"q_proj.weight": "linear_q_proj.weight", "q_a_proj.weight": "linear_q_down_proj.weight",
             "q_a_layernorm.weight": "q_layernorm.weight", "q_b_proj.weight": "linear_q_up_proj.weight",
             "kv_a_proj_with_mqa.weight": "linear_kv_down_proj.weight",
             "kv_a_layernorm.weight": "kv_layernorm.weight", "kv_b_proj.weight": "linear_kv_up_proj.weight"}


def _mla_hf_config(model) -> dict:
    a = model.mla
    return dict(q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_head_dim,
                qk_rope_head_dim=a.qk_pos_emb_head_dim, v_head_dim=a.v_head_dim)


def _mla_modeling(model) -> dict:
    """modeling_kappa_moe.py's `mla` entry: the section's widths, and `enabled: true` as every export
    has carried it (the file reads the widths; folders exported before and after read the same)."""
    return {"mla": {"enabled": True, **dataclasses.asdict(model.mla)}}


def _mla_settings(keys: dict) -> dict:
    """DeepSeek's config.json widths (`_mla_hf_config`'s names) or modeling_kappa_moe.py's (the
    section's own names) as model.mla settings. An export written before model.attention_kind was
    the one switch also has the section's `enabled` (true): the kind says it now."""
    renamed = {"qk_nope_head_dim": "qk_head_dim", "qk_rope_head_dim": "qk_pos_emb_head_dim"}
    return {KEY: "mla", **{f"model.mla.{renamed.get(k, k)}": v for k, v in keys.items() if k != "enabled"}}


register("mla", Kind(
    help="mla: multi-head latent attention, megatron's multi_latent_attention: queries and keys/values projected "
         "through low-rank latents, a RoPE part of the key shared by all heads (its widths: model.mla; "
         "model.num_query_groups and model.head_dim are not used; model.qk_layernorm norms the two latents, as "
         "DeepSeek-V3)",
    megatron=_mla_megatron, local_spec={"multi_latent_attention": True},
    fp8_linears=dict(linear_q_proj="column", linear_q_up_proj="column", linear_kv_up_proj="column", linear_proj="row"),
    transformer_config=KINDS.piece("mla", "transformer_config"), attention=KINDS.piece("mla", "attention"),
    section="mla", validate=_mla_rules, fp8_widths=_mla_fp8_widths,
    recompute={"mla_up_proj": ("MLA's up-projections", ("mla_up",))},
    matrices=_mla_matrices, norm_gains=_mla_norm_gains, flops=_mla_flops, kv_elements=_mla_kv,
    tp_gathers=_mla_gathers, activations=_mla_activations, hf_names=MLA_NAMES, hf_qk_norms=False,
    hf_config=_mla_hf_config, modeling=_mla_modeling,
    from_hf_config=_mla_settings))
