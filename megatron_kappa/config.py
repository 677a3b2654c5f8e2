"""The run configuration: YAML validated against the dataclass schema below.

The schema is the one place every settable value and its default lives (docs/config.md is
generated from it by `python -m megatron_kappa.config --markdown`). Unknown keys, wrong types and
bad values are one-line `ConfigError`s naming the key. Overrides use the Megatron/Hydra-ish form
`--set a.b=1 c.d=[1,2]` (values parsed as YAML). A config file may start from another one with
`extends: other.yaml` (a path relative to the file): the other file's values are the base, this
file's values are merged over them key by key, then the overrides.

Checks that need more than the config (files, world size, installed packages) are in
megatron_kappa.preflight; both run before any process group or model exists.

The file is longer than the project's other modules on purpose: it is the whole schema, and each
value's default, help text and cross-field check sit in one file, where `--set` users look.
"""
from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import yaml

from megatron_kappa.kappa import DEFAULTS as KAPPA


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the key."""


def _f(default, help: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class KappaConfig:
    enabled: bool = _f(True, "κ-SwiGLU experts (false: plain SwiGLU experts, the baseline)")
    U: float = _f(KAPPA.U, "κ range: κ ∈ (1/U, U)")
    use_alpha: bool = _f(KAPPA.use_alpha, "learn α (false: the paper's κ-SwiGLU₋α ablation)")
    use_bias: bool = _f(KAPPA.use_bias, "learn b (false: the paper's κ-SwiGLU₋b ablation)")
    logit_scale: float = _f(KAPPA.logit_scale, "multiplies the router logit (authors' code: 0.15)")
    tanh_gain: float = _f(KAPPA.tanh_gain, "gain inside tanh (authors' code: 2.0)")
    freeze_fraction: float = _f(0.1, "α, b held at exactly 0 for this fraction of iterations")
    lr: float = _f(0.12, "κ learning-rate peak, reached after `warmup` iterations past unfreezing")
    lr_end: float = _f(0.06, "κ learning rate at the last iteration (linear decay)")
    warmup: int = _f(1000, "κ learning-rate warmup iterations after unfreezing")
    l2_alpha: float = _f(2e-2, "L2 penalty λ_α Σ α²")
    l2_bias: float = _f(1e-2, "L2 penalty λ_b Σ b²")


@dataclass
class SoftMoEConfig:
    """model.moe.router: softmoe (docs/softmoe.md; defaults marked there as reconstructions)."""
    budget: Optional[float] = _f(None, "mean over the MoE layers of k_l, each layer's mean active experts "
                                       "per token; held exactly (null: model.moe.topk)")
    allocation: Literal["softmax", "lapsum"] = _f(
        "softmax", "k_l from one learned θ_l per layer: L·budget·softmax(θ)_l clamped to [1e-3, E − 1e-3], "
                   "or E·LapSum(θ; L·budget/E)_l, inside (0, E) with no clamp")
    temperature: float = _f(0.1, "LapSum scale α (→ 0: hard top-k of the logits; large: k_l/E everywhere)")
    threshold: float = _f(0.05, "truncation τ: experts with p < τ are not run (0: every expert runs)")
    normalize: Literal["none", "sum", "budget"] = _f(
        "none", "routing weights: the truncated p as is, divided by their sum, or scaled to sum to k_l")
    max_experts: Optional[int] = _f(None, "cap on experts run per token (memory); the largest p are kept, "
                                          "and tokens over it are counted in metrics (null: num_experts)")


@dataclass
class MoEConfig:
    num_experts: int = _f(8, "routed experts per MoE layer")
    topk: int = _f(2, "experts per token")
    ffn_hidden_size: Optional[int] = _f(None, "expert hidden size (default: model.ffn_hidden_size)")
    router: Literal["softmax", "sigmoid", "softmoe"] = _f(
        "softmax", "softmax top-k with aux loss (paper), sigmoid with an aux-loss-free bias (Trinity), or "
                   "softmoe: truncated LapSum soft top-k with learned per-layer budgets (model.moe.softmoe)")
    aux_loss: float = _f(1e-3, "Switch load-balancing loss weight (softmax and softmoe routers)")
    z_loss: float = _f(1e-5, "router z-loss weight")
    route_scale: float = _f(1.0, "constant multiplying the routing weights (Trinity-Large: 2.448)")
    bias_update_rate: float = _f(1e-3, "expert-bias update rate (sigmoid router)")
    dispatcher: Literal["alltoall", "allgather", "sorted"] = _f(
        "alltoall", "token dispatcher: megatron-core's alltoall or allgather, or sorted (no host sync; "
                    "all experts on one rank: EP = TP = ETP = 1, a top-k router, no capacity factor)")
    capacity_factor: Optional[float] = _f(None, "expert capacity factor (null: no token dropping)")
    grouped_gemm: bool = _f(True, "all local experts in two grouped GEMMs (torch.nn.functional.grouped_mm) "
                                  "instead of megatron's per-expert loop (SequentialMLP); needs d_model and "
                                  "the expert ffn size / etp to be multiples of 4 (fp32) or 8 (bf16)")
    softmoe: SoftMoEConfig = field(default_factory=SoftMoEConfig)

    @property
    def active_experts(self) -> float:
        """Experts per token: topk, or the SoftMoE budget (its mean over layers)."""
        budget = self.softmoe.budget
        return (self.topk if budget is None else budget) if self.router == "softmoe" else self.topk


@dataclass
class ModelConfig:
    num_layers: int = _f(4, "transformer layers")
    hidden_size: int = _f(128, "d_model")
    num_attention_heads: int = _f(4, "attention heads")
    num_query_groups: Optional[int] = _f(None, "GQA groups (null: no GQA)")
    head_dim: Optional[int] = _f(None, "per-head width (null: hidden_size / heads)")
    ffn_hidden_size: Optional[int] = _f(None, "dense MLP hidden size (null: 4 × hidden_size)")
    vocab_size: int = _f(32768, "vocabulary size (padded to a multiple of 128 × TP in the model)")
    seq_length: int = _f(2048, "training sequence length")
    layout: Literal["dense", "moe", "sandwich"] = _f(
        "moe", "dense: no MoE; moe: first `first_dense` layers dense, the rest MoE; "
               "sandwich: only the middle two layers MoE")
    first_dense: int = _f(2, "dense layers before the MoE layers (layout: moe)")
    qk_layernorm: bool = _f(True, "RMSNorm on queries and keys")
    rotary_base: int = _f(10000, "RoPE base")
    init_std: float = _f(0.02, "weight init standard deviation")
    cross_entropy_chunk: int = _f(4096, "tokens per chunk of the loss (megatron_kappa.model.loss): the "
                                        "fp32 softmax exists for one chunk at a time; 0: megatron-core's "
                                        "vocab_parallel_cross_entropy (fp32 logits of the whole micro-batch)")
    recompute: Literal["none", "selective", "full"] = _f(
        "none", "activation recomputation: none; selective (core attention, and the experts' "
                "activation with grouped GEMMs, recomputed in backward); full (every layer's input "
                "kept, the layer recomputed: megatron's uniform method, one layer per checkpoint)")
    attention: Literal["sdpa", "local", "te"] = _f(
        "sdpa", "core attention: torch's scaled_dot_product_attention (flash/cuDNN/memory-efficient "
                "kernels), megatron's local DotProductAttention (materialises the scores; for "
                "comparison), or Transformer Engine's (GPU, where TE imports)")
    moe: MoEConfig = field(default_factory=MoEConfig)
    kappa: KappaConfig = field(default_factory=KappaConfig)


@dataclass
class ParallelConfig:
    tp: int = _f(1, "tensor parallel size (sequence parallelism is on when tp > 1)")
    ep: int = _f(1, "expert parallel size")
    etp: Optional[int] = _f(None, "expert tensor parallel size (null: same as tp)")
    timeout_s: float = _f(600.0, "seconds a collective waits for the other ranks before the job fails "
                                 "(a dead or hung rank; torch's defaults: 30 min gloo, 10 min NCCL)")

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size in effect (`etp`, or `tp` when unset)."""
        return self.etp or self.tp


