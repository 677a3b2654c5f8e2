"""Model summary without allocating weights: parameters, active parameters, N_eff, token budget.

    python -m megatron_kappa.summary --config configs/moe8.yaml [--json] [--set key=value ...]

N_eff follows the paper's Appendix 8: N_eff = N_shared + N_attn + N_MLP(all experts) · sqrt(k / E),
where we count as N_shared everything used by every token outside attention (embeddings, output
layer, norms, dense MLPs, routers) and as N_MLP the routed experts including κ's α and b.
The paper's token budget is 5 × N_eff.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from megatron_kappa.config import Config, ConfigError, load_config
from megatron_kappa.model.layout import moe_layer_pattern
from megatron_kappa.model.params import is_embedding_or_output, is_expert, is_router


def _category(name: str) -> str:
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


def count(model, cfg: Config, numel=lambda name, p: p.numel()) -> dict:
    """Parameter counts by category and the derived totals. On a sharded model pass
    `numel=megatron_kappa.parallel.sharding.global_numel` to count the full model."""
    by = {k: 0 for k in ("embedding", "attention", "dense_mlp", "router", "experts", "norm")}
    for name, p in model.named_parameters():
        by[_category(name)] += numel(name, p)
    total = sum(by.values())
    k, E = cfg.model.moe.active_experts, cfg.model.moe.num_experts  # SoftMoE: the budget
    has_moe = any(moe_layer_pattern(cfg))
    ratio = k / E if has_moe else 1.0
    n_shared = by["embedding"] + by["norm"] + by["dense_mlp"] + by["router"]
    n_eff = n_shared + by["attention"] + by["experts"] * math.sqrt(ratio)
    tokens = 5 * n_eff
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_length
    return {
        "total_params": total,
        "active_params_per_token": int(round(total - by["experts"] + by["experts"] * ratio)),
        "n_eff": int(round(n_eff)),
        "token_budget": int(round(tokens)),
        "steps_for_budget": math.ceil(tokens / tokens_per_step),
        "tokens_per_step": tokens_per_step,
        "by_category": by,
        "layout": ["moe" if m else "dense" for m in moe_layer_pattern(cfg)],
        "experts": E if has_moe else 0, "topk": k if has_moe else 0,
        "kappa": cfg.model.kappa.enabled and has_moe,
    }


def summarize(cfg: Config) -> dict:
    """Build the full model on the meta device (no memory, no init) and count it."""
    from megatron_kappa.config import ParallelConfig
    from megatron_kappa.model.build import build_model
    from megatron_kappa.parallel.groups import init_distributed

    # The summary describes the whole model: build it unsharded, as one rank would hold it.
    unsharded = Config(**{**cfg.__dict__, "parallel": ParallelConfig()})
    init_distributed(unsharded.parallel, cfg.train.seed)
    return count(build_model(unsharded, meta=True), cfg)


def _fmt(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def render(s: dict) -> str:
    layout = " ".join("M" if x == "moe" else "d" for x in s["layout"])
    return "\n".join([
        f"total parameters        {_fmt(s['total_params'])}  ({s['total_params']:,})",
        f"active per token        {_fmt(s['active_params_per_token'])}  (top-{s['topk']} of {s['experts']} experts)",
        f"N_eff (Appendix 8)      {_fmt(s['n_eff'])}",
        f"token budget 5 × N_eff  {_fmt(s['token_budget'])} tokens = {s['steps_for_budget']:,} steps of {s['tokens_per_step']:,}",
        f"layers (d dense, M MoE) {layout}",
        f"experts                 {'κ-SwiGLU' if s['kappa'] else 'SwiGLU'}",
        "by category             " + ", ".join(f"{k} {_fmt(v)}" for k, v in s["by_category"].items()),
    ])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_kappa.summary", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = summarize(cfg)
    print(json.dumps(s, indent=2) if args.json else render(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
