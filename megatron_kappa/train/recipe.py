"""What the paper's recipe does to κ's α and b during training: the freeze, the U ramp and the
κ L2 penalty.

It acts on κ's α and b (megatron_kappa.model.params.is_kappa) and on the optimizer's `kappa`
group; the learning rates of every group, κ's included, are megatron_kappa.optim.schedule's.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_kappa.config import KappaConfig, MoEConfig, ParallelConfig
from megatron_kappa.kappa import inputs as kappa_inputs
from megatron_kappa.model.params import is_kappa
from megatron_kappa.optim.schedule import kappa_start


def kappa_U(step: int, total: int, kappa: KappaConfig) -> float:
    """U at `step`. With u_warmup > 0 (the authors' variants), the authors' get_kappa_slope_max_scale:
    1 until α, b unfreeze, then linearly to U over ceil(u_warmup · total) steps, then U."""
    v = kappa_inputs.resolve(kappa)
    if v.u_warmup <= 0 or v.U == 1.0:
        return v.U
    delay = kappa_start(total, kappa)
    if step < delay:
        return 1.0
    ramp = math.ceil(max(total, 0) * min(v.u_warmup, 1.0))
    progress = min(max(step - delay, 0), ramp) / ramp
    return 1.0 + (v.U - 1.0) * progress


def l2_scale() -> float:
    """Each α/b entry lives on EDP ranks while the objective is averaged over DP ranks (with the
    context-parallel ones, as gradients are): scale the local penalty by DP / EDP (= EP · ETP / TP)
    so the global objective counts every entry once."""
    return ps.get_data_parallel_world_size(with_context_parallel=True) / ps.get_expert_data_parallel_world_size()


def kappa_l2(model, kappa: KappaConfig, parallel: ParallelConfig, device: torch.device) -> torch.Tensor:
    """This rank's share of the κ penalty (unscaled, see `l2_scale`), a scalar on `device`.

    l2_reduction "mean" (the authors' code, and the default): per MoE layer
    λ_α·mean(α²) + λ_b·mean(b²) over the layer's full [E, F] entries, summed over layers. A rank
    holds an [E/EP, F/ETP] shard, so its squares are divided by the full count E·F = numel·EP·ETP.
    "sum": λ_α Σα² + λ_b Σb² over every entry, as the paper's §3.4 is written; with E·F in the
    hundreds of thousands that is ~10⁵× stronger per entry and holds κ at 1 (docs/recipe.md).
    """
    l2_alpha = kappa_inputs.resolve(kappa).l2_alpha  # the input variant's when null
    shards = parallel.ep * parallel.expert_tp if kappa.l2_reduction == "mean" else None
    total = torch.zeros((), device=device)
    for name, p in model.named_parameters():
        if is_kappa(name):
            weight = l2_alpha if name.endswith("kappa_alpha") else kappa.l2_bias
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


def aux_loss_scale(step: int, moe: MoEConfig) -> float:
    """The aux-loss weight at `step` as a multiple of model.moe.aux_loss: aux_loss_warmup_scale, then
    linearly to 1 over aux_loss_warmup_steps (the authors' get_annealed_loss_weight: 2 → 1 over 500
    steps; 14c9b04 scripts/base_train.py 947-952, called at 1384-1389)."""
    if moe.aux_loss_warmup_steps <= 0:
        return 1.0
    done = min(max(step, 0), moe.aux_loss_warmup_steps) / moe.aux_loss_warmup_steps
    return moe.aux_loss_warmup_scale + (1.0 - moe.aux_loss_warmup_scale) * done


def set_aux_loss_weight(model, weight: float):
    """megatron-core's routers read config.moe_aux_loss_coeff at every forward, from the one
    TransformerConfig the whole model shares."""
    model.config.moe_aux_loss_coeff = weight


class KappaFreeze:
    """Holds α, b at exactly 0 until `kappa_start`, with no optimizer-state drift.

    While frozen, a gradient hook zeroes their gradients (so clipping never sees them) and their
    learning rate is 0: AdamW's moments stay exactly zero and α, b do not move, while AdamW counts
    its steps. model.kappa.freeze_optimizer_state says what happens at the unfreeze step: drop
    (their optimizer state is dropped, so AdamW starts them fresh, step 1, as if they had just been
    added) or keep (14c9b04: the step count goes on from the freeze's).

    α in the matrix group (model.kappa.alpha_optimizer matrix) has the matrices' learning rate
    while frozen, but its zeroed gradient keeps its momentum at zero, the orthogonalised update of
    a zero matrix is zero and decay leaves 0 at 0: α stays exactly 0, as at 14c9b04, where ln U = 0
    until the unfreeze makes α's gradient exactly zero. Its momentum is not the κ group's to drop.
    """

    def __init__(self, model, total: int, kappa: KappaConfig):
        self.start = kappa_start(total, kappa)
        self.drop_state = kappa.freeze_optimizer_state == "drop"
        self.frozen = True
        self.params = [p for n, p in model.named_parameters() if is_kappa(n)]
        for p in self.params:
            p.register_hook(lambda g: torch.zeros_like(g) if self.frozen else g)

    def begin_step(self, step: int, optimizer):
        self.frozen = step < self.start
        if step == self.start and self.start > 0 and self.drop_state:
            base = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the torch optimizer
            for group in base.param_groups:
                if group["kind"] == "kappa":
                    for p in group["params"]:
                        base.state.pop(p, None)
