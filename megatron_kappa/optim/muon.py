"""Muon and Aurora under DeepSpeed's ZeRO-1/2: which parameters, which matrices, the optimizer,
and the library patch they need (docs/optimizer.md; fp32 gradient accumulation has its own,
megatron_kappa.parallel.grad_precision).

How DeepSpeed 0.19.8 runs Muon (runtime/zero/stage_1_and_2.py): at the gradient-accumulation
boundary ZeRO calls `original_muon.muon_update(grad, momentum, beta, ns_method=...,
is_expert_group=..., num_heads=param.muon_num_heads)` for every parameter tagged `use_muon` in a
`use_muon` group of a MuonWithAuxAdam, on the parameter's FULL reduced gradient (ranks whose
partitions share a parameter all receive it whole), and puts the result where the gradient was.
MuonWithAuxAdam.step then applies W ← W·(1 - lr·wd) - lr·update to the fp32 partition and runs
torch's AdamW on the other groups. The momentum is a flat buffer per group in the ZeRO optimizer's
state: sharded by parameter ownership, saved and restored with ZeRO's checkpoints.

The patch. DeepSpeed has no hook for another orthogonalisation (Aurora), splits a matrix only
into equal row blocks (not GQA's Q, K, V), ignores the group's Newton–Schulz steps and Nesterov
setting, and runs in half precision on a GPU. `install` replaces `muon_update` in the two modules
that hold it (PATCHED) by `update_fn(train)`: fp32, Muon or Aurora, our matrix blocks, the
configured steps. ZeRO imports the name from
original_muon at each call, so replacing the module attribute is enough. It is applied only when
train.optimizer is muon or aurora (build_optimizer) and undone for adamw;
tests/test_optimizers.py checks in a fresh interpreter that the names and the keywords we rely on
still exist upstream.

Blocks. `muon_num_heads` is the one per-parameter value ZeRO hands to muon_update. DeepSpeed means
an int (equal row blocks); we store a RowBlocks there (`matrix_blocks`), which update_fn reads.
ZeRO passes it only when no parameter is padded for alignment (`parameter_alignment`, never set
here); check_zero_layout refuses a padded layout rather than silently dropping the blocks.

Sharded matrices are orthogonalised blockwise: each TP (ETP for experts) shard on its own, as
DeepSpeed's and Megatron's "blockwise" modes do. A column-parallel QKV shard holds whole query
groups, so its Q, K and V rows are three matrices; a SwiGLU fc1 shard [gate_t; up_t] is two; a
row-parallel shard [out, in/t] is one. With TP = ETP = 1 these are exactly the authors' matrices
(separate q, k, v, gate, up, down); experts are whole on their EP rank, one matrix per expert.
κ's α (model.kappa.alpha_optimizer matrix) is one [E, F] matrix per layer at 14c9b04, across the
experts; a rank holds [E/EP, F/ETP] of it, and its blocks spec (megatron_kappa.optim.sharded_alpha)
all-gathers the shard's momentum direction over the EP × ETP group and orthogonalises the whole
matrix, as one process does, at any EP and ETP.
"""
from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING

import torch

from megatron_kappa.config import KappaConfig, ModelConfig, TrainConfig
from megatron_kappa.model.params import is_embedding_or_output, is_kappa_alpha, is_router
from megatron_kappa.optim import sharded_alpha
from megatron_kappa.optim.groups import ADAMW_KINDS, adamw_groups, adamw_kind, in_kappa_group
from megatron_kappa.optim.matrix import RowBlocks, as_blocks, orthogonalize
from megatron_kappa.optim.schedule import peak_weight_decays

if TYPE_CHECKING:  # megatron's config class, for the annotation only: this module imports without megatron
    from megatron.core.transformer.transformer_config import TransformerConfig

# (module, attribute) replaced by install().
PATCHED = [("deepspeed.runtime.zero.muon.original_muon", "muon_update"),
           ("deepspeed.runtime.zero.muon.muon_optimizer", "muon_update")]
