"""The routed rows the busiest expert-parallel rank holds: read by the activation estimate (the
rows' saved tensors) and the step-time estimate (the experts' FLOPs and the all-to-all)."""
from __future__ import annotations

from megatron_kappa.config import MoEConfig


def routed_rows(moe: MoEConfig, tokens: float, imbalance: float = 1.0) -> float:
    """Rows the busiest rank's experts process for `tokens` tokens: top-k per token, times the
    capacity factor where one caps the experts, else times the assumed imbalance (dropless routing:
    the busiest EP rank gets `imbalance` x the average)."""
    return tokens * moe.topk * (moe.capacity_factor or imbalance)


def routed_rows_per_rank(moe: MoEConfig, layout, tokens: float, imbalance: float = 1.0) -> float:
    """The routed rows one rank's experts hold for a micro-batch of `tokens` tokens (its replica's,
    over CP): each TP rank routes its sequence-parallel share, tokens / tp, and megatron's dispatcher
    gathers the rows over the expert-TP group, so tokens·k·etp/tp (times the capacity factor or the
    imbalance: routed_rows)."""
    return routed_rows(moe, tokens, imbalance) * layout.etp / layout.tp
