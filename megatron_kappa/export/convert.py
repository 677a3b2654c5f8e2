"""A run's config and weights as a Hugging Face model's: which class takes it, its config.json, and
every tensor under that class's name.

The classes are the export targets (megatron_kappa.export.targets, one state-dict adapter each:
what it holds, its config.json, its names both ways); this module picks one and hands it the
run. `target_for` picks: the one asked for, checked, or for auto the first of transformers' own
classes that holds the model, else the project's code. The native classes are written in the
hub's per-expert layout, which transformers and the serving tools that take those classes read
as they are.
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron_kappa import attention_kinds, routers
from megatron_kappa.config import ConfigError, ModelConfig
from megatron_kappa.export import targets
from megatron_kappa.model.layout import ModelLayout


def choices() -> list[str]:
    """--target's values: auto and every registered target."""
    return ["auto", *targets.TARGETS]


def target_help() -> str:
    """--target's help: every registered target, what auto tries."""
    native = [a for a in targets.auto_order() if a.native]
    return ("the class of the folder: " + ", ".join(f"{a.name} ({a.architecture})" for a in targets.TARGETS.values())
            + "; auto (default): the first of " + ", ".join(a.name for a in native)
            + " (transformers' own classes) that holds the model, else "
            + ", ".join(a.name for a in targets.auto_order() if not a.native) + " (the project's code)")


def target_for(model: ModelConfig, layout: ModelLayout, requested: str = "auto") -> str:
    """The export target: `requested`, checked, or for auto the first target in
    megatron_kappa.export.targets.auto_order() that holds the model."""
    if requested not in choices():
        raise ConfigError(f"--target: expected one of {choices()}, got {requested!r}")
    router = routers.lookup(model.moe.router)
    if router.hf_score is None and layout.has_moe:  # no exported model routes like it
        raise ConfigError(f"model.moe.router: {model.moe.router}: {router.export_refusal}")
    kind = attention_kinds.of(model)
    if not kind.exported:  # no exported model names its tensors
        raise ConfigError(f"{attention_kinds.KEY}: {attention_kinds.name_of(model)}: {kind.export_refusal}")
    if requested != "auto":
        why = targets.lookup(requested).refusals(model, layout)
        if why:
            raise ConfigError(f"--target {requested}: " + "; ".join(why))
        return requested
    for adapter in targets.auto_order():
        why = adapter.refusals(model, layout)
        if not why:
            return adapter.name
    raise ConfigError(f"--target auto: {adapter.name}, the last tried: " + "; ".join(why))


def hf_config(model: ModelConfig, layout: ModelLayout, target: str, special: dict, kappa=None) -> dict:
    """config.json of the export. `special`: bos/eos/pad token ids; `kappa`: the KappaSettings in
    effect (model.build.kappa_settings) when κ is on."""
    return targets.lookup(target).config(model, layout, special, kappa)


def layer_tensors(model: ModelConfig, layout: ModelLayout, target: str, i: int, get: Callable[[str],
                                                                                              torch.Tensor]) -> dict:
    """{HF name: tensor} of layer i; get(relative megatron name) reads decoder.layers.<i>.<name>
    (None where the model has no such tensor)."""
    return targets.lookup(target).to_hf(model, layout, i, get)


def outer_tensors(model: ModelConfig, target: str, get: Callable[[str], torch.Tensor]) -> dict:
    """The embedding, the final norm and the output layer."""
    return targets.lookup(target).outer_to_hf(model, get)


def code_files(target: str) -> tuple[str, ...]:
    """The files of this package the target's folder needs beside the weights (its modeling code)."""
    return targets.lookup(target).code_files
