"""The training job: config → model/parallel setup → data → train loop → checkpoints/metrics → eval.

`run(cfg)` is what `launch/pretrain.py` calls under any launcher. It resumes from the latest
checkpoint in `run.dir` if there is one.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_kappa import deepspeed_setup, optim
from megatron_kappa.checkpoint import Checkpoints, rng_state, set_rng_state
from megatron_kappa.config import Config, ConfigError, to_dict
from megatron_kappa.data import batch_at, build_datasets, check_data, train_first_sample
from megatron_kappa.grads import install_tensor_parallel_grad_hooks, update_expert_bias
from megatron_kappa.metrics import MetricsLog, kappa_stats, router_losses
from megatron_kappa.model import build_model, moe_layer_pattern
from megatron_kappa.parallel import init_distributed
from megatron_kappa.sharding import global_numel, load_full_state_dict, rank_coords
from megatron_kappa.summary import count


class TrainingDiverged(RuntimeError):
    pass


def layout(cfg: Config) -> dict:
    return {"world": dist.get_world_size(), "tp": cfg.parallel.tp, "ep": cfg.parallel.ep,
            "etp": cfg.parallel.etp or cfg.parallel.tp}


def total_steps(cfg: Config, model) -> int:
    if cfg.train.steps is not None:
        return cfg.train.steps
    return count(model, cfg, numel=global_numel)["steps_for_budget"]


def lm_loss(engine, batch) -> torch.Tensor:
    tokens = batch["tokens"]
    position = torch.arange(tokens.shape[1]).expand_as(tokens)
    per_token = engine(tokens, position, None, labels=batch["labels"])
    mask = batch["loss_mask"]
    return (per_token.float() * mask).sum() / mask.sum().clamp_min(1.0)


def dp_mean(value: torch.Tensor) -> float:
    value = value.detach().clone().float()
    group = ps.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
        value /= dist.get_world_size(group)
    return value.item()


@torch.no_grad()
def validate(engine, valid_ds, cfg: Config) -> float:
    engine.eval()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mb = cfg.train.micro_batch
    losses = [lm_loss(engine, batch_at(valid_ds, (i * dp + dp_rank) * mb, mb))
              for i in range(cfg.eval.valid_iters)]
    engine.train()
    return dp_mean(torch.stack(losses).mean())


def run(cfg: Config, log=print) -> dict:
    """Train (or resume) the job described by `cfg`; returns the last metrics record."""
    check_data(cfg)  # before any process group: missing or corrupt shards fail in seconds
    deepspeed_setup.avoid_jit_ops()
    num_experts = cfg.model.moe.num_experts if any(moe_layer_pattern(cfg)) else None
    init_distributed(cfg.parallel, cfg.train.seed, num_experts)
    rank, dp, dp_rank = dist.get_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_step = cfg.train.micro_batch * dp
    if cfg.train.global_batch % per_step:
        raise ConfigError(f"config: train.global_batch: {cfg.train.global_batch} is not a multiple of "
                          f"micro_batch × data-parallel size = {cfg.train.micro_batch} × {dp}")
    grad_accum = cfg.train.global_batch // per_step
    run_dir = Path(cfg.run.dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    dist.barrier()

    model = build_model(cfg)
    ckpts = Checkpoints(run_dir, cfg.checkpoint.keep)
    start = ckpts.latest() or 0
    if cfg.train.init_weights and not start:
        load_full_state_dict(model, torch.load(cfg.train.init_weights, weights_only=True))
    steps = total_steps(cfg, model)
    install_tensor_parallel_grad_hooks(model)
    freeze = optim.KappaFreeze(model, steps, cfg)
    engine, optimizer = deepspeed_setup.initialize(model, optim.param_groups(model, cfg), cfg, grad_accum)

    if start:
        saved = ckpts.meta(start)["layout"]
        if saved != layout(cfg):
            raise ConfigError(f"config: parallel: checkpoint {ckpts.root}/step_{start} was written with "
                              f"{saved}, this run is {layout(cfg)} (changing the layout needs conversion)")
        set_rng_state(ckpts.load(engine, start)["rng"])
        log(f"resumed from {ckpts.root}/step_{start}")
    metrics = MetricsLog(run_dir, cfg.log.tensorboard, enabled=rank == 0)
    metrics.truncate_after(start)

    valid_samples = max(cfg.eval.valid_iters, 1) * per_step
    train_ds, valid_ds = build_datasets(cfg, steps * cfg.train.global_batch, valid_samples)
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_length
    l2_scale = optim.l2_scale()
    core = CoreSubset(cfg, engine) if cfg.eval.core_every else None
    record, window_start, window_steps = {}, time.perf_counter(), 0
    for step in range(start, steps):
        freeze.begin_step(step, optimizer)
        lrs = optim.set_learning_rates(optimizer, step, steps, cfg)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / grad_accum))
        losses = []
        for micro in range(grad_accum):
            batch = batch_at(train_ds, train_first_sample(step, micro, cfg, dp_rank, dp), cfg.train.micro_batch)
            loss = lm_loss(engine, batch)
            l2 = optim.kappa_l2(model, cfg)
            engine.backward(loss + l2 * l2_scale)
            engine.step()
            losses.append(loss.detach())
        loss = dp_mean(torch.stack(losses).mean())
        if not math.isfinite(loss):
            raise TrainingDiverged(f"step {step + 1}: loss is {loss}; stopped without saving, the last "
                                   f"good checkpoint is {ckpts.root}/step_{ckpts.latest()}"
                                   if ckpts.latest() else f"step {step + 1}: loss is {loss}; stopped")
        if cfg.model.moe.router == "sigmoid":
            update_expert_bias(model, cfg.model.moe.bias_update_rate)
        done = step + 1
        window_steps += 1
        if done % cfg.log.interval and done != steps:
            get_moe_metrics_tracker().clear()  # router losses are reduced only on logged steps
        else:
            routers = router_losses(model.config, grad_accum, ps.get_data_parallel_group())
            elapsed = time.perf_counter() - window_start
            record = {"step": done, "loss": loss, **routers, "kappa_l2": optim.global_kappa_l2(l2),
                      "lr": lrs["matrix"], "lr_kappa": lrs["kappa"],
                      "grad_norm": float(engine.get_global_grad_norm() or 0.0),
                      "tokens_per_s": window_steps * tokens_per_step / elapsed,
                      "tokens_seen": done * tokens_per_step, **kappa_stats(model)}
            if cfg.eval.valid_every and (done % cfg.eval.valid_every == 0 or done == steps):
                record["valid_loss"] = validate(engine, valid_ds, cfg)
            if core is not None and (done % cfg.eval.core_every == 0 or done == steps):
                record.update(core.evaluate())
            metrics.write(record)
            log(f"step {done}/{steps} loss {loss:.4f} lr {lrs['matrix']:.2e} grad_norm "
                f"{record['grad_norm']:.3f} tokens/s {record['tokens_per_s']:.0f}"
                + (f" valid {record['valid_loss']:.4f}" if "valid_loss" in record else ""))
            window_start, window_steps = time.perf_counter(), 0
        if done % cfg.checkpoint.interval == 0 or done == steps:
            ckpts.save(engine, done, {"layout": layout(cfg), "config": to_dict(cfg)},
                       {"rng": rng_state(), "model": model.state_dict(), "coords": rank_coords(model)})
    metrics.close()
    return record


class CoreSubset:
    """The quick CORE subset the paper's pipeline logged during training."""

    def __init__(self, cfg: Config, engine):
        from megatron_kappa.core_eval import load_bundle
        from megatron_kappa.inference import logits_fn_for
        from megatron_kappa.tokenizer import Tokenizer

        if not cfg.eval.core_bundle or not cfg.data.tokenizer:
            raise ConfigError("config: eval.core_every: needs eval.core_bundle and data.tokenizer")
        self.cfg, self.engine = cfg, engine
        self.bundle = load_bundle(cfg.eval.core_bundle)
        self.tokenizer = Tokenizer(cfg.data.tokenizer)
        self.logits_fn = logits_fn_for(engine.module)

    def evaluate(self) -> dict:
        from megatron_kappa.core_eval import core_metrics, evaluate_core

        self.engine.eval()
        with torch.no_grad():
            result = evaluate_core(self.logits_fn, self.tokenizer, self.bundle, self.cfg.model.seq_length,
                                   max_per_task=self.cfg.eval.core_max_per_task, progress=False,
                                   dp_rank=ps.get_data_parallel_rank(),
                                   dp_world=ps.get_data_parallel_world_size())
        self.engine.train()
        return core_metrics(result)
