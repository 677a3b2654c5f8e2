"""The training job: config → model/parallel setup → data → train loop → checkpoints/metrics → eval.

`run(cfg)` is what `launch/pretrain.py` calls under any launcher, after the preflight has checked
every input. It resumes from the latest checkpoint in `run.dir` if there is one. On SIGUSR1 or
SIGTERM (once launch/pretrain.py has installed the handlers) every rank stops after the same
step, with a checkpoint there, by raising `Preempted` (megatron_kappa.train.preemption).

Host–device synchronisation: a step enqueues its work and moves on; numbers are read on the host
(`.item()`, `.tolist()`) only on logging and checkpoint steps, where the loss is also checked for
NaN — so a diverged step is never saved. The syncs that remain inside a step belong to
megatron-core's MoE dispatch and are listed in docs/benchmarks.md.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker, get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

from megatron_kappa import routers
from megatron_kappa.checkpoint import async_save, resume
from megatron_kappa.checkpoint.listing import CheckpointDir
from megatron_kappa.checkpoint.store import Checkpoints
from megatron_kappa.config import Config, ConfigError, TrainConfig, to_dict
from megatron_kappa.config.checks import profile_past_end
from megatron_kappa.data import coverage
from megatron_kappa.data.bestfit import cropped_report
from megatron_kappa.data.bos import documents_start_with_bos
from megatron_kappa.import_hf import weights as hf_import
from megatron_kappa.metrics import paper_analyses, throughput
from megatron_kappa.metrics.log import MetricsLog
from megatron_kappa.metrics.memory import peak_memory
from megatron_kappa.metrics.stats import kappa_stats, mtp_loss, router_losses
from megatron_kappa.metrics.step_line import done_line, step_line
from megatron_kappa.model import compile as model_compile
from megatron_kappa.model import fp8
from megatron_kappa.model.build import build_model
from megatron_kappa.model.experts import set_kappa_U
from megatron_kappa.model.layout import model_layout
from megatron_kappa.optim import muon, qk_clip, schedule
from megatron_kappa.optim import optimizer as optim
from megatron_kappa.parallel import context
from megatron_kappa.parallel import engine as ds_engine
from megatron_kappa.parallel.grads import install_tensor_parallel_grad_hooks
from megatron_kappa.parallel.groups import dp_mean, init_distributed, merge_stages
from megatron_kappa.parallel.layout import layout_record
from megatron_kappa.parallel.sharding import global_numel, load_full_state_dict, read_full_state_dict
from megatron_kappa.summary import count
from megatron_kappa.train import hf_exports, pipeline, recipe
from megatron_kappa.train.data import batch_at, build_datasets, train_first_sample
from megatron_kappa.train.divergence import BadSteps, TrainingDiverged  # TrainingDiverged: the loop's API
from megatron_kappa.train.preemption import Preempted, StopAgreement
from megatron_kappa.train.profiling import StepProfiler, region
from megatron_kappa.train.run_lock import RunLock


def full_count(model, cfg: Config) -> dict:
    """megatron_kappa.summary.count of the whole model, from this rank's shard and stage."""
    return count(model, cfg, numel=global_numel, combine=pipeline.stage_sum_counts)


def total_steps(cfg: Config, model) -> int:
    if cfg.train.steps is not None:
        return cfg.train.steps
    return full_count(model, cfg)["steps_for_budget"]


def lm_loss(model, batch, position_ids) -> torch.Tensor:
    """Mean next-token loss over the batch's unmasked tokens (a device scalar). The model computes
    the per-token loss: the chunked one of model.cross_entropy_chunk, or megatron's (build.py).
    With context parallelism the model sees this rank's chunks, and the result is this rank's
    share of the mean (megatron_kappa.parallel.context: `whole` adds the shares up)."""
    batch = context.split_batch({**batch, "position_ids": position_ids})
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return context.loss_share(per_token, batch["loss_mask"])


