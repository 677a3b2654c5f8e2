"""The learning-rate and weight-decay schedules of every optimizer group, and their peak values.

κ's α and b have their own schedule (`kappa_lr`, after the freeze of `kappa_start`); everything
else is peak × multiplier(step), with the peak per group `kind` (megatron_kappa.optim.groups):

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

from megatron_kappa.config import KappaConfig, ModelConfig, TrainConfig
from megatron_kappa.kappa import inputs as kappa_inputs

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


def lr_multiplier(step: int, total: int, train: TrainConfig) -> float:
    if train.lr_decay_style == "wsd":
        return wsd_multiplier(step, total, train.warmup, train.lr_wsd_decay_fraction, train.min_lr_ratio)
    return cosine_multiplier(step, total, train.warmup, train.min_lr_ratio)


def wd_multiplier(step: int, total: int, train: TrainConfig) -> float:
    """constant: 1; linear: 1 - step/total (the authors' get_weight_decay, 0 only past the end)."""
    return 1.0 - step / total if train.wd_decay_style == "linear" else 1.0


def batch_tokens_scale(train: TrainConfig, model: ModelConfig) -> float:
    """√(tokens per step / 2¹⁹): the authors' batch_lr_scale."""
    return math.sqrt(train.global_batch * model.seq_length / REFERENCE_BATCH_TOKENS)


def batch_scale(train: TrainConfig, model: ModelConfig) -> float:
    return batch_tokens_scale(train, model) if train.batch_lr_scaling else 1.0


def width_scale(train: TrainConfig, model: ModelConfig) -> float:
    return (model.hidden_size / REFERENCE_WIDTH) ** -0.5 if train.adamw_width_scaling else 1.0


def depth_scale(train: TrainConfig, model: ModelConfig) -> float:
    return (REFERENCE_DEPTH / model.num_layers) ** 2 if train.wd_depth_scaling else 1.0


def peak_lrs(train: TrainConfig, model: ModelConfig) -> dict:
    """The peak learning rate of every kind but kappa."""
    batch, width = batch_scale(train, model), width_scale(train, model)
    adamw = train.lr_non_matrix
    return {"matrix": (train.lr if train.optimizer == "adamw" else train.muon.lr) * batch,
            "router": train.lr * batch,
            "embedding": (adamw if train.lr_embedding is None else train.lr_embedding) * width * batch,
            "output": (adamw if train.lr_output is None else train.lr_output) * width * batch,
            "non_matrix": adamw * width * batch,
            # model.residual_scalars' λ: no width scaling (the authors' scalar_lr)
            "resid_lambda": train.lr_resid_scalar * batch, "x0_lambda": train.lr_x0_scalar * batch}


def peak_weight_decays(train: TrainConfig, model: ModelConfig) -> dict:
    """The weight decay of every kind at step 0 (before wd_multiplier)."""
    depth = depth_scale(train, model)
    return {"matrix": (train.weight_decay if train.optimizer == "adamw" else train.muon.weight_decay) * depth,
            "router": train.weight_decay * depth,
            "embedding": 0.0, "output": 0.0, "non_matrix": 0.0, "resid_lambda": 0.0, "x0_lambda": 0.0,
            "kappa": 0.0}


def main_values(step: int, total: int, train: TrainConfig, model: ModelConfig) -> tuple[dict, dict]:
    """(learning rate, weight decay) of every kind but kappa's learning rate, at `step`."""
    lr_m, wd_m = lr_multiplier(step, total, train), wd_multiplier(step, total, train)
    lrs = {kind: peak * lr_m for kind, peak in peak_lrs(train, model).items()}
    wds = {kind: wd * wd_m for kind, wd in peak_weight_decays(train, model).items()}
    return lrs, wds


# --- κ's α and b: the freeze and their own learning rate ---------------------------------------

def main_lr(step: int, peak: float, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to min_ratio · peak at the last step
    (train.lr_decay_style cosine; megatron_kappa.optim.schedule has every style)."""
    return peak * cosine_multiplier(step, total, warmup, min_ratio)


def unfreeze_step(total: int, freeze_fraction: float, min_steps: int = 0) -> int:
    """First step at which α and b train: floor(fraction · total), at least `min_steps`."""
    return max(int(min_steps), int(math.floor(freeze_fraction * total)))


# model.kappa.schedule "authors" (askerlee/kappa-swiglu, scripts/base_train.py): α, b start after
# max(--kappa-delay-start-min-iterations 200, ceil(total · --kappa-delay-start-iteration-frac 0.05)).
AUTHORS_FREEZE = (200, 0.05)


PAPER_FREEZE = (0, 0.1)


def kappa_start(total: int, kappa: KappaConfig) -> int:
    """First step at which α and b train, under model.kappa.schedule (null keys: its values)."""
    min_steps, fraction = AUTHORS_FREEZE if kappa.schedule == "authors" else PAPER_FREEZE
    fraction = fraction if kappa.freeze_fraction is None else kappa.freeze_fraction
    min_steps = min_steps if kappa.freeze_min_steps is None else kappa.freeze_min_steps
    if kappa.schedule == "authors":  # the authors round the fraction up
        return max(min_steps, math.ceil(total * fraction))
    return unfreeze_step(total, fraction, min_steps)


def kappa_lr(step: int, total: int, train: TrainConfig, model: ModelConfig) -> float:
    """κ's learning rate at `step`: 0 while frozen, then by model.kappa.schedule.

    paper: linear warmup to `lr` over `warmup` steps; linear decay to `lr_end` at the last step
    (0.12 over 1000 iterations, then down to 0.06).
    authors: lr × (hidden_size/768)^-½ × the main LR multiplier × a ramp that goes 0 → 1 over
    `warmup` steps, then linearly to lr_end/lr at the end (base_train.py get_linear_lr_scale and
    the κ group's base_lr · lrm · kappa_bias_lr_scale), so it reaches 0 with the main LR's decay.
    lr and lr_end are the input variant's when null (megatron_kappa.kappa.inputs); with
    model.kappa.batch_lr_scaling both schedules are × √(tokens per step / 2¹⁹).
    """
    k = model.kappa
    v = kappa_inputs.resolve(k)
    start = kappa_start(total, k)
    if step < start:
        return 0.0
    scale = batch_tokens_scale(train, model) if k.batch_lr_scaling else 1.0
    return _kappa_lr(step, total, start, v.lr, v.lr_end, train, model) * scale


def _kappa_lr(step: int, total: int, start: int, lr: float, lr_end: float, train: TrainConfig,
              model: ModelConfig) -> float:
    k = model.kappa
    if k.schedule == "authors":
        if lr == 0:
            return 0.0
        width = (model.hidden_size / REFERENCE_WIDTH) ** -0.5
        ramp = authors_kappa_ramp(step, total, start, k.warmup, lr_end / lr)
        return lr * width * lr_multiplier(step, total, train) * ramp
    i = step - start
    if i < k.warmup:
        return lr * (i + 1) / k.warmup
    decay_start, last = start + k.warmup - 1, total - 1
    if last <= decay_start:
        return lr
    return lr + (lr_end - lr) * (step - decay_start) / (last - decay_start)


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


def set_learning_rates(optimizer, step: int, total: int, train: TrainConfig, model: ModelConfig) -> dict:
    """Every group's learning rate and weight decay at `step` (megatron_kappa.optim.schedule;
    κ: kappa_lr). Returns the learning rates by kind."""
    lrs, wds = main_values(step, total, train, model)
    lrs["kappa"] = kappa_lr(step, total, train, model)
    for group in optimizer.param_groups:
        group["lr"] = lrs[group["kind"]]
        group["weight_decay"] = wds[group["kind"]]
    return lrs