# Keywords ZeRO passes that carry meaning for us (num_heads: our blocks).
UPSTREAM_KEYWORDS = ("grad", "momentum", "beta", "num_heads")
# ZeRO-1/2 code that must import muon_update when called (so the patch reaches it) and pass
# `muon_num_heads` on.
CALL_SITES = [("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer._get_flat_partition_unpadded")]

_originals: dict = {}


def is_orthogonalised(name: str, p: torch.Tensor, routers: bool, kappa: KappaConfig) -> bool:
    """Attention, dense-MLP and expert weight matrices, the routers if `routers`
    (train.router_optimizer matrix, as the authors' code), and κ's α with
    model.kappa.alpha_optimizer matrix (14c9b04: one [E, F] matrix per layer; `matrix_blocks`
    makes it whole across its shards). AdamW keeps embeddings, the output layer, norms, κ's b
    (and α), and otherwise the routers (the paper's split)."""
    return p.dim() >= 2 and not (is_embedding_or_output(name) or in_kappa_group(name, kappa)
                                 or (is_router(name) and not routers))


def matrix_blocks(name: str, param: torch.Tensor, config: TransformerConfig):
    """The separate matrices inside this rank's (possibly TP-sharded) parameter, as a RowBlocks,
    or None when it is one matrix (per leading index, for stacked experts). `config` is
    megatron's TransformerConfig (model.config)."""
    if is_kappa_alpha(name):  # one matrix across the experts and their EP/ETP shards
        return sharded_alpha.blocks()
    rows = param.shape[-2]
    if name.endswith("linear_qkv.weight"):
        kv = config.kv_channels
        q_per_group = config.num_attention_heads // (config.num_query_groups or config.num_attention_heads)
        group_rows = (q_per_group + 2) * kv
        return RowBlocks(rows // group_rows, (q_per_group * kv, kv, kv))
    if config.gated_linear_unit and name.endswith(("linear_fc1.weight", "experts.fc1_weight")):
        return RowBlocks(1, (rows // 2, rows // 2))  # [gate; up] on every rank
    return None


def param_groups(model, train: TrainConfig, m: ModelConfig) -> list[dict]:
    """The groups of MuonWithAuxAdam, every parameter tagged (`use_muon`, `muon_num_heads`):
    megatron's names do not follow DeepSpeed's "embed"/"lm_head" convention, so nothing is
    left to DeepSpeed's guess."""
    groups = {kind: [] for kind in ("matrix", "router", *ADAMW_KINDS, "kappa")}
    routers = train.router_optimizer == "matrix"
    for name, p in model.named_parameters():
        p.use_muon = is_orthogonalised(name, p, routers, m.kappa)
        p.muon_num_heads = matrix_blocks(name, p, model.config) if p.use_muon else None
        kind = ("kappa" if in_kappa_group(name, m.kappa) else "matrix" if p.use_muon
                else "router" if is_router(name) and p.dim() >= 2 else adamw_kind(name))
        groups[kind].append(p)
    mu, wd = train.muon, peak_weight_decays(train, m)
    adamw = dict(use_muon=False, lr=0.0, betas=tuple(train.betas), eps=train.adam_eps)  # lr: set per step (recipe)
    return [dict(name="matrix", kind="matrix", params=groups["matrix"], use_muon=True, lr=0.0,
                 momentum=mu.momentum, weight_decay=wd["matrix"], ns_method="standard"),
            dict(name="router", kind="router", params=groups["router"], weight_decay=wd["router"], **adamw),
            *[{**adamw, **g} for g in adamw_groups(groups, train)]]  # a group's own betas win


def update_fn(train: TrainConfig, compute_dtype: torch.dtype = torch.float32):
    """The replacement for DeepSpeed's muon_update (0.19.8 call signature): `beta` comes from the
    group's `momentum`; Nesterov, the Newton–Schulz steps and Aurora's settings from the config
    (DeepSpeed's ns_method is ignored). Non-finite gradients leave the momentum as it was and
    pass through, so that a loss scaler still sees the overflow (as DeepSpeed's does)."""
    mu = train.muon
    options = dict(method=train.optimizer, ns_steps=mu.ns_steps, scale_mode=mu.scale,
                   max_scale=mu.max_scale, rounds=mu.aurora_rounds, exponent=mu.aurora_exponent,
                   compute_dtype=compute_dtype)

    def muon_update(grad, momentum, beta=0.95, ns_steps=None, nesterov=None, ns_method=None,
                    is_expert_group=False, num_heads=None, **_):
        # the new momentum out of place (one pass, where a clone and an in-place lerp were two),
        # kept only if the step is finite
        buf = momentum.lerp(grad.to(momentum.dtype), 1 - beta)
        x = grad.to(buf.dtype).lerp(buf, beta) if mu.nesterov else buf
        direction = orthogonalize(x, blocks=as_blocks(num_heads), **options)
        # One check, on the device (no synchronisation), as the authors check once: the direction
        # is finite exactly when the gradient is (the momentum is finite; a non-finite entry turns
        # its whole Newton–Schulz block non-finite through the norm), and a matrix gathered over
        # ranks (sharded_alpha) is non-finite on every rank if one rank's shard is, so every rank
        # keeps its momentum, as one process does.
        finite = torch.isfinite(direction).all()
        torch.where(finite, buf, momentum, out=momentum)
        return torch.where(finite, direction.to(grad.dtype), grad)
    return muon_update


def _modules():
    return [importlib.import_module(module) for module, _ in PATCHED]


def install(fn) -> None:
    """Make DeepSpeed's Muon paths call `fn` (process-wide; the originals are kept)."""
    for (module, attr), mod in zip(PATCHED, _modules()):
        _originals.setdefault(module, getattr(mod, attr))
        setattr(mod, attr, fn)


def uninstall() -> None:
    if not _originals:
        return  # never installed: leave DeepSpeed's Muon module unimported
    for (module, attr), mod in zip(PATCHED, _modules()):
        if module in _originals:
            setattr(mod, attr, _originals.pop(module))


def missing_upstream() -> list[str]:
    """What install() relies on that this DeepSpeed lacks (run it before install)."""
    missing = []
    for module, attr in PATCHED:
        fn = getattr(importlib.import_module(module), attr, None)
        if fn is None:
            missing.append(f"{module}.{attr}")
            continue
        params = inspect.signature(inspect.unwrap(fn)).parameters
        missing += [f"{module}.{attr}({kw}=)" for kw in UPSTREAM_KEYWORDS if kw not in params]
    for module, attr in CALL_SITES:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part, None)
        source = inspect.getsource(obj) if obj is not None else ""
        for needed in ("from deepspeed.runtime.zero.muon.original_muon import muon_update", "muon_num_heads"):
            if needed not in source:
                missing.append(f"{module}.{attr}: {needed}")
    return missing


def build_optimizer(groups: list[dict], train: TrainConfig):
    """DeepSpeed's MuonWithAuxAdam over the groups, with torch's AdamW for the AdamW groups (the
    same AdamW the adamw setting uses), and the update function installed."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    install(update_fn(train))
    return MuonWithAuxAdam(groups, adam_optimizer=torch.optim.AdamW, adam_optimizer_kwargs={})


def check_zero_layout(zero_optimizer) -> None:
    """ZeRO passes `muon_num_heads` (our blocks) only on its unpadded path."""
    base = getattr(zero_optimizer, "optimizer", None)
    if base is None or "muon" not in type(base).__name__.lower():
        return
    padded = [i for i, pads in enumerate(getattr(zero_optimizer, "round_robin_bit16_padding", []))
              if any(pads) and base.param_groups[i].get("use_muon")]
    if padded:
        raise RuntimeError(f"ZeRO padded the Muon parameter groups {padded} for alignment; on that "
                           "path DeepSpeed drops muon_num_heads and the matrix blocks with it")
