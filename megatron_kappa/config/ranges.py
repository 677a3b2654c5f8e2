"""The allowed range of every numeric config key, in one table: checked when a config is validated
(before the cross-field checks of megatron_kappa.config.checks) and shown in the generated
docs/config.md. Every number is also finite (megatron_kappa.config.loading). A null, where a key
allows one, is not checked here. tests/test_reliability.py checks that every numeric schema key
has a range, and that each range refuses a value just outside it.
"""
from __future__ import annotations

import dataclasses
import typing

POSITIVE, NON_NEGATIVE, FRACTION, OPEN_FRACTION, PROBABILITY, BEYOND_ONE, AT_LEAST_ONE = (
    "> 0", ">= 0", "[0, 1)", "(0, 1]", "[0, 1]", "> 1", ">= 1")
WORDS = {POSITIVE: "must be positive", NON_NEGATIVE: "must not be negative", FRACTION: "must be in [0, 1)",
         OPEN_FRACTION: "must be in (0, 1]", PROBABILITY: "must be in [0, 1]", BEYOND_ONE: "must be > 1",
         AT_LEAST_ONE: "must be at least 1"}
TESTS = {POSITIVE: lambda v: v > 0, NON_NEGATIVE: lambda v: v >= 0, FRACTION: lambda v: 0 <= v < 1,
         OPEN_FRACTION: lambda v: 0 < v <= 1, PROBABILITY: lambda v: 0 <= v <= 1, BEYOND_ONE: lambda v: v > 1,
         AT_LEAST_ONE: lambda v: v >= 1}

