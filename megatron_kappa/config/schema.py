"""The config schema: one dataclass per YAML section, each value with its default and help text.

This is the one place every settable value, its default and its facts live (its range, whether it
shapes the parameters or optimizer state: megatron_kappa.config.facts); docs/config.md is generated
from it by `python -m megatron_kappa.config --markdown`. Reading YAML and `--set` overrides is in
megatron_kappa.config.loading, the cross-field checks in megatron_kappa.config.checks.

The sections are written by topic in three modules beside this one, and this module gathers them
(import every section from here): schema_model.py (model.kappa, model.fp8, model.moe, model.mla,
model.mtp), schema_train.py (parallel, train, zero) and schema_run.py (data, log, profile,
checkpoint, eval, run). ModelConfig's own keys and Config are here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

from megatron_kappa import attention_kinds
from megatron_kappa.config import recompute as selective
from megatron_kappa.config.facts import NON_NEGATIVE, POSITIVE
from megatron_kappa.config.facts import key as _f
from megatron_kappa.config.facts import section as _section
from megatron_kappa.config.schema_model import FP8Config, KappaConfig, MLAConfig, MoEConfig, MTPConfig, SoftMoEConfig
from megatron_kappa.config.schema_run import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LogConfig,
    ProfileConfig,
    RunConfig,
    WandbConfig,
)
from megatron_kappa.config.schema_train import MuonConfig, ParallelConfig, TrainConfig, ZeroConfig

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "EvalConfig", "FP8Config", "KappaConfig",
           "LogConfig", "MLAConfig", "MTPConfig", "ModelConfig", "MoEConfig", "MuonConfig", "ParallelConfig",
           "ProfileConfig", "RunConfig", "SoftMoEConfig", "TrainConfig", "WandbConfig", "ZeroConfig", "flat_keys",
           "to_dict"]


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the key."""


