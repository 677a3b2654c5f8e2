"""The export targets (`--target`), each one state-dict adapter (megatron_kappa.export.adapter) in
one registry (`TARGETS`, a megatron_kappa.registry.Registry as every kind's; `TARGETS.register(name,
adapter)` adds one). `auto` tries transformers' own classes in registration order and falls back
to the project's code.

Modules:
  deepseek_v3.py  transformers' DeepseekV3ForCausalLM as an export target: MLA with its latent
                  norms, the sigmoid router with its balance bias (group-limited or not), shared
                  experts a multiple of an expert's width, dense first layers, no κ
  kappa_moe.py    This project's own class as an export target: modeling_kappa_moe.py beside the
                  weights (trust_remote_code), for every model this project trains but SoftMoE (κ or
                  plain experts, softmax or sigmoid routers, shared experts, any layout, the
                  nanochat block, MLA)
  mixtral.py      transformers' MixtralForCausalLM as an export target: Qwen3-MoE's model without
                  q/k norms, every layer MoE, under the hub's Mixtral names
                  (`block_sparse_moe.experts.<j>.w1`)
  qwen3_moe.py    transformers' Qwen3MoeForCausalLM as an export target: plain SwiGLU experts, a
                  softmax router, q/k norms with gains, no nanochat parts; dense layers are its
                  `mlp_only_layers`
"""
from __future__ import annotations

from megatron_kappa.config import ConfigError
from megatron_kappa.export.adapter import StateDictAdapter
from megatron_kappa.export.targets.deepseek_v3 import DeepseekV3
from megatron_kappa.export.targets.kappa_moe import KappaMoe
from megatron_kappa.export.targets.mixtral import Mixtral
from megatron_kappa.export.targets.qwen3_moe import Qwen3Moe
from megatron_kappa.registry import Registry

TARGETS: Registry[StateDictAdapter] = Registry("--target", StateDictAdapter, noun="target", error=ConfigError)


def lookup(name: str) -> StateDictAdapter:
    """The target `name` (the error lists `auto` too, --target's other value)."""
    if name not in TARGETS:
        raise ConfigError(f"--target: expected one of {['auto', *TARGETS]}, got {name!r}")
    return TARGETS[name]


def auto_order() -> list[StateDictAdapter]:
    """The targets `auto` tries: transformers' own classes first (a folder anything loads), then ours."""
    return [a for a in TARGETS.values() if a.native] + [a for a in TARGETS.values() if not a.native]


for _adapter in (KappaMoe(), Qwen3Moe(), Mixtral(), DeepseekV3()):
    TARGETS.register(_adapter.name, _adapter)