@dataclass
class MuonConfig:
    lr: float = _f(0.01, "peak learning rate of the orthogonalised matrices (train.lr's schedule; authors: 0.01)")
    momentum: float = _f(0.95, "momentum β of the EMA buffer M ← βM + (1-β)G")
    nesterov: bool = _f(True, "Nesterov: orthogonalise (1-β)G + βM instead of M")
    ns_steps: int = _f(5, "Newton–Schulz iterations per polar factor (authors: 5)")
    weight_decay: float = _f(0.05, "decoupled weight decay W ← W·(1 - lr·wd) of the orthogonalised matrices")
    aurora_rounds: int = _f(2, "aurora: row-equilibration rounds of a rectangular matrix (authors' pp_iterations)")
    aurora_exponent: float = _f(0.5, "aurora: exponent of the row rescaling D ← D·((n/m)/‖u_i‖²)^exponent (pp_beta)")
    scale: Optional[Literal["original", "match_rms_adamw", "none"]] = _f(
        None, "step scale per [m, n] matrix: original √max(1, m/n), match_rms_adamw 0.2·√max(m, n) "
              "capped at 1, none (null: original for muon, match_rms_adamw for aurora, as the authors)")
    max_scale: Optional[float] = _f(None, "cap on the step scale (null: 1.0 for match_rms_adamw, none otherwise)")


