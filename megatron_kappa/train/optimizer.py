"""The optimizer: the paper's parameter groups and the optimizer built from them.

Groups (each carries `kind`, which survives DeepSpeed's expert split of the groups and is what
megatron_kappa.train.recipe schedules by):
  matrix      2-D weights inside the transformer blocks: attention, MLPs, experts, and under
              adamw the routers too
  router      train.optimizer muon/aurora only: the routers, which stay on AdamW (train.lr)
  non_matrix  embeddings, the output layer, norms
  kappa       κ's α and b (own schedule, L2 penalty in the loss, no weight decay)
With muon or aurora the matrix group takes the orthogonalised update and everything else AdamW,
in one DeepSpeed MuonWithAuxAdam (megatron_kappa.train.muon).
"""
from __future__ import annotations

import torch

from megatron_kappa.config import Config
from megatron_kappa.model.params import is_embedding_or_output, is_kappa
from megatron_kappa.train import muon


def param_groups(model, cfg: Config) -> list[dict]:
    if cfg.train.optimizer != "adamw":
        return muon.param_groups(model, cfg)
    matrix, non_matrix, kappa = [], [], []
    for name, p in model.named_parameters():
        if is_kappa(name):
            kappa.append(p)
        elif p.dim() >= 2 and not is_embedding_or_output(name):
            matrix.append(p)
        else:
            non_matrix.append(p)
    return [dict(name="matrix", kind="matrix", params=matrix, weight_decay=cfg.train.weight_decay),
            dict(name="non_matrix", kind="non_matrix", params=non_matrix, weight_decay=0.0),
            dict(name="kappa", kind="kappa", params=kappa, weight_decay=0.0)]


def build_optimizer(param_groups: list[dict], cfg: Config) -> torch.optim.Optimizer:
    """torch's AdamW over the groups, or MuonWithAuxAdam for muon/aurora (DeepSpeed's ZeRO shards
    either one's state); learning rates are set per step by the recipe."""
    if cfg.train.optimizer != "adamw":
        return muon.build_optimizer(param_groups, cfg)
    muon.uninstall()  # a process that ran muon/aurora before gets DeepSpeed's own Muon back
    return torch.optim.AdamW(param_groups, lr=cfg.train.lr, betas=tuple(cfg.train.betas), eps=1e-8)
