"""`model.recompute_modules`: megatron's selective-recompute modules that run here, in one table.

Each entry says what megatron recomputes, what model it needs, and which of the planner's per-layer
matmul parts (plan.speed.layer_flops) backward does again. The config check, the
model build (`selected`, handed to megatron's TransformerConfig), the planner's FLOPs and its
activation estimate (plan.activations, which tests each name against this table)
all read it. megatron's `layernorm` module is not here: it needs Transformer Engine. The modules
that exist only with one attention kind (MLA's mla_up_proj) are that kind's, in its registry entry
(megatron_kappa.attention_kinds: `recompute`), and need that kind.

Torch-free: the config check reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron_kappa import attention_kinds


@dataclass(frozen=True)
class Module:
    what: str  # for the docs and the errors
    flops: tuple[str, ...]  # the matmul parts of plan.speed.layer_flops that backward does again
    needs: Callable = lambda m: None  # ModelConfig → why the module cannot run with it, or None


def _kind_module(name: str, kind: str, what: str, flops: tuple[str, ...]) -> Module:
    """A module of attention kind `kind`'s, which needs that kind."""
    return Module(what, flops, lambda m: None if attention_kinds.name_of(m) == kind else
                  f"{name} needs {attention_kinds.key_of(kind)}")


MODULES = {
    "core_attn": Module("the attention core", ("scores",)),
    **{name: _kind_module(name, kind, what, flops)
       for name, (kind, what, flops) in attention_kinds.recompute_modules().items()},
    # elementwise: no matmul done again
    "moe_act": Module("the experts' activation", (),
                      lambda m: None if m.moe.grouped_gemm else
                      "moe_act needs model.moe.grouped_gemm (megatron recomputes the grouped experts' activation)"),
    "mlp": Module("a dense layer's MLP", ("mlp",)),
    "moe": Module("the whole MoE layer", ("router", "experts", "shared")),
    "shared_experts": Module("the shared experts", ("shared",),
                             lambda m: None if m.moe.shared_ffn_hidden_size else
                             "shared_experts needs model.moe.shared_ffn_hidden_size"),
}


def describe() -> str:
    """The names and what each recomputes, for the schema's help text."""
    return ", ".join(f"{name} ({module.what})" for name, module in MODULES.items())


def selected(m, has_moe: bool) -> tuple[str, ...]:
    """The modules selective recompute recomputes: model.recompute_modules, else core attention and
    (with grouped GEMMs) the experts' activation."""
    if m.recompute_modules is not None:
        return tuple(m.recompute_modules)
    return ("core_attn",) + (("moe_act",) if has_moe and m.moe.grouped_gemm else ())