@dataclass
class TrainConfig:
    steps: Optional[int] = _f(None, "optimizer steps (null: the token budget 5 × N_eff)")
    seed: int = _f(24, "random seed (paper: 24, 26, 28)")
    micro_batch: int = _f(1, "sequences per rank per forward")
    global_batch: int = _f(8, "sequences per optimizer step (gradient accumulation fills the rest)")
    optimizer: Literal["adamw", "muon", "aurora"] = _f(
        "adamw", "matrix optimizer: adamw, or the orthogonalised update of Muon or of the authors' Aurora "
                 "(train.muon; attention, dense-MLP and expert matrices only, AdamW for the rest; docs/optimizer.md)")
    lr: float = _f(3e-4, "peak learning rate of matrix parameters under AdamW (muon/aurora: of the routers, "
                         "which stay on AdamW)")
    lr_non_matrix: float = _f(3e-4, "peak AdamW learning rate of norms, embeddings and other non-matrix parameters")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of the peak")
    warmup: int = _f(100, "learning-rate warmup steps")
    weight_decay: float = _f(0.05, "AdamW weight decay on matrices (muon/aurora: on the routers)")
    betas: list = _f([0.9, 0.95], "AdamW betas (every AdamW group, also under muon/aurora)")
    grad_clip: float = _f(1.0, "global gradient-norm clip (0: off; must be 0 with muon/aurora)")
    init_weights: Optional[str] = _f(None, "full-layout state dict (.pt) to start from instead of a "
                                          "random init; ignored when resuming from a checkpoint")
    deterministic: bool = _f(False, "deterministic kernels (torch.use_deterministic_algorithms): "
                                    "bit-exact resume and reruns on GPUs, at some speed; CPU runs "
                                    "are deterministic anyway")
    muon: MuonConfig = field(default_factory=MuonConfig)


@dataclass
class ZeroConfig:
    stage: int = _f(1, "DeepSpeed ZeRO stage for optimizer state: 1 or 2 (3 is refused with expert parallelism)")


@dataclass
class DataConfig:
    paths: list = _f([], "Megatron .bin/.idx prefixes, optionally weighted: [0.7, a, 0.3, b]")
    valid_paths: list = _f([], "held-out prefixes for validation (empty: split from `paths`)")
    split: str = _f("99,1,0", "train,valid,test split of `paths` when no `valid_paths`")
    tokenizer: Optional[str] = _f(None, "SentencePiece .model used to make the shards")
    mock: bool = _f(False, "megatron-core's mock dataset instead of files (smoke tests, benchmarks)")
    cache_dir: Optional[str] = _f(None, "index cache folder (default: <run.dir>/data_cache)")


@dataclass
class LogConfig:
    interval: int = _f(10, "steps between metric lines")
    tensorboard: bool = _f(True, "also write TensorBoard events to <run.dir>/tb")
    peak_tflops: Optional[float] = _f(None, "the device's dense bf16 peak (TFLOP/s per GPU) for MFU "
                                            "(null: looked up by GPU name for H100/H200/A100 and "
                                            "others; no MFU on the CPU)")


