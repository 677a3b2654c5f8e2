"""The paper's training recipe: learning-rate schedules, the κ freeze and the κ L2 penalty.

It acts on the optimizer's parameter groups by their `kind` (matrix, router, non_matrix, kappa; built by
megatron_kappa.train.optimizer) and on κ's α and b, found by megatron_kappa.model.params.is_kappa.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_kappa.config import Config
from megatron_kappa.model.params import is_kappa


def main_lr(step: int, peak: float, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to min_ratio · peak at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(total - 1 - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def unfreeze_step(total: int, freeze_fraction: float) -> int:
    """First step at which α and b train."""
    return int(math.floor(freeze_fraction * total))


def kappa_lr(step: int, total: int, cfg: Config) -> float:
    """0 while frozen; linear warmup to `lr` over `warmup` steps; linear decay to `lr_end` at the
    last step (paper: 0.12 over 1000 iterations, then down to 0.06)."""
    k = cfg.model.kappa
    start = unfreeze_step(total, k.freeze_fraction)
    if step < start:
        return 0.0
    i = step - start
    if i < k.warmup:
        return k.lr * (i + 1) / k.warmup
    decay_start, last = start + k.warmup - 1, total - 1
    if last <= decay_start:
        return k.lr
    return k.lr + (k.lr_end - k.lr) * (step - decay_start) / (last - decay_start)


def set_learning_rates(optimizer, step: int, total: int, cfg: Config) -> dict:
    t = cfg.train
    matrix_peak = t.lr if t.optimizer == "adamw" else t.muon.lr  # muon/aurora: routers keep t.lr
    lrs = {"matrix": main_lr(step, matrix_peak, total, t.warmup, t.min_lr_ratio),
           "router": main_lr(step, t.lr, total, t.warmup, t.min_lr_ratio),
           "non_matrix": main_lr(step, t.lr_non_matrix, total, t.warmup, t.min_lr_ratio),
           "kappa": kappa_lr(step, total, cfg)}
    for group in optimizer.param_groups:
        group["lr"] = lrs[group["kind"]]
    return lrs


def l2_scale() -> float:
    """Each α/b entry lives on EDP ranks while the objective is averaged over DP ranks: scale the
    local penalty by DP / EDP (= EP · ETP / TP) so the global objective counts every entry once."""
    return ps.get_data_parallel_world_size() / ps.get_expert_data_parallel_world_size()


def kappa_l2(model, cfg: Config, device: torch.device) -> torch.Tensor:
    """This rank's share of the κ penalty (unscaled, see `l2_scale`), a scalar on `device`.

    l2_reduction "mean" (the authors' code, and the default): per MoE layer
    λ_α·mean(α²) + λ_b·mean(b²) over the layer's full [E, F] entries, summed over layers. A rank
    holds an [E/EP, F/ETP] shard, so its squares are divided by the full count E·F = numel·EP·ETP.
    "sum": λ_α Σα² + λ_b Σb² over every entry, as the paper's §3.4 is written; with E·F in the
    hundreds of thousands that is ~10⁵× stronger per entry and holds κ at 1 (docs/recipe.md).
    """
    k = cfg.model.kappa
    shards = cfg.parallel.ep * cfg.parallel.expert_tp if k.l2_reduction == "mean" else None
    total = torch.zeros((), device=device)
    for name, p in model.named_parameters():
        if is_kappa(name):
            weight = k.l2_alpha if name.endswith("kappa_alpha") else k.l2_bias
            squares = p.float().pow(2).sum()
            if shards is not None:
                squares = squares / (p.numel() * shards)
            total = total + weight * squares
    return total


def global_kappa_l2(local: torch.Tensor) -> torch.Tensor:
    """The penalty over all experts, each entry counted once (for logging; a tensor, no sync)."""
    value = local.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= ps.get_expert_data_parallel_world_size()  # ranks holding each entry
    return value


class KappaFreeze:
    """Holds α, b at exactly 0 until `unfreeze_step`, with no optimizer-state drift.

    While frozen, a gradient hook zeroes their gradients (so clipping never sees them) and their
    learning rate is 0; at the unfreeze step their optimizer state is dropped, so AdamW starts
    them fresh (step 1, zero moments) as if they had just been added.
    """

    def __init__(self, model, total: int, cfg: Config):
        self.start = unfreeze_step(total, cfg.model.kappa.freeze_fraction)
        self.frozen = True
        self.params = [p for n, p in model.named_parameters() if is_kappa(n)]
        for p in self.params:
            p.register_hook(lambda g: torch.zeros_like(g) if self.frozen else g)

    def begin_step(self, step: int, optimizer):
        self.frozen = step < self.start
        if step == self.start and self.start > 0:
            base = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the torch optimizer
            for group in base.param_groups:
                if group["kind"] == "kappa":
                    for p in group["params"]:
                        base.state.pop(p, None)
