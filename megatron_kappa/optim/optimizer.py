"""The optimizer: the paper's parameter groups and the optimizer built from them.

Groups (each carries `kind`, which survives DeepSpeed's expert split of the groups and is what
megatron_kappa.train.recipe schedules by; megatron_kappa.optim.schedule has each kind's peak):
  matrix      2-D weights inside the transformer blocks: attention, MLPs, experts, and the
              routers (under adamw, or with train.router_optimizer matrix)
  router      muon/aurora with train.router_optimizer adamw: the routers on AdamW (train.lr)
  embedding   the input embedding (AdamW, train.lr_embedding)
  output      the output layer (AdamW, train.lr_output)
  non_matrix  norms and other 1-D parameters (AdamW, train.lr_non_matrix)
  resid_lambda, x0_lambda  model.residual_scalars' λ (AdamW, train.lr_resid_scalar, train.lr_x0_scalar;
              λ_x0 with train.x0_betas)
  kappa       κ's b, and α unless model.kappa.alpha_optimizer is matrix (then α is in matrix, as
              14c9b04 has it: groups.in_kappa_group); own schedule, L2 penalty in the loss, no weight decay
With muon or aurora the matrix group takes the orthogonalised update and everything else AdamW,
in one DeepSpeed MuonWithAuxAdam (megatron_kappa.optim.muon).
"""
from __future__ import annotations

import torch

from megatron_kappa.config import ModelConfig, TrainConfig
from megatron_kappa.model.params import is_embedding_or_output
from megatron_kappa.optim import muon, schedule
from megatron_kappa.optim.groups import ADAMW_KINDS, adamw_groups, adamw_kind, in_kappa_group


def param_groups(model, train: TrainConfig, m: ModelConfig) -> list[dict]:
    """The groups of `model` (the torch module; `m` its config, for the weight decay's depth scaling)."""
    if train.optimizer != "adamw":
        return muon.param_groups(model, train, m)
    by_kind = {kind: [] for kind in ("matrix", *ADAMW_KINDS, "kappa")}
    for name, p in model.named_parameters():
        if in_kappa_group(name, m.kappa):
            by_kind["kappa"].append(p)
        elif p.dim() >= 2 and not is_embedding_or_output(name):
            by_kind["matrix"].append(p)
        else:
            by_kind[adamw_kind(name)].append(p)
    wd = schedule.peak_weight_decays(train, m)["matrix"]
    return [dict(name="matrix", kind="matrix", params=by_kind["matrix"], weight_decay=wd),
            *adamw_groups(by_kind, train)]


def build_optimizer(param_groups: list[dict], train: TrainConfig) -> torch.optim.Optimizer:
    """torch's AdamW over the groups, or MuonWithAuxAdam for muon/aurora (DeepSpeed's ZeRO shards
    either one's state); learning rates are set per step by the recipe."""
    if train.optimizer != "adamw":
        return muon.build_optimizer(param_groups, train)
    muon.uninstall()  # a process that ran muon/aurora before gets DeepSpeed's own Muon back
    return torch.optim.AdamW(param_groups, lr=train.lr, betas=tuple(train.betas), eps=train.adam_eps)


def describe_groups(model, train: TrainConfig, m: ModelConfig, kappa_peak: float) -> list[dict]:
    """Each parameter group as `python -m megatron_kappa.optim` lists it: which
    tensors (names with layer numbers collapsed to *), the optimizer, the peak learning rate and
    the weight decay at step 0 (the schedules in megatron_kappa.optim.schedule scale both)."""
    import re
    names = {id(p): name for name, p in model.named_parameters()}
    peaks = {**schedule.peak_lrs(train, m), "kappa": kappa_peak}
    rows = []
    for g in param_groups(model, train, m):
        if not g["params"]:
            continue
        patterns = sorted({re.sub(r"\.\d+\.", ".*.", names[id(p)]) for p in g["params"]})
        row = dict(group=g["name"], optimizer=train.optimizer if g.get("use_muon") else "adamw",
                   tensors=len(g["params"]), params=sum(p.numel() for p in g["params"]),
                   lr=peaks[g["kind"]], weight_decay=g["weight_decay"], names=patterns)
        if g.get("use_muon"):
            row["momentum"] = g["momentum"]
        else:
            row.update(betas=list(g.get("betas", train.betas)), eps=train.adam_eps)
        rows.append(row)
    return rows
