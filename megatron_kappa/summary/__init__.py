"""Model summary without allocating weights: parameters, active parameters, N_eff, token budget.

    python -m megatron_kappa.summary --config configs/moe8.yaml [--json] [--set key=value ...]
    python -m megatron_kappa.optim --config configs/moe8.yaml      # the optimizer's parameter groups
    python -m megatron_kappa.summary --paper      # the 8 paper configs beside the paper's numbers

(The command line is summary/__main__.py; this module counts.)

N_eff follows the paper's Appendix 8, N_eff = N_shared + N_attn + N_MLP(all experts) · sqrt(k / E),
counted as the authors' code counts it (askerlee/kappa-swiglu 02b8de3, nanochat/gpt.py
get_moe_adjusted_scaling_params): every parameter of the transformer blocks and the output layer,
not the input embedding, with the routed experts (κ's α and b included) at sqrt(k / E). The
authors switch that discount off when a model has fewer than num_layers / 5 MoE layers
(scripts/base_train.py, line 455): the sandwich models are counted in full (train.budget_discount).
The token budget is train.tokens_per_param (5) × N_eff; steps = budget // tokens per step.

Modules:
  __main__.py  `python -m megatron_kappa.summary`: the command line of megatron_kappa.summary (the
               counts, the paper table)
"""
from __future__ import annotations

import math

from megatron_kappa.config import Config, TrainConfig
from megatron_kappa.model.layout import ModelLayout, model_layout
from megatron_kappa.model.params import (
    is_embedding_or_output,
    is_expert,
    is_router,
    is_value_embedding,
    residual_scalar,
)


def _category(name: str) -> str:
    if is_value_embedding(name):
        return "value_embedding"
    if residual_scalar(name):
        return "scalars"
    if is_expert(name):
        return "experts"
    if is_router(name):
        return "router"
    if ".self_attention." in name and "layernorm" not in name:
        return "attention"
    if is_embedding_or_output(name):
        return "embedding"
    if ".mlp." in name:
        return "dense_mlp"
    return "norm"


def uses_discount(train: TrainConfig, layout: ModelLayout) -> bool:
    """Whether N_eff counts the routed experts at sqrt(k / E): train.budget_discount, or when it is
    null the authors' rule: only with at least num_layers / 5 MoE layers (scripts/base_train.py, line 455)."""
    moe_layers = layout.num_moe_layers
    if not moe_layers:
        return False
    if train.budget_discount is not None:
        return train.budget_discount
    return moe_layers >= len(layout.moe_layers) / 5  # the layout has one entry per layer: num_layers


def n_eff(by: dict, input_embedding: int, ratio: float, discount: bool) -> float:
    """The authors' scaling parameters: the transformer blocks and the output layer, experts at
    sqrt(k/E) if `discount`; not the input embedding, the value embeddings or the residual scalars
    (14c9b04 scripts/base_train.py 764-770: transformer.h and lm_head)."""
    rest = sum(by.values()) - by["experts"] - input_embedding - by["value_embedding"] - by["scalars"]
    return rest + by["experts"] * (math.sqrt(ratio) if discount else 1.0)