@torch.no_grad()
def validate(engine, valid_ds, cfg: Config, device, position_ids) -> torch.Tensor:
    """The mean loss of this rank's `eval.valid_iters` validation micro-batches, averaged over
    data-parallel ranks (through the stages' schedule, forward only, with pipeline stages)."""
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mb = cfg.train.micro_batch
    batches = [batch_at(valid_ds, (i * dp + dp_rank) * mb, mb, device) for i in range(cfg.eval.valid_iters)]
    engine.eval()
    if cfg.parallel.pp > 1:
        loss = pipeline.run_schedule(engine.module, batches, cfg, position_ids, forward_only=True)
    else:
        loss = torch.stack([context.whole(lm_loss(engine, batch, position_ids)) for batch in batches]).mean()
    engine.train()
    return dp_mean(loss)


def grad_accumulation(train: TrainConfig) -> int:
    """Micro-batches per optimizer step on each rank (divisibility: checked by the preflight)."""
    return train.global_batch // (train.micro_batch * ps.get_data_parallel_world_size())


def train_step(engine, model, cfg: Config, train_ds, step: int, device, position_ids):
    """One optimizer step over this rank's micro-batches. `engine` is DeepSpeed's (or anything
    with its forward/backward/step). Returns the step's loss averaged over data-parallel ranks and
    the last κ L2 penalty, as device tensors: nothing here waits for the device. With pipeline
    stages or the EP overlap: megatron_kappa.train.pipeline."""
    if cfg.parallel.megatron_schedule:
        return pipeline.train_step(engine, model, cfg, train_ds, step, device, position_ids,
                                   grad_accumulation(cfg.train))
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    l2_scale, cp = recipe.l2_scale(), context.backward_scale()
    losses = []
    for micro in range(grad_accumulation(cfg.train)):
        first = train_first_sample(step, micro, cfg.train, dp_rank, dp)
        batch = batch_at(train_ds, first, cfg.train.micro_batch, device)
        with region("forward"):
            loss = lm_loss(engine, batch, position_ids)
            l2 = recipe.kappa_l2(model, cfg.model.kappa, cfg.parallel, device)
        with region("backward"):
            engine.backward((loss * cp if cp > 1 else loss) + l2 * l2_scale)
        with region("optimizer"):  # DeepSpeed's: the update at the last micro-batch, else nothing
            engine.step()
        losses.append(context.whole(loss))
    return dp_mean(torch.stack(losses).mean()), l2


def discard_step_metrics():
    """Empty megatron's process-wide loss trackers (router losses, MTP) after a step that is not
    logged, so that a logged step reports its own losses only."""
    get_moe_metrics_tracker().clear()
    MTPLossLoggingHelper.clean_metrics_in_tracker()


def step_metrics(engine, model, cfg: Config, l2: torch.Tensor, device, histograms: dict | None = None) -> dict:
    """What a logging step records beyond the loss (collectives; numbers read on the host).
    `histograms`, when given, receives the κ samples and tokens per expert of this stage's MoE layers."""
    return {**router_losses(model.config, grad_accumulation(cfg.train), device),
            **(mtp_loss(grad_accumulation(cfg.train), device) if cfg.model.mtp.num_layers else {}),
            "kappa_l2": recipe.global_kappa_l2(l2).item(),
            "grad_norm": float(engine.get_global_grad_norm() or 0.0),
            **kappa_stats(model, device, histograms),
            **paper_analyses.analysis_stats(model, cfg.model, device, histograms=histograms),
            **routers.lookup(cfg.model.moe.router).step_metrics(model, device)}  # SoftMoE's budgets