@dataclass
class ModelConfig:
    block: Literal["megatron", "nanochat"] = _f(
        "megatron", "the transformer block, a preset of the block keys below that the config does not set "
                    "itself (megatron_kappa.config.presets): megatron (megatron-core's GPT block) or nanochat "
                    "(the authors' block at 14c9b04: value_embeddings, embedding_norm, residual_scalars, "
                    "norm_gains false, norm_eps 1.19e-7, logit_softcap 15, init nanochat; docs/recipe.md)", state=True)
    num_layers: int = _f(4, "transformer layers", range=POSITIVE, state=True)
    aspect_ratio: Optional[int] = _f(
        None, "hidden_size = ⌈num_layers · aspect_ratio / head_dim⌉ · head_dim and num_attention_heads = "
              "hidden_size / head_dim (head_dim null: 128), the authors' width rule (14c9b04 "
              "scripts/base_train.py 548-556); it also sets the automatic batch's depth-12 reference width "
              "(null: hidden_size and heads as given; the reference at the authors' default 96)",
              range=POSITIVE, state=True)
    hidden_size: int = _f(128, "d_model", range=POSITIVE, state=True)
    num_attention_heads: int = _f(4, "attention heads", range=POSITIVE, state=True)
    num_query_groups: Optional[int] = _f(None, "GQA groups (null: no GQA)", range=POSITIVE, state=True)
    head_dim: Optional[int] = _f(None, "per-head width (null: hidden_size / heads)", range=POSITIVE, state=True)
    ffn_hidden_size: Optional[int] = _f(None, "dense MLP hidden size (null: 4 × hidden_size)",
                                        range=POSITIVE, state=True)
    vocab_size: int = _f(32768, "vocabulary size (padded to a multiple of 128 × TP in the model)",
                         range=POSITIVE, state=True)
    seq_length: int = _f(2048, "training sequence length", range=POSITIVE)
    layout: Literal["dense", "moe", "sandwich"] = _f(
        "moe", "dense: no MoE; moe: first `first_dense` layers dense, the rest MoE; "
               "sandwich: only the middle two layers MoE", state=True)
    first_dense: int = _f(2, "dense layers before the MoE layers (layout: moe)", range=NON_NEGATIVE, state=True)
    qk_layernorm: bool = _f(True, "RMSNorm on queries and keys", state=True)
    norm_gains: bool = _f(True, "learnable RMSNorm gains (false: parameter-free RMSNorm everywhere, as the "
                                "authors' nanochat block: 14c9b04 nanochat/gpt.py 315-317)", state=True)
    norm_eps: float = _f(1e-5, "RMSNorm epsilon (the authors' F.rms_norm default: the fp32 machine epsilon, "
                               "1.1920929e-07)", range=POSITIVE)
    logit_softcap: Optional[float] = _f(
        None, "logits → c·tanh(logits / c) before the loss and in evaluation (the authors' nanochat block: 15, "
              "14c9b04 nanochat/gpt.py 2447; null: none)", range=POSITIVE)
    value_embeddings: bool = _f(
        False, "on every other layer (i % 2 == (num_layers − 1) % 2, the last one included) an embedding of "
               "the input tokens, [vocab, kv heads · head_dim], added to the attention values as "
               "v + 2σ(W·x[..., :32])·ve, W one zero-initialised gate row per kv head (14c9b04 nanochat/gpt.py "
               "319-321, 360-379); trained with the input embedding's AdamW rate", state=True)
    embedding_norm: bool = _f(False, "RMSNorm (parameter-free) on the input embedding's output (14c9b04 "
                                     "nanochat/gpt.py 2432)")
    residual_scalars: bool = _f(
        False, "before every layer x = λ_resid·x + λ_x0·x0, x0 the (normed) input embedding, one learned "
               "λ_resid (init 1) and λ_x0 (init 0) per layer (14c9b04 nanochat/gpt.py 2436; AdamW at "
               "train.lr_resid_scalar and train.lr_x0_scalar); refuses model.recompute full", state=True)
    rotary_base: int = _f(10000, "RoPE base", range=POSITIVE)
    init_std: float = _f(0.02, "weight init standard deviation (init megatron)", range=POSITIVE)
    init: Literal["megatron", "nanochat"] = _f(
        "megatron", "megatron: normal(0, init_std), the output projections scaled by depth; nanochat (the authors' "
                    "block, 14c9b04 nanochat/gpt.py 2030-2120): the matrices U(±√3/√hidden_size), the attention "
                    "and MLP/expert output projections 0, the embedding N(0, 1), the output layer N(0, 0.001); the "
                    "router, which the authors leave uninitialised, as the matrices")
    cross_entropy_chunk: int = _f(4096, "tokens per chunk of the loss (megatron_kappa.model.loss): the "
                                        "fp32 softmax exists for one chunk at a time; 0: megatron-core's "
                                        "vocab_parallel_cross_entropy (fp32 logits of the whole micro-batch)",
                                        range=NON_NEGATIVE)
    recompute: Literal["none", "selective", "full"] = _f(
        "none", "activation recomputation: none; selective (core attention, and the experts' "
                "activation with grouped GEMMs, recomputed in backward); full (every layer's input "
                "kept, the layer recomputed: megatron's uniform method, one layer per checkpoint)")
    recompute_layers: int | None = _f(
        None, "with recompute: full, recompute only the first N layers of each pipeline stage (megatron's block "
              "method); the others keep their activations. null: every layer (the uniform method)", range=POSITIVE)
    recompute_modules: list | None = _f(
        None, "with recompute: selective, megatron's modules to recompute in backward (null: core_attn, and "
              f"moe_act with grouped GEMMs): {selective.describe()}. megatron's layernorm needs Transformer Engine "
              "(megatron_kappa/config/recompute.py)")
    attention: Literal["sdpa", "local", "te"] = _f(
        "sdpa", "core attention: torch's scaled_dot_product_attention (flash/cuDNN/memory-efficient "
                "kernels), megatron's local DotProductAttention (materialises the scores; for "
                "comparison), or Transformer Engine's (GPU, where TE imports)")
    # attention_kind: a name in megatron_kappa.attention_kinds.KINDS, which may grow at run time
    # (`register`), so it is checked when the config is validated (config/checks.py), not here
    attention_kind: str = _f(
        attention_kinds.DEFAULT, f"the attention kind (megatron_kappa.attention_kinds), the one key that picks "
                                 f"it: {attention_kinds.help_text()}. Not model.attention, the core-attention "
                                 "kernel inside either kind",
        allowed="a kind's name (megatron_kappa.attention_kinds)", state=True)
    compile: Literal["auto", True, False] = _f(
        "auto", "torch.compile each transformer layer, as torchtitan compiles its blocks "
                "(megatron_kappa/model/compile.py: the MoE dispatch and selective recompute's checkpoints stay "
                "eager at named boundaries; the start line counts the graph breaks): auto (on for CUDA, "
                "off on CPU, where eager is the faster start), true or false")
    mla: MLAConfig = _section(MLAConfig, state=True)
    mtp: MTPConfig = _section(MTPConfig)
    moe: MoEConfig = _section(MoEConfig)
    kappa: KappaConfig = _section(KappaConfig)
    fp8: FP8Config = _section(FP8Config)
@dataclass
class Config:
    run: RunConfig = _section(RunConfig)
    model: ModelConfig = _section(ModelConfig)
    parallel: ParallelConfig = _section(ParallelConfig, derived=True)
    precision: Literal["fp32", "bf16", "fp8"] = _f("fp32",
                                                   "parameter/compute precision: fp8 keeps bf16 parameters and runs "
                                                   "the GEMMs chosen in "
                    "model.fp8 in FP8 (torchao; emulated off CUDA; docs/fp8.md)", state=True)
    train: TrainConfig = _section(TrainConfig)
    zero: ZeroConfig = _section(ZeroConfig)
    data: DataConfig = _section(DataConfig)
    log: LogConfig = _section(LogConfig)
    profile: ProfileConfig = _section(ProfileConfig)
    checkpoint: CheckpointConfig = _section(CheckpointConfig)
    eval: EvalConfig = _section(EvalConfig)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def flat_keys(tree: dict, prefix: str = "") -> dict:
    """A nested config mapping (to_dict's) as {dotted key: value}."""
    out = {}
    for key, value in tree.items():
        out.update(flat_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out
