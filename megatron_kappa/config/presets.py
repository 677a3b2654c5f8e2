"""Keys that set other keys: `model.block` (a preset of the block keys), `model.aspect_ratio`
(the width from the depth) and a null `model.moe.aux_loss` (14c9b04's weight for the arm). Applied to the merged YAML
and overrides before the schema builds
the config, so every reader sees plain values and a run's config.yaml records them.

A preset fills only the keys the config leaves out: `model.block: nanochat` with
`model.value_embeddings: false` is the nanochat block without value embeddings.
"""
from __future__ import annotations

import math

from megatron_kappa.config.schema import ConfigError, KappaConfig, ModelConfig

# The authors' block at the paper's date (askerlee/kappa-swiglu 14c9b04; docs/authors_model.md):
# nanochat/gpt.py 315-317 (norms without gains, torch's default eps: the fp32 machine epsilon),
# 2432 (the embedding normed), 2436 (the residual scalars), 319-321 and 360-379 (value
# embeddings), 2447 (softcap 15), 2030-2120 (initialisation).
BLOCKS = {
    "megatron": {},
    "nanochat": {"value_embeddings": True, "embedding_norm": True, "residual_scalars": True,
                 "norm_gains": False, "norm_eps": 1.1920928955078125e-07, "logit_softcap": 15.0,
                 "init": "nanochat", "qk_layernorm": True},
}
AUTHORS_HEAD_DIM = 128  # 14c9b04 scripts/base_train.py 283
# 14c9b04 scripts/base_train.py 202 and 355-356: the aux-loss weight 1e-3, halved for a κ run unless
# --aux-loss-weight is given (02b8de3 has the halving commented out, 397-398)
AUTHORS_AUX_LOSS = 1e-3


def authors_aux_loss(kappa_enabled: bool) -> float:
    """14c9b04's aux-loss weight for an arm whose --aux-loss-weight was not set."""
    return AUTHORS_AUX_LOSS / 2 if kappa_enabled else AUTHORS_AUX_LOSS


def width_from_aspect_ratio(num_layers: int, aspect_ratio: int, head_dim: int = AUTHORS_HEAD_DIM) -> int:
    """The authors' width rule: depth × aspect ratio rounded up to whole heads (base_train.py 552-554)."""
    return math.ceil(num_layers * aspect_ratio / head_dim) * head_dim


def apply(data: dict) -> dict:
    """`data` (the merged config mapping) with model.block's preset, model.aspect_ratio's width and
    a null model.moe.aux_loss filled in; a key the config gives that contradicts aspect_ratio is a
    ConfigError."""
    model = data.get("model")
    if not isinstance(model, dict):
        return data
    model = dict(model)
    block = model.get("block", "megatron")
    if block not in BLOCKS:
        raise ConfigError(f"config: model.block: expected one of {list(BLOCKS)}, got {block!r}")
    for key, value in BLOCKS[block].items():
        model.setdefault(key, value)
    ratio = model.get("aspect_ratio")
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio <= 0:
            raise ConfigError(f"config: model.aspect_ratio: expected a positive integer, got {ratio!r}")
        head_dim = model.get("head_dim") or AUTHORS_HEAD_DIM
        layers = model.get("num_layers", ModelConfig.num_layers)
        width = width_from_aspect_ratio(layers, ratio, head_dim)
        derived = {"hidden_size": width, "num_attention_heads": width // head_dim}
        for key, value in derived.items():
            given = model.get(key)
            if given is not None and given != value:
                raise ConfigError(f"config: model.{key}: {given}, but model.aspect_ratio {ratio} at "
                                  f"{layers} layers gives {value} (set one of them)")
            model[key] = value
    moe = model.get("moe")
    if isinstance(moe, dict) and "aux_loss" in moe and moe["aux_loss"] is None:
        kappa = model.get("kappa")
        enabled = kappa.get("enabled", KappaConfig.enabled) if isinstance(kappa, dict) else KappaConfig.enabled
        model["moe"] = {**moe, "aux_loss": authors_aux_loss(bool(enabled))}
    return {**data, "model": model}
