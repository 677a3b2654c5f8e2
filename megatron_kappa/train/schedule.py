"""The main learning-rate and weight-decay schedules and each optimizer group's peak values.

κ's α and b have their own schedule (megatron_kappa.train.recipe.kappa_lr); everything else is
peak × multiplier(step), with the peak per group `kind` (megatron_kappa.train.optimizer):

  matrix      train.lr (adamw) or train.muon.lr (muon/aurora)          × batch scale
  router      train.lr (muon/aurora with train.router_optimizer adamw)   × batch scale
  embedding   train.lr_embedding (null: lr_non_matrix)   × width scale × batch scale
  output      train.lr_output (null: lr_non_matrix)      × width scale × batch scale
  non_matrix  train.lr_non_matrix                         × width scale × batch scale

  batch scale  √(global_batch · seq_length / 2¹⁹)   (train.batch_lr_scaling; the authors tuned at 2¹⁹)
  width scale  (hidden_size / 768)^-½               (train.adamw_width_scaling; tuned at d = 768)

Weight decay acts on the matrix and router groups only: train.weight_decay (adamw, routers) or
train.muon.weight_decay, × (12 / num_layers)² with train.wd_depth_scaling, × its multiplier.
The authors' code (askerlee/kappa-swiglu 02b8de3, scripts/base_train.py) is the source of every
formula here; docs/recipe.md lists the lines.
"""
from __future__ import annotations

import math

from megatron_kappa.config import Config

REFERENCE_BATCH_TOKENS = 2 ** 19  # base_train.py: reference_batch_size
REFERENCE_WIDTH = 768  # gpt.py setup_optimizer: dmodel_lr_scale = (model_dim / 768) ** -0.5
REFERENCE_DEPTH = 12  # base_train.py: weight_decay * (12 / depth) ** 2


def cosine_multiplier(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to min_ratio at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(total - 1 - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def wsd_multiplier(step: int, total: int, warmup: int, decay_fraction: float, min_ratio: float) -> float:
    """Warmup-stable-decay as the authors' get_lr_multiplier (warmup in steps here): linear warmup,
    1 until total - D, then linear towards min_ratio, D = round(decay_fraction · total)."""
    decay = round(decay_fraction * total)
    if step < warmup:
        return (step + 1) / warmup
    if step <= total - decay:
        return 1.0
    progress = (total - step) / decay  # 1 → 1/D at the last step, as the authors'
    return progress + (1 - progress) * min_ratio


def lr_multiplier(step: int, total: int, cfg: Config) -> float:
    t = cfg.train
    if t.lr_decay_style == "wsd":
        return wsd_multiplier(step, total, t.warmup, t.lr_wsd_decay_fraction, t.min_lr_ratio)
    return cosine_multiplier(step, total, t.warmup, t.min_lr_ratio)


def wd_multiplier(step: int, total: int, cfg: Config) -> float:
    """constant: 1; linear: 1 - step/total (the authors' get_weight_decay, 0 only past the end)."""
    return 1.0 - step / total if cfg.train.wd_decay_style == "linear" else 1.0


def batch_scale(cfg: Config) -> float:
    if not cfg.train.batch_lr_scaling:
        return 1.0
    return math.sqrt(cfg.train.global_batch * cfg.model.seq_length / REFERENCE_BATCH_TOKENS)


def width_scale(cfg: Config) -> float:
    return (cfg.model.hidden_size / REFERENCE_WIDTH) ** -0.5 if cfg.train.adamw_width_scaling else 1.0


def depth_scale(cfg: Config) -> float:
    return (REFERENCE_DEPTH / cfg.model.num_layers) ** 2 if cfg.train.wd_depth_scaling else 1.0


def peak_lrs(cfg: Config) -> dict:
    """The peak learning rate of every kind but kappa."""
    t = cfg.train
    batch, width = batch_scale(cfg), width_scale(cfg)
    adamw = t.lr_non_matrix
    return {"matrix": (t.lr if t.optimizer == "adamw" else t.muon.lr) * batch,
            "router": t.lr * batch,
            "embedding": (adamw if t.lr_embedding is None else t.lr_embedding) * width * batch,
            "output": (adamw if t.lr_output is None else t.lr_output) * width * batch,
            "non_matrix": adamw * width * batch}


def peak_weight_decays(cfg: Config) -> dict:
    """The weight decay of every kind at step 0 (before wd_multiplier)."""
    t = cfg.train
    depth = depth_scale(cfg)
    return {"matrix": (t.weight_decay if t.optimizer == "adamw" else t.muon.weight_decay) * depth,
            "router": t.weight_decay * depth,
            "embedding": 0.0, "output": 0.0, "non_matrix": 0.0, "kappa": 0.0}


def main_values(step: int, total: int, cfg: Config) -> tuple[dict, dict]:
    """(learning rate, weight decay) of every kind but kappa's learning rate, at `step`."""
    lr_m, wd_m = lr_multiplier(step, total, cfg), wd_multiplier(step, total, cfg)
    lrs = {kind: peak * lr_m for kind, peak in peak_lrs(cfg).items()}
    wds = {kind: wd * wd_m for kind, wd in peak_weight_decays(cfg).items()}
    return lrs, wds