@dataclass
class CheckpointConfig:
    interval: int = _f(1000, "steps between checkpoints (one is always written at the end)")
    keep: int = _f(2, "checkpoints kept")


@dataclass
class EvalConfig:
    valid_every: int = _f(500, "steps between validation losses (0: only at the end)")
    valid_iters: int = _f(10, "micro-batches per validation")
    core_every: int = _f(0, "steps between quick CORE subsets (0: never during training)")
    core_max_per_task: int = _f(100, "examples per task in the quick CORE subset")
    core_bundle: Optional[str] = _f(None, "CORE bundle folder or .zip for the quick subset")


@dataclass
class RunConfig:
    dir: str = _f("runs/default", "run directory: checkpoints, metrics.jsonl, tb/")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: Literal["fp32", "bf16", "fp8"] = _f("fp32", "fp8 needs Transformer Engine on a GPU")
    train: TrainConfig = field(default_factory=TrainConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# --- loading --------------------------------------------------------------------------------

def _check(value, kind, key: str):
    """Return `value` as type `kind`, or raise a one-line ConfigError naming `key`."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(kind)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(value, inner, key)
    if origin is Literal:
        if value not in typing.get_args(kind):
            raise ConfigError(f"config: {key}: expected one of {list(typing.get_args(kind))}, got {value!r}")
        return value
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise ConfigError(f"config: {key}: expected a mapping, got {value!r}")
        return _build(kind, value, key + ".")
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config: {key}: expected true/false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config: {key}: expected an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config: {key}: expected a number, got {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"config: {key}: expected a string, got {value!r}")
        return value
    if kind is list:
        if not isinstance(value, list):
            raise ConfigError(f"config: {key}: expected a list, got {value!r}")
        return value
    raise TypeError(f"schema type {kind} of {key} not handled")


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"config: unknown key '{prefix}{key}' (expected one of: {', '.join(sorted(names))})")
    values = {k: _check(v, hints[k], prefix + k) for k, v in data.items()}
    return cls(**values)


def _merge(base: dict, key: str, value):
    parts = key.split(".")
    node = base
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config: --set {key}: '{part}' is not a section")
    node[parts[-1]] = value


def parse_overrides(items: list[str]) -> list[tuple[str, object]]:
    pairs = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"config: --set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        pairs.append((key.strip(), yaml.safe_load(raw) if raw != "" else None))
    return pairs


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_yaml(path: str | Path, _seen: tuple = ()) -> dict:
    """A config file's mapping, with its `extends:` chain resolved (not yet validated)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config: {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config: {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path}: expected a mapping at the top level")
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"config: {path}: extends: expected a file name, got {base!r}")
    base_path = (path.parent / base).resolve()
    if base_path in _seen:
        raise ConfigError(f"config: {path}: extends: {base} is already in the chain (a cycle)")
    return _deep_merge(read_yaml(base_path, _seen + (path.resolve(),)), data)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read a YAML config (or the defaults), apply `key=value` overrides, validate."""
    data = read_yaml(path) if path is not None else {}
    for key, value in parse_overrides(list(overrides)):
        _merge(data, key, value)
    cfg = _build(Config, data)
    validate(cfg)
    return cfg


def validate(cfg: Config):
    """Cross-field checks that need no process group."""
    m, moe, par = cfg.model, cfg.model.moe, cfg.parallel

    def need(ok, key, msg):
        if not ok:
            raise ConfigError(f"config: {key}: {msg}")

    for key, value in [("model.num_layers", m.num_layers), ("model.hidden_size", m.hidden_size),
                       ("model.num_attention_heads", m.num_attention_heads),
                       ("model.vocab_size", m.vocab_size), ("model.seq_length", m.seq_length),
                       ("parallel.tp", par.tp), ("parallel.ep", par.ep),
                       ("train.micro_batch", cfg.train.micro_batch),
                       ("train.global_batch", cfg.train.global_batch),
                       ("log.interval", cfg.log.interval), ("checkpoint.interval", cfg.checkpoint.interval),
                       ("checkpoint.keep", cfg.checkpoint.keep), ("eval.valid_iters", cfg.eval.valid_iters),
                       ("model.moe.num_experts", moe.num_experts), ("model.moe.topk", moe.topk)]:
        need(value > 0, key, f"must be positive, got {value}")
    if cfg.train.steps is not None:
        need(cfg.train.steps > 0, "train.steps", f"must be positive (or null for the token budget), got {cfg.train.steps}")
    for key, value in [("train.warmup", cfg.train.warmup), ("model.kappa.warmup", m.kappa.warmup),
                       ("eval.valid_every", cfg.eval.valid_every), ("eval.core_every", cfg.eval.core_every),
                       ("model.cross_entropy_chunk", m.cross_entropy_chunk),
                       ("train.lr", cfg.train.lr), ("train.lr_non_matrix", cfg.train.lr_non_matrix),
                       ("train.grad_clip", cfg.train.grad_clip), ("train.weight_decay", cfg.train.weight_decay)]:
        need(value >= 0, key, f"must not be negative, got {value}")
    need(not (cfg.data.mock and (cfg.data.paths or cfg.data.valid_paths)), "data.mock",
         "is true, but data.paths/valid_paths are set too: the mock dataset would silently replace "
         "them (set data.mock=false to train on the files)")
    need(m.head_dim is not None or m.hidden_size % m.num_attention_heads == 0, "model.hidden_size",
         f"{m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads}")
    if m.layout != "dense":
        need(1 <= moe.topk <= moe.num_experts, "model.moe.topk",
             f"must be in [1, num_experts={moe.num_experts}], got {moe.topk}")
        need(moe.num_experts % par.ep == 0, "parallel.ep",
             f"model.moe.num_experts={moe.num_experts} is not divisible by ep={par.ep}")
        if moe.router == "softmoe":
            _validate_softmoe(moe, need)
    if m.layout == "moe":
        need(0 <= m.first_dense < m.num_layers, "model.first_dense",
             f"must be in [0, num_layers) = [0, {m.num_layers}), got {m.first_dense}")
    if m.layout == "sandwich":
        need(m.num_layers >= 3, "model.num_layers", "a sandwich needs at least 3 layers")
    need(m.num_attention_heads % par.tp == 0, "parallel.tp",
         f"model.num_attention_heads={m.num_attention_heads} is not divisible by tp={par.tp}")
    groups = m.num_query_groups or m.num_attention_heads
    need(groups % par.tp == 0, "parallel.tp", f"query groups {groups} not divisible by tp={par.tp}")
    etp = par.expert_tp
    need(etp > 0, "parallel.etp", f"must be positive, got {etp}")
    need(par.timeout_s > 0, "parallel.timeout_s", f"must be positive, got {par.timeout_s}")
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    need(ffn % par.tp == 0, "parallel.tp", f"model.ffn_hidden_size={ffn} is not divisible by tp={par.tp}")
    need((moe.ffn_hidden_size or ffn) % etp == 0, "parallel.etp",
         f"expert ffn size {moe.ffn_hidden_size or ffn} is not divisible by etp={etp}")
    if m.layout != "dense" and moe.dispatcher == "sorted":
        need(par.ep == 1 and par.tp == 1 and etp == 1, "model.moe.dispatcher",
             f"sorted keeps every expert on one rank: needs parallel.ep, tp and etp of 1 "
             f"(got ep={par.ep}, tp={par.tp}, etp={etp}; use alltoall)")
        need(moe.capacity_factor is None and moe.router != "softmoe", "model.moe.dispatcher",
             "sorted needs exactly top-k experts per token: no capacity factor, no softmoe router")
    if m.layout != "dense" and moe.grouped_gemm:
        align = 4 if cfg.precision == "fp32" else 8  # grouped_mm wants 16-byte strides
        expert_ffn = (moe.ffn_hidden_size or ffn) // etp
        need(m.hidden_size % align == 0 and expert_ffn % align == 0, "model.moe.grouped_gemm",
             f"grouped GEMMs in {cfg.precision} need model.hidden_size ({m.hidden_size}) and the expert "
             f"ffn size / etp ({expert_ffn}) to be multiples of {align}; set model.moe.grouped_gemm: false")
    k = m.kappa
    need(k.U > 1.0, "model.kappa.U", f"must be > 1, got {k.U}")
    need(0.0 <= k.freeze_fraction < 1.0, "model.kappa.freeze_fraction", f"must be in [0, 1), got {k.freeze_fraction}")
    need(cfg.zero.stage in (1, 2), "zero.stage",
         "ZeRO-3 is not supported: DeepSpeed refuses ZeRO-3 with expert parallelism; use 1 or 2"
         if cfg.zero.stage == 3 else f"expected 1 or 2, got {cfg.zero.stage} (checkpoints of expert "
         "weights need ZeRO's per-rank fp32 partitions)")
    need(cfg.train.global_batch % cfg.train.micro_batch == 0, "train.global_batch",
         f"{cfg.train.global_batch} is not a multiple of train.micro_batch={cfg.train.micro_batch}")
    need(len(cfg.train.betas) == 2, "train.betas", f"expected two numbers, got {cfg.train.betas}")
    _validate_muon(cfg, need)


def _validate_muon(cfg: Config, need):
    mu = cfg.train.muon
    for key, value in [("lr", mu.lr), ("weight_decay", mu.weight_decay), ("aurora_exponent", mu.aurora_exponent)]:
        need(value >= 0, f"train.muon.{key}", f"must not be negative, got {value}")
    need(0 <= mu.momentum < 1, "train.muon.momentum", f"must be in [0, 1), got {mu.momentum}")
    need(mu.ns_steps >= 1, "train.muon.ns_steps", f"must be at least 1, got {mu.ns_steps}")
    need(mu.aurora_rounds >= 1, "train.muon.aurora_rounds", f"must be at least 1, got {mu.aurora_rounds}")
    need(mu.max_scale is None or mu.max_scale > 0, "train.muon.max_scale", f"must be positive, got {mu.max_scale}")
    # DeepSpeed's ZeRO replaces each gradient by its orthogonalised update before it computes the
    # norm and clips, so a clip would rescale the update itself (the authors do not clip).
    need(cfg.train.optimizer == "adamw" or cfg.train.grad_clip == 0, "train.grad_clip",
         f"must be 0 with train.optimizer={cfg.train.optimizer}: DeepSpeed's ZeRO would clip the "
         f"orthogonalised update, not the gradient (got {cfg.train.grad_clip})")


def _validate_softmoe(moe: MoEConfig, need):
    sm, E = moe.softmoe, moe.num_experts
    cap = sm.max_experts or E
    need(1 <= cap <= E, "model.moe.softmoe.max_experts", f"must be in [1, num_experts={E}], got {cap}")
    need(0 < moe.active_experts <= cap, "model.moe.softmoe.budget",
         f"must be in (0, max_experts={cap}], got {moe.active_experts}")
    need(sm.temperature > 0, "model.moe.softmoe.temperature", f"must be positive, got {sm.temperature}")
    need(0 <= sm.threshold < 1, "model.moe.softmoe.threshold", f"must be in [0, 1), got {sm.threshold}")
    need(moe.capacity_factor is None, "model.moe.capacity_factor",
         "must be null with the softmoe router (it runs a variable number of experts per token; "
         "model.moe.softmoe.max_experts caps it)")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def markdown_reference() -> str:
    """The config reference (docs/config.md), generated from the schema."""
    lines = ["# Configuration reference", "",
             "Generated by `python -m megatron_kappa.config --markdown` from `megatron_kappa/config.py`.",
             "Every key below can be set in the YAML file or with `--set key=value`. A file may begin",
             "with `extends: other.yaml` (relative to the file): the other file is the base and this",
             "file's keys are merged over it, section by section (`configs/paper.yaml` is the base of",
             "the paper configs).", ""]

    def walk(cls, prefix):
        rows = []
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(hint):
                walk(hint, prefix + f.name + ".")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append(f"| `{prefix}{f.name}` | `{yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()}` | {f.metadata.get('help', '')} |")
        if rows:
            lines.extend([f"## `{prefix.rstrip('.') or 'top level'}`", "", "| key | default | meaning |",
                          "|---|---|---|", *rows, ""])

    walk(Config, "")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        print(markdown_reference())
    else:
        print("usage: python -m megatron_kappa.config --markdown", file=sys.stderr)
        sys.exit(2)
