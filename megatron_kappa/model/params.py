"""Which parameters are which: one predicate per kind, by name.

Names work everywhere a parameter shows up: `named_parameters()`, state dicts (also offline, in
checkpoints), and gradient dicts. megatron-core's own mark for experts, `allreduce=False`, is set
only when EP > 1 or expert-TP differs from TP, so it cannot tell an expert at EP = 1.
"""
from __future__ import annotations

EXPERTS = ".mlp.experts."
KAPPA_SUFFIXES = ("experts.kappa_alpha", "experts.kappa_bias")


def is_expert(name: str) -> bool:
    """A routed expert's parameter (weights, and κ's α and b): sharded over EP and expert-TP,
    reduced over the expert-data-parallel group."""
    return EXPERTS in name or name.startswith(EXPERTS[1:])


def is_kappa(name: str) -> bool:
    """κ's α or b: own learning-rate schedule, freeze and L2 penalty."""
    return name.endswith(KAPPA_SUFFIXES)


def is_kappa_alpha(name: str) -> bool:
    """κ's α (the slope of the router logit; the authors' `kappa_scale`)."""
    return name.endswith(KAPPA_SUFFIXES[0])


def is_router(name: str) -> bool:
    return ".mlp.router." in name or name.startswith("mlp.router.")


def is_embedding_or_output(name: str) -> bool:
    return "embedding" in name or name.startswith("output_layer")


def is_value_embedding(name: str) -> bool:
    """A value-embedding table (model.value_embeddings): trained like the input embedding, counted
    as active, not in N_eff (as the authors count it)."""
    return name.endswith("self_attention.value_embedding")


RESIDUAL_SCALARS = ("resid_lambda", "x0_lambda")


def residual_scalar(name: str) -> str | None:
    """"resid_lambda" or "x0_lambda" for model.residual_scalars' λ, else None."""
    last = name.rsplit(".", 1)[-1]
    return last if last in RESIDUAL_SCALARS else None