RANGES = {
    "model.num_layers": POSITIVE, "model.aspect_ratio": POSITIVE, "model.hidden_size": POSITIVE,
    "model.num_attention_heads": POSITIVE, "model.num_query_groups": POSITIVE, "model.head_dim": POSITIVE,
    "model.ffn_hidden_size": POSITIVE, "model.vocab_size": POSITIVE, "model.seq_length": POSITIVE,
    "model.first_dense": NON_NEGATIVE, "model.norm_eps": POSITIVE, "model.logit_softcap": POSITIVE,
    "model.rotary_base": POSITIVE, "model.init_std": POSITIVE, "model.cross_entropy_chunk": NON_NEGATIVE,
    "model.recompute_layers": POSITIVE,
    "model.mla.q_lora_rank": POSITIVE, "model.mla.kv_lora_rank": POSITIVE, "model.mla.qk_head_dim": POSITIVE,
    "model.mla.qk_pos_emb_head_dim": POSITIVE, "model.mla.v_head_dim": POSITIVE,
    "model.mtp.num_layers": NON_NEGATIVE, "model.mtp.loss_weight": NON_NEGATIVE,
    "model.moe.num_experts": POSITIVE, "model.moe.topk": POSITIVE, "model.moe.ffn_hidden_size": POSITIVE,
    "model.moe.shared_ffn_hidden_size": POSITIVE, "model.moe.aux_loss": NON_NEGATIVE,
    "model.moe.z_loss": NON_NEGATIVE, "model.moe.aux_loss_warmup_scale": NON_NEGATIVE,
    "model.moe.aux_loss_warmup_steps": NON_NEGATIVE, "model.moe.z_loss_input_grad_scale": NON_NEGATIVE,
    "model.moe.route_scale": POSITIVE, "model.moe.num_groups": POSITIVE, "model.moe.group_topk": POSITIVE,
    "model.moe.seq_aux_loss": NON_NEGATIVE, "model.moe.bias_update_rate": NON_NEGATIVE,
    "model.moe.capacity_factor": POSITIVE, "model.moe.softmoe.budget": POSITIVE,
    "model.moe.softmoe.temperature": POSITIVE, "model.moe.softmoe.threshold": FRACTION,
    "model.moe.softmoe.max_experts": POSITIVE,
    "model.kappa.U": BEYOND_ONE, "model.kappa.logit_scale": POSITIVE, "model.kappa.tanh_gain": POSITIVE,
    "model.kappa.router_grad_scale": NON_NEGATIVE, "model.kappa.u_warmup": PROBABILITY,
    "model.kappa.freeze_fraction": FRACTION, "model.kappa.freeze_min_steps": NON_NEGATIVE,
    "model.kappa.lr": NON_NEGATIVE, "model.kappa.lr_end": NON_NEGATIVE, "model.kappa.warmup": NON_NEGATIVE,
    "model.kappa.l2_alpha": NON_NEGATIVE, "model.kappa.l2_bias": NON_NEGATIVE,
    "parallel.tp": POSITIVE, "parallel.ep": POSITIVE, "parallel.etp": POSITIVE, "parallel.pp": POSITIVE, "parallel.vpp": POSITIVE,
    "parallel.first_stage_layers": POSITIVE, "parallel.last_stage_layers": POSITIVE,
    "parallel.timeout_s": POSITIVE,
    "train.steps": POSITIVE, "train.seed": NON_NEGATIVE, "train.micro_batch": POSITIVE,
    "train.global_batch": POSITIVE, "train.tokens_per_param": POSITIVE, "train.lr": NON_NEGATIVE,
    "train.lr_non_matrix": NON_NEGATIVE, "train.lr_embedding": NON_NEGATIVE, "train.lr_output": NON_NEGATIVE,
    "train.lr_wsd_decay_fraction": OPEN_FRACTION, "train.min_lr_ratio": PROBABILITY,
    "train.warmup": NON_NEGATIVE, "train.weight_decay": NON_NEGATIVE, "train.lr_resid_scalar": NON_NEGATIVE,
    "train.lr_x0_scalar": NON_NEGATIVE, "train.adam_eps": NON_NEGATIVE, "train.grad_clip": NON_NEGATIVE,
    "train.muon.lr": NON_NEGATIVE, "train.muon.momentum": FRACTION, "train.muon.ns_steps": AT_LEAST_ONE,
    "train.muon.weight_decay": NON_NEGATIVE, "train.muon.aurora_rounds": AT_LEAST_ONE,
    "train.muon.aurora_exponent": NON_NEGATIVE, "train.muon.max_scale": POSITIVE,
    "zero.stage": POSITIVE, "log.interval": POSITIVE, "log.peak_tflops": POSITIVE,
    "checkpoint.interval": POSITIVE, "checkpoint.keep": POSITIVE,
    "eval.valid_every": NON_NEGATIVE, "eval.valid_iters": POSITIVE, "eval.core_every": NON_NEGATIVE,
    "eval.core_max_per_task": POSITIVE, "eval.capacity_factor": POSITIVE,
}


# What the other constrained keys accept (shown in docs/config.md; checked in config/checks.py).
OTHER = {
    "train.betas": "two numbers in [0, 1)", "train.x0_betas": "two numbers in [0, 1)",
    "model.moe.router": "a router's name (megatron_kappa.routers)",
    "model.kappa.input": "a κ input's name (megatron_kappa.kappa.inputs)",
    "data.paths": "shard prefixes, optionally weighted", "data.valid_paths": "shard prefixes, optionally weighted",
    "data.split": "three numbers: train,valid,test", "run.dir": "a folder that is or can be made writable",
}


def numeric_keys(cls, prefix: str = ""):
    """(dotted key, int or float) of every numeric leaf of the schema."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from numeric_keys(kind, f"{prefix}{f.name}.")
            continue
        args = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
        if typing.get_origin(kind) is not typing.Literal and args[0] in (int, float):
            yield f"{prefix}{f.name}", args[0]


def check(cfg, need):
    """Every numeric value inside its range (`need(ok, key, message)`, as config.checks)."""
    from megatron_kappa.config.schema import flat_keys
    for key, value in flat_keys(dataclasses.asdict(cfg)).items():
        spec = RANGES.get(key)
        if spec is not None and value is not None and not isinstance(value, bool):
            need(TESTS[spec](value), key, f"{WORDS[spec]}, got {value}")
