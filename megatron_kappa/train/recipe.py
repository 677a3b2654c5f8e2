"""The paper's training recipe: learning-rate schedules, the κ freeze and the κ L2 penalty.

It acts on the optimizer's parameter groups by their `kind` (matrix, router, embedding, output,
non_matrix, kappa; built by megatron_kappa.train.optimizer) and on κ's α and b, found by
megatron_kappa.model.params.is_kappa.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_kappa.config import Config
from megatron_kappa.kappa import inputs as kappa_inputs
from megatron_kappa.model.params import is_kappa
from megatron_kappa.train import schedule


def main_lr(step: int, peak: float, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to min_ratio · peak at the last step
    (train.lr_decay_style cosine; megatron_kappa.train.schedule has every style)."""
    return peak * schedule.cosine_multiplier(step, total, warmup, min_ratio)


def unfreeze_step(total: int, freeze_fraction: float, min_steps: int = 0) -> int:
    """First step at which α and b train: floor(fraction · total), at least `min_steps`."""
    return max(int(min_steps), int(math.floor(freeze_fraction * total)))


# model.kappa.schedule "authors" (askerlee/kappa-swiglu, scripts/base_train.py): α, b start after
# max(--kappa-delay-start-min-iterations 200, ceil(total · --kappa-delay-start-iteration-frac 0.05)).
AUTHORS_FREEZE = (200, 0.05)
PAPER_FREEZE = (0, 0.1)


def kappa_start(total: int, cfg: Config) -> int:
    """First step at which α and b train, under model.kappa.schedule (null keys: its values)."""
    k = cfg.model.kappa
    min_steps, fraction = AUTHORS_FREEZE if k.schedule == "authors" else PAPER_FREEZE
    fraction = fraction if k.freeze_fraction is None else k.freeze_fraction
    min_steps = min_steps if k.freeze_min_steps is None else k.freeze_min_steps
    if k.schedule == "authors":  # the authors round the fraction up
        return max(min_steps, math.ceil(total * fraction))
    return unfreeze_step(total, fraction, min_steps)


def kappa_lr(step: int, total: int, cfg: Config) -> float:
    """κ's learning rate at `step`: 0 while frozen, then by model.kappa.schedule.

    paper: linear warmup to `lr` over `warmup` steps; linear decay to `lr_end` at the last step
    (0.12 over 1000 iterations, then down to 0.06).
    authors: lr × (hidden_size/768)^-½ × the main LR multiplier × a ramp that goes 0 → 1 over
    `warmup` steps, then linearly to lr_end/lr at the end (base_train.py get_linear_lr_scale and
    the κ group's base_lr · lrm · kappa_bias_lr_scale), so it reaches 0 with the main LR's decay.
    """
    k = cfg.model.kappa
    start = kappa_start(total, cfg)
    if step < start:
        return 0.0
    if k.schedule == "authors":
        if k.lr == 0:
            return 0.0
        width = (cfg.model.hidden_size / schedule.REFERENCE_WIDTH) ** -0.5
        ramp = authors_kappa_ramp(step, total, start, k.warmup, k.lr_end / k.lr)
        return k.lr * width * schedule.lr_multiplier(step, total, cfg) * ramp
    i = step - start
    if i < k.warmup:
        return k.lr * (i + 1) / k.warmup
    decay_start, last = start + k.warmup - 1, total - 1
    if last <= decay_start:
        return k.lr
    return k.lr + (k.lr_end - k.lr) * (step - decay_start) / (last - decay_start)


def authors_kappa_ramp(step: int, total: int, start: int, warmup: int, end_scale: float) -> float:
    """The authors' get_linear_lr_scale with max_scale 1, line for line: 0 before `start`, then
    (step − start) / warmup, then linearly from 1 towards end_scale over the remaining steps."""
    total = max(0, total)
    start = min(max(0, start), total)
    warmup = min(max(0, warmup), max(0, total - start))
    step = min(max(step, 0), total)
    if step < start:
        return 0.0
    i = step - start
    if warmup > 0 and i < warmup:
        return i / warmup
    remaining = total - start - warmup
    if remaining <= 0:
        return 1.0
    progress = min(max(i - warmup, 0), remaining) / remaining
    return 1.0 + (end_scale - 1.0) * progress


def kappa_U(step: int, total: int, cfg: Config) -> float:
    """U at `step`. With u_warmup > 0 (the authors' variants), the authors' get_kappa_slope_max_scale:
    1 until α, b unfreeze, then linearly to U over ceil(u_warmup · total) steps, then U."""
    v = kappa_inputs.resolve(cfg.model.kappa)
    if v.u_warmup <= 0 or v.U == 1.0:
        return v.U
    delay = kappa_start(total, cfg)
    if step < delay:
        return 1.0
    ramp = math.ceil(max(total, 0) * min(v.u_warmup, 1.0))
    progress = min(max(step - delay, 0), ramp) / ramp
    return 1.0 + (v.U - 1.0) * progress


def set_learning_rates(optimizer, step: int, total: int, cfg: Config) -> dict:
    """Every group's learning rate and weight decay at `step` (megatron_kappa.train.schedule;
    κ: kappa_lr). Returns the learning rates by kind."""
    lrs, wds = schedule.main_values(step, total, cfg)
    lrs["kappa"] = kappa_lr(step, total, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lrs[group["kind"]]
        group["weight_decay"] = wds[group["kind"]]
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
        self.start = kappa_start(total, cfg)
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
