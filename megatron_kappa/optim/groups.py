"""The AdamW parameter groups beside the matrices: embedding, output, non-matrix and κ.

Their `kind` is what the schedules (megatron_kappa.optim.schedule) set learning rates by; both
optimizers (megatron_kappa.optim.optimizer for AdamW, megatron_kappa.optim.muon for Muon and
Aurora) build these groups the same way.
"""
from __future__ import annotations

from megatron_kappa.config import KappaConfig, TrainConfig
from megatron_kappa.model.params import (
    RESIDUAL_SCALARS,
    is_embedding_or_output,
    is_kappa,
    is_kappa_alpha,
    residual_scalar,
)

# resid_lambda, x0_lambda: model.residual_scalars' λ (the authors' scalar groups, 14c9b04
# nanochat/gpt.py 2375-2380); the value embeddings are in "embedding" (gpt 2352-2353)
ADAMW_KINDS = ("embedding", "output", "non_matrix", *RESIDUAL_SCALARS)


def in_kappa_group(name: str, kappa: KappaConfig) -> bool:
    """κ's own AdamW group: b, and α unless model.kappa.alpha_optimizer is matrix. With matrix, α
    goes where 14c9b04 put it: every ≥2-D block tensor but κ's b joins the matrices (nanochat/gpt.py
    2302-2303, 2311-2316), so the [E, F] α is trained with them at their lr, weight decay and
    schedule, as one matrix (docs/optimizer.md)."""
    return is_kappa(name) and not (kappa.alpha_optimizer == "matrix" and is_kappa_alpha(name))


def adamw_kind(name: str) -> str:
    """The group of a parameter that AdamW trains outside the matrices, routers and κ."""
    if is_embedding_or_output(name):
        return "output" if name.startswith("output_layer") else "embedding"
    return residual_scalar(name) or "non_matrix"


def adamw_groups(by_kind: dict, train: TrainConfig) -> list[dict]:
    """The embedding, output, non-matrix, residual-scalar and κ groups: no weight decay, learning
    rates set per step; λ_x0 with its own betas (train.x0_betas)."""
    betas = {"x0_lambda": tuple(train.x0_betas)}
    return [dict(name=kind, kind=kind, params=by_kind[kind], weight_decay=0.0,
                 **({"betas": betas[kind]} if kind in betas else {}))
            for kind in (*ADAMW_KINDS, "kappa")
            # the λ groups only where the model has them: a megatron block's optimizer state keeps
            # the group list that its existing checkpoints hold
            if by_kind[kind] or kind not in RESIDUAL_SCALARS]
