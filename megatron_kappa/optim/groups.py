"""The AdamW parameter groups beside the matrices: embedding, output, non-matrix and κ.

Their `kind` is what the schedules (megatron_kappa.optim.schedule) set learning rates by; both
optimizers (megatron_kappa.optim.optimizer for AdamW, megatron_kappa.optim.muon for Muon and
Aurora) build these groups the same way.
"""
from __future__ import annotations

from megatron_kappa.model.params import is_embedding_or_output

ADAMW_KINDS = ("embedding", "output", "non_matrix")


def adamw_kind(name: str) -> str:
    """The group of a parameter that AdamW trains outside the matrices, routers and κ."""
    if is_embedding_or_output(name):
        return "output" if name.startswith("output_layer") else "embedding"
    return "non_matrix"


def adamw_groups(by_kind: dict) -> list[dict]:
    """The embedding, output, non-matrix and κ groups: no weight decay, learning rates set per step."""
    return [dict(name=kind, kind=kind, params=by_kind[kind], weight_decay=0.0)
            for kind in (*ADAMW_KINDS, "kappa")]