def use_deterministic_kernels():
    """Same inputs, same bits on a GPU too: no atomics-based kernels, a fixed cuBLAS workspace."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read at the first cuBLAS call
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def run(cfg: Config, log=print) -> dict:
    """Train (or resume) the job described by `cfg`; returns the last metrics record."""
    if cfg.train.deterministic:
        use_deterministic_kernels()
    cfg.data.bos = documents_start_with_bos(cfg.data)  # recorded in config.yaml: CORE follows it
    # --- model and parallel setup
    layout = model_layout(cfg)  # which layers are MoE, the stages' layers, the padded vocabulary
    device = init_distributed(cfg.parallel, cfg.train.seed, layout.experts)
    rank = dist.get_rank()
    run_dir = Path(cfg.run.dir)
    listing = CheckpointDir(run_dir)
    # rank 0 reads the checkpoint's files against their checksums (a damaged one is skipped in one
    # line) and every rank resumes from its answer
    latest = [listing.latest() if rank == 0 else None]
    dist.broadcast_object_list(latest, src=0)
    latest = latest[0]
    if latest is not None:  # a resume that changes the model or optimizer state: refused before any write
        meta, where = listing.meta(latest), str(listing.folder(latest))
        resume.check_layout(meta, layout_record(cfg.parallel, dist.get_world_size()), to_dict(cfg), where)
        resume.check(meta.get("config"), to_dict(cfg), where)
        if note := resume.check_schedule(meta.get("config"), to_dict(cfg), where, latest):
            log(note)
    lock = hold_run_dir(run_dir, rank)  # one training per run.dir, for the run's life
    try:
        dist.barrier()
        return train(cfg, layout, device, log, latest or 0)
    finally:
        if lock is not None:
            lock.release()


def hold_run_dir(run_dir: Path, rank: int) -> RunLock | None:
    """Rank 0 takes run.dir's lock (megatron_kappa.train.run_lock); when another live run holds
    it, every rank raises the one-line refusal. Returns the lock on rank 0."""
    lock, error = None, [None]
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir)
        try:
            lock.acquire()
        except ConfigError as e:
            lock, error = None, [str(e)]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise ConfigError(error[0])
    return lock


def train(cfg: Config, layout, device, log, start: int) -> dict:
    """The run after its checks and with its run.dir held: model, optimizer, data, the loop, from
    step `start` (the checkpoint run() found, or 0)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp, grad_accum = ps.get_data_parallel_world_size(), grad_accumulation(cfg.train)
    run_dir = Path(cfg.run.dir)
    model = build_model(cfg, device, layout=layout)
    if cfg.precision == "fp8":
        log(fp8.describe(cfg.model.fp8, device))
    paper_analyses.watch_routers(model)  # the analyses read each router's last input on logging steps
    destroy_moe_metrics_tracker()  # a process-wide singleton, sized by the model that records first
    ckpts = Checkpoints(run_dir, cfg.checkpoint.keep)
    if cfg.train.init_weights and not start and os.path.isdir(cfg.train.init_weights):  # a Hugging Face folder
        hf_import.load_into(model, cfg, cfg.train.init_weights)
    elif cfg.train.init_weights and not start:
        load_full_state_dict(model, read_full_state_dict(cfg.train.init_weights, "config: train.init_weights"),
                             source=f"config: train.init_weights: {cfg.train.init_weights}")
    steps = total_steps(cfg, model)
    if cfg.train.steps is None and (past := profile_past_end(cfg.profile.steps, steps, "the token budget's steps")):
        raise ConfigError(f"config: profile.steps: {past}")  # (with train.steps set, config/checks.py said it)
    flops_token = throughput.flops_per_token(cfg.model, full_count(model, cfg))
    peak = throughput.peak_tflops(cfg.log, device)
    compiled = model_compile.apply(model, cfg.model.compile, device)  # before DeepSpeed wraps the model
    install_tensor_parallel_grad_hooks(model)
    freeze = recipe.KappaFreeze(model, steps, cfg.model.kappa)
    engine_settings = ds_engine.EngineSettings.of(cfg.train, cfg.zero, cfg.parallel, cfg.precision)
    engine, optimizer = ds_engine.initialize(model, optim.param_groups(model, cfg.train, cfg.model), engine_settings,
                                             grad_accum, lambda groups: optim.build_optimizer(groups, cfg.train))
    muon.check_zero_layout(optimizer)
    if start:
        written, now = ckpts.meta(start)["layout"], layout_record(cfg.parallel, world)
        ckpts.load(engine, model, start, device, same_layout=written == now)
        log(f"resumed from {ckpts.folder(start)}" + ("" if written == now else f" (written with {written}, now {now})"))
        if start >= steps:  # a finished run started again, or train.steps lowered below the checkpoint
            log(f"nothing to do: the checkpoint is at step {start} and the run has {steps} steps (train.steps)")
            return {}  # and no file changed: config.yaml and its history are written below
    if rank == 0:
        resume.record(run_dir, to_dict(cfg), start)  # config.yaml and the run's config history
    metrics = MetricsLog(run_dir, cfg.log.tensorboard, enabled=rank == 0, wandb=cfg.log.wandb, config=to_dict(cfg),
                         start=start, log=log)
    metrics.truncate_after(start)

    # --- data
    valid_samples = max(cfg.eval.valid_iters, 1) * cfg.train.micro_batch * dp
    train_ds, valid_ds = build_datasets(cfg, steps * cfg.train.global_batch, valid_samples)
    if cropped_report(train_ds):  # data.packing: bestfit discards tokens: say how many
        log(f"data: bestfit packing (14c9b04), every row of {cfg.model.seq_length + 1} tokens starts at BOS: "
            f"train {cropped_report(train_ds)}; valid {cropped_report(valid_ds)}")
    if (reads := coverage.passes(train_ds)) > 1:  # a corpus smaller than the run: its documents repeat
        log(f"warning: data: the run reads its training documents {reads:.2f} times (data.paths holds fewer "
            "tokens than steps × global_batch × seq_length; docs/data_prep.md names a sample of the size)")
    position_ids = torch.arange(cfg.model.seq_length, device=device).expand(cfg.train.micro_batch, -1)

    # --- the loop
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_length
    # the router losses' gradient scale (CP / micro-batches: with context parallelism each rank's
    # router losses are its tokens' share, like the LM loss); megatron's pipeline schedule sets it
    # again per micro-batch as a [1] tensor, copied into this one: the shape must be [1] there
    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # a fresh tensor of this run's shape
    MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,) if cfg.parallel.megatron_schedule else (),
                                                   context.backward_scale() / grad_accum, device=device))
    # the MTP loss's likewise (model.mtp); its process-wide tracker starts empty (an earlier model's
    # training forwards in this process would otherwise count in the first step's mtp_loss)
    MTPLossAutoScaler.set_loss_scale(torch.full((1,) if cfg.parallel.megatron_schedule else (), 1.0 / grad_accum,
                                                device=device))
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    core = None
    if cfg.eval.core_every:
        from megatron_kappa.evaluation.core_subset import CoreSubset
        core = CoreSubset(cfg, engine, device)
    saver = async_save.saver(ckpts, cfg.checkpoint, cfg.parallel.timeout_s, log,
                             hf_exports.for_run(ckpts, cfg.checkpoint, run_dir, log))
    stop = StopAgreement()  # SIGUSR1/SIGTERM: every rank stops after the same step (preemption.py)
    aux_weight = model.config.moe_aux_loss_coeff  # model.moe.aux_loss as megatron's coefficient
    after_step = routers.lookup(cfg.model.moe.router).after_step  # sigmoid: the expert bias
    record, window_start, window_steps = {}, time.perf_counter(), 0
    loop_start = window_start  # the step line's time and metrics.jsonl's elapsed_s: this start's
    profiler = StepProfiler(cfg.profile, run_dir, rank, device, log)
    saved = start  # the last checkpoint (a bad last step is not saved)
    bad_steps = BadSteps(cfg.train.nonfinite_steps, device, engine.skipped_steps)
    for step in range(start, steps):
        profiler.begin_step(step + 1)
        freeze.begin_step(step, optimizer)
        kappa_U = recipe.kappa_U(step, steps, cfg.model.kappa)  # the authors' U ramp (constant by default)
        set_kappa_U(model, kappa_U)
        if cfg.model.moe.aux_loss_warmup_steps:  # the authors' aux-loss anneal
            recipe.set_aux_loss_weight(model, aux_weight * recipe.aux_loss_scale(step, cfg.model.moe))
        lrs = schedule.set_learning_rates(optimizer, step, steps, cfg.train, cfg.model)
        step_loss, l2 = train_step(engine, model, cfg, train_ds, step, device, position_ids)
        # QK-Clip (train.qk_clip): the step's largest logits scale the query/key weights it just updated
        max_logit = qk_clip.clip(model) if cfg.train.qk_clip is not None else None
        bad_steps.observe(step_loss, engine.get_global_grad_norm(), engine.skipped_steps)
        if compiled is not None:  # Dynamo compiles at the first call: the start line after the first step
            log(model_compile.describe(compiled))
            compiled = None
        if after_step is not None:
            after_step(model, cfg.model.moe)
        done = step + 1
        window_steps += 1
        logging = done % cfg.log.interval == 0 or done == steps
        stopping = stop.poll() and done < steps  # every step, on every rank: same answer everywhere
        saving = done % cfg.checkpoint.interval == 0 or done == steps or stopping
        if not (logging or saving):
            discard_step_metrics()  # router and MTP losses are reduced only on logged steps
            continue
        loss_value = step_loss.item()  # the step's one host sync, on logging/checkpoint steps
        bad_now, bad_worst = bad_steps.read()
        if bad_steps.diverged(bad_worst):
            saver.finish()  # the save in flight (of a good step) is written first
            last = ckpts.latest(content=False)
            what = (f"loss is {loss_value}" if not math.isfinite(loss_value) else
                    f"non-finite gradients (or loss) in {bad_worst} step{'s' * (bad_worst > 1)} in a row")
            profiler.close()
            raise TrainingDiverged(f"step {done}: {what} (train.nonfinite_steps {cfg.train.nonfinite_steps}); "
                                   "stopped without saving"
                                   + (f", the last good checkpoint is {ckpts.folder(last)}" if last else ""))
        if saving and bad_now and bad_steps.limit:  # under the limit, but a bad step's weights are not kept
            log(f"warning: step {done}: not saved, its step had a non-finite loss or gradient norm")
            saving = False
        if logging:
            now = time.perf_counter()
            elapsed = now - window_start
            tokens_per_s = window_steps * tokens_per_step / elapsed
            histograms = {} if cfg.log.tensorboard else None  # every rank: the stages' merge is a collective
            record = {"step": done, "loss": loss_value, "lr": lrs["matrix"], "lr_kappa": lrs["kappa"],
                      "kappa_U": kappa_U,
                      "tokens_per_s": tokens_per_s, "tokens_seen": done * tokens_per_step,
                      **throughput.throughput(tokens_per_s, flops_token, world, peak),
                      **step_metrics(engine, model, cfg, l2, device, histograms), **peak_memory(device),
                      "time": time.time(), "elapsed_s": now - loop_start}
            if cfg.train.qk_clip is not None:  # before the clip, as megatron logs it
                record["max_attention_logit"] = qk_clip.world_max(max_logit, device)
            if cfg.eval.valid_every and (done % cfg.eval.valid_every == 0 or done == steps):
                record["valid_loss"] = validate(engine, valid_ds, cfg, device, position_ids).item()
                record["valid_tokens"] = (cfg.eval.valid_iters * cfg.train.micro_batch
                                          * ps.get_data_parallel_world_size() * cfg.model.seq_length)
            if core is not None and (done % cfg.eval.core_every == 0 or done == steps):
                record.update(core.evaluate())
            metrics.write(record)
            if histograms is not None:
                metrics.histograms(merge_stages(histograms), done)
            log(step_line(record, steps, device.type == "cuda", elapsed / window_steps))
            window_start, window_steps = time.perf_counter(), 0
        else:
            discard_step_metrics()
        if saving:
            saver.save(engine, model, done, {"layout": layout_record(cfg.parallel, world), "config": to_dict(cfg)},
                       device)
            saved = done
        if stopping:
            saver.finish(exports=False)
            profiler.close()
            metrics.close()
            raise Preempted(done, steps, stop.signum, ckpts.folder(done))
    saver.finish()
    profiler.close()
    stop.close()
    metrics.close()
    log(done_line(steps, steps, time.perf_counter() - loop_start, ckpts.folder(saved) if saved else None))
    return record