def count(model, cfg: Config, numel=lambda name, p: p.numel(), combine=None) -> dict:
    """Parameter counts by category and the derived totals. On a sharded model pass
    `numel=megatron_kappa.parallel.sharding.global_numel` to count the full model, and with
    pipeline stages `combine` (by category, input embedding) → the same summed over the stages."""
    by = {k: 0 for k in ("embedding", "value_embedding", "attention", "dense_mlp", "router", "experts", "norm",
                         "scalars")}
    mtp = dict.fromkeys(by, 0)  # model.mtp's modules, counted apart as DeepSeek-V3 reports them (671 B + 14 B)
    input_embedding = 0
    for name, p in model.named_parameters():
        if getattr(p, "ds_pipe_replicated", False):  # MTP's copy of the input embedding (model.embedding_copy)
            continue
        (mtp if name.startswith("mtp.") else by)[_category(name)] += numel(name, p)
        if "word_embeddings" in name:
            input_embedding += numel(name, p)
    if combine is not None:
        by, input_embedding = combine(by, input_embedding)
    total = sum(by.values())
    k, E = cfg.model.moe.active_experts, cfg.model.moe.num_experts  # SoftMoE: the budget
    layout = model_layout(cfg)
    has_moe = layout.has_moe
    ratio = k / E if has_moe else 1.0
    discount = uses_discount(cfg.train, layout)
    neff = n_eff(by, input_embedding, ratio, discount)
    tokens = int(cfg.train.tokens_per_param * neff)  # the authors' int(ratio × params)
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_length
    return {
        "total_params": total,
        "active_params_per_token": int(round(total - by["experts"] + by["experts"] * ratio)),
        "n_eff": int(round(neff)),
        "expert_discount": discount,
        "token_budget": tokens,
        "steps_for_budget": max(1, tokens // tokens_per_step),  # the authors floor it
        "tokens_per_step": tokens_per_step,
        "input_embedding": input_embedding,
        "by_category": by,
        "layout": ["moe" if m else "dense" for m in layout.moe_layers],
        "experts": E if has_moe else 0, "topk": k if has_moe else 0,
        "kappa": cfg.model.kappa.enabled and has_moe,
        # the MTP modules (their layers of the last layer's kind; the embedding and output layer are the
        # model's, shared): beside the totals above, which they are not part of
        "mtp_params": sum(mtp.values()),
        "mtp_active_params": int(round(sum(mtp.values()) - mtp["experts"] + mtp["experts"] * ratio)),
        "capacity": capacity_line(cfg) if has_moe else None,
        "packing": cfg.data.packing,
    }


def capacity_line(cfg: Config) -> str | None:
    """Expert capacity in words, with its group (the tokens one router call sees: model/capacity.py)."""
    moe, train_factor, eval_factor = cfg.model.moe, cfg.model.moe.capacity_factor, cfg.eval.capacity_factor
    if train_factor is None and eval_factor is None:
        return None
    group = cfg.train.micro_batch * cfg.model.seq_length // cfg.parallel.tp
    factors = f"factor {train_factor if train_factor is not None else 'none'} in training" + (
        f", {eval_factor} in evaluation" if eval_factor is not None else "")
    return (f"{factors}; capacity {moe.capacity}, drop order {moe.drop_order}; per group of {group:,} tokens "
            f"(micro_batch {cfg.train.micro_batch} × seq_length {cfg.model.seq_length}"
            + (f" / tp {cfg.parallel.tp}" if cfg.parallel.tp > 1 else "") + ")")


def summarize(cfg: Config) -> dict:
    """Build the full model on the meta device (no memory, no init) and count it."""
    from megatron_kappa.config import ParallelConfig
    from megatron_kappa.model.build import build_model
    from megatron_kappa.parallel.groups import init_distributed

    # The summary describes the whole model: build it unsharded, as one rank would hold it.
    unsharded = Config(**{**cfg.__dict__, "parallel": ParallelConfig()})
    init_distributed(unsharded.parallel, cfg.train.seed)
    layout = model_layout(unsharded)
    s = count(build_model(unsharded, meta=True, layout=layout), cfg)
    if layout.has_moe:
        # The reference is counted with the target's discount decision, as the authors do.
        ref = reference_d12(unsharded, layout)
        ref_layout = model_layout(ref)
        by_ref = count(build_model(ref, meta=True, layout=ref_layout), ref)
        ref_neff = n_eff(by_ref["by_category"], by_ref["input_embedding"],
                         cfg.model.moe.active_experts / cfg.model.moe.num_experts if ref_layout.has_moe else 1.0,
                         s["expert_discount"])
        tokens = auto_batch_tokens(s["token_budget"], ref_neff, cfg.train.tokens_per_param)
        s["auto_batch_tokens"] = tokens
        s["auto_global_batch"] = max(1, tokens // cfg.model.seq_length)
    return s


# The authors' automatic batch size (scripts/base_train.py, lines 831-843: "Power Lines",
# arXiv 2505.13738, B_opt ∝ D^0.383): 2^19 tokens was measured best for their depth-12 model, and
# B = 2^round(log2(2^19 · (D / D_ref)^0.383)) with D_ref = 5 × N_eff of that depth-12 model built
# with the same MoE arguments (build_model_meta(12)).
B_REF_TOKENS = 2 ** 19
BATCH_EXPONENT = 0.383


def reference_d12(cfg: Config, layout: ModelLayout) -> Config:
    """The authors' depth-12 reference: the width rule at the run's aspect ratio (model.aspect_ratio;
    the authors' default 96 when it is null: 1152; 14c9b04 scripts/base_train.py 774-781), head dim
    128, hidden 4·d, and the same --moe-start-layer / --num-moe-layers: layout moe (all layers from
    first_dense on) stays so; a sandwich (two MoE layers from the middle of `cfg`) keeps those of
    its MoE layers that fall below layer 12, so Sandwich-28L's layers 13, 14 leave a dense model."""
    import dataclasses

    from megatron_kappa.config.presets import width_from_aspect_ratio
    pattern = layout.moe_layers
    moe_below = max(0, 12 - cfg.model.first_dense) if cfg.model.layout == "moe" else sum(pattern[:12])
    d = width_from_aspect_ratio(12, cfg.model.aspect_ratio or 96)
    layout = {"layout": "moe", "first_dense": 12 - moe_below} if moe_below else {"layout": "dense"}
    model = dataclasses.replace(cfg.model, num_layers=12, hidden_size=d, num_attention_heads=d // 128,
                                ffn_hidden_size=4 * d, **layout,
                                moe=dataclasses.replace(cfg.model.moe, ffn_hidden_size=None))
    return dataclasses.replace(cfg, model=model)


def auto_batch_tokens(budget_tokens: int, reference_n_eff: float, tokens_per_param: float) -> int:
    """Tokens per optimizer step by the authors' rule, a power of two."""
    ratio = budget_tokens / (tokens_per_param * reference_n_eff)
    return 2 ** round(math.log2(B_REF_TOKENS * ratio ** BATCH_EXPONENT))


def show(value, as_json: bool, render) -> int:
    """A command line's result on stdout: JSON, or `render(value)`; exit status 0."""
    import json
    print(json.dumps(value, indent=2) if as_json else render(value))
    return 0


def _fmt(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


BESTFIT_CROP = 0.35  # the share of the documents' tokens best-fit rows of 2,048 crop (issue 52; 14c9b04)


def render(s: dict) -> str:
    layout = " ".join("M" if x == "moe" else "d" for x in s["layout"])
    return "\n".join([
        f"total parameters        {_fmt(s['total_params'])}  ({s['total_params']:,})",
        f"active per token        {_fmt(s['active_params_per_token'])}  (top-{s['topk']} of {s['experts']} experts)",
        f"N_eff (Appendix 8)      {_fmt(s['n_eff'])}  (all but the input embedding, as the authors count)",
        f"token budget 5 × N_eff  {_fmt(s['token_budget'])} tokens = {s['steps_for_budget']:,} steps of "
                      f"{s['tokens_per_step']:,}"
        f"  (experts at {'√(k/E)' if s['expert_discount'] else 'full count'})",
        *([f"corpus read             about {_fmt(s['token_budget'] / (1 - BESTFIT_CROP))} tokens of documents "
           f"(best-fit "
           f"rows crop about {BESTFIT_CROP:.0%} of them in the authors' runs; the trainer logs the share)"]
          if s.get("packing") == "bestfit" else []),
        *([f"authors' auto batch     {s['auto_batch_tokens']:,} tokens = {s['auto_global_batch']} sequences"]
          if "auto_batch_tokens" in s else []),
        f"layers (d dense, M MoE) {layout}",
        f"experts                 {'κ-SwiGLU' if s['kappa'] else 'SwiGLU'}",
        *([f"expert capacity         {s['capacity']}"] if s.get("capacity") else []),
        *([f"MTP modules (apart)     {_fmt(s['mtp_params'])}  ({_fmt(s['mtp_active_params'])} active per token)"]
          if s.get("mtp_params") else []),
        "by category             " + ", ".join(f"{k} {_fmt(v)}" for k, v in s["by_category"].items()),
    ])


# The paper's reported sizes (its summary, and the precise figures the authors' counting code gives
# for the published shapes: docs/authors_model.md §10): None = not reported. Where a config differs
# by more than 5 %, PAPER_DIFFERENCES says why. Only moe8 and sandwich28 are confirmed by the paper;
# the other configs follow the same rules (aspect ratio 96 or 32, the authors' budget and batch).
PAPER = {
    "moe8": {"total_params": 2.7e9, "active_params_per_token": 269e6, "token_budget": 2.7e9},
    "sandwich28": {"total_params": 3.278e9, "active_params_per_token": 849.0e6, "token_budget": 14.19e9},
}
PAPER_CONFIGS = [f"moe{n}" for n in (8, 10, 12, 14)] + [f"sandwich{n}" for n in (16, 20, 24, 28)]
PAPER_DIFFERENCES = {
    ("moe8", "total_params"): "the authors' own counting code gives 2.90 B for this shape (d 768, 64 "
                              "experts, value embeddings), whose active count (269 M) and tokens (2.7 B) "
                              "the paper confirms; its ≈ 2.7 B total is not reproduced by any count we know",
}
_COLUMNS = (("total_params", "total"), ("active_params_per_token", "active"), ("n_eff", "N_eff"),
            ("token_budget", "tokens"))


def paper_table(rows: dict) -> str:
    """`rows`: config name → summarize() result. Each number beside the paper's, where reported."""
    out = ["config       " + "  ".join(f"{title:>8} (paper)" for _, title in _COLUMNS)
           + "  discount  auto batch  config batch"]
    for name, s in rows.items():
        cells = []
        for key, _ in _COLUMNS:
            ref = PAPER.get(name, {}).get(key)
            cells.append(f"{_fmt(s[key]):>8} ({_fmt(ref) if ref else 'n/r'})")
        auto = s.get("auto_batch_tokens")
        out.append(f"{name:<12} " + "  ".join(f"{c:<16}" for c in cells)
                   + f"  {'√(k/E)' if s['expert_discount'] else 'off':<8}  "
                   + (f"2^{auto.bit_length() - 1:<9}" if auto else f"{'-':<11}") + f" {s['tokens_per_step']:,}")
    out.append("n/r: not reported by the paper; moe8 and sandwich28 are the published shapes, the others follow "
               "their rules. Differences over 5 %: "
               + "; ".join(f"{n} {k}: {why}" for (n, k), why in PAPER_DIFFERENCES.items()))
    return "\n".join(out)
