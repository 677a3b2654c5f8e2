"""Cross-field checks of a config that need no process group, files or packages.

Checks that need more than the config (files, world size, installed packages) are in
megatron_kappa.preflight; both run before any process group or model exists.
"""
from __future__ import annotations

import math

from megatron_kappa import attention_kinds, routers
from megatron_kappa.config import ranges, stage_layout
from megatron_kappa.config import recompute as selective
from megatron_kappa.config.schema import Config, ConfigError, EvalConfig, ModelConfig, ParallelConfig, TrainConfig
from megatron_kappa.kappa import DEFAULTS as KAPPA
from megatron_kappa.kappa import inputs as kappa_inputs


def validate(cfg: Config):
    """Cross-field checks that need no process group."""
    m, moe, par = cfg.model, cfg.model.moe, cfg.parallel

    def need(ok, key, msg):
        if not ok:
            raise ConfigError(f"config: {key}: {msg}")

    ranges.check(cfg, need)  # every number inside its declared range (config/ranges.py)
    # the registered routers now (megatron_kappa.routers.register may add some at run time)
    need(moe.router in routers.ROUTERS, "model.moe.router",
         f"expected one of {routers.names()}, got {moe.router!r}")
    router = routers.lookup(moe.router)
    need(not (cfg.data.mock and (cfg.data.paths or cfg.data.valid_paths)), "data.mock",
         "is true, but data.paths/valid_paths are set too: the mock dataset would silently replace "
         "them (set data.mock=false to train on the files)")
    need(m.head_dim is not None or m.hidden_size % m.num_attention_heads == 0, "model.hidden_size",
         f"{m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads}")
    if m.layout != "dense":
        need(1 <= moe.topk <= moe.num_experts, "model.moe.topk",
             f"must be in [1, num_experts={moe.num_experts}], got {moe.topk}")
        need(moe.num_experts % par.ep == 0, "parallel.ep",
             f"model.moe.num_experts={moe.num_experts} is not divisible by ep={par.ep}")
        if router.validate is not None:  # the router's own rules (SoftMoE: model.moe.softmoe)
            router.validate(moe, need)
        _validate_groups(moe, router, need)
        authors_losses = [key for key, value, default in (
            ("aux_loss_form", moe.aux_loss_form, "megatron"), ("aux_loss_warmup_steps", moe.aux_loss_warmup_steps, 0),
            ("z_loss_form", moe.z_loss_form, "megatron"), ("z_loss_input_grad_scale", moe.z_loss_input_grad_scale, 1.0))
            if value != default]
        need(router.topk or not authors_losses, f"model.moe.{authors_losses[0] if authors_losses else ''}",
             f"sets the top-k routers' losses; the {moe.router} router has its own (keep the default)")
    _validate_block(m, par, need)
    _validate_recompute(cfg.model, need)
    if m.layout == "moe":
        need(0 <= m.first_dense < m.num_layers, "model.first_dense",
             f"must be in [0, num_layers) = [0, {m.num_layers}), got {m.first_dense}")
    if m.layout == "sandwich":
        need(m.num_layers >= 3, "model.num_layers", "a sandwich needs at least 3 layers")
    need(m.num_attention_heads % par.tp == 0, "parallel.tp",
         f"model.num_attention_heads={m.num_attention_heads} is not divisible by tp={par.tp}")
    groups = m.num_query_groups or m.num_attention_heads
    need(groups % par.tp == 0, "parallel.tp", f"query groups {groups} not divisible by tp={par.tp}")
    attention_kinds.check(m, par, need)  # the kind named, and its own rules (MLA: model.mla)
    if m.mtp.num_layers:
        for key in ("value_embeddings", "residual_scalars", "embedding_norm"):
            need(not getattr(m, key), f"model.{key}",
                 "must be false with model.mtp.num_layers (megatron's MTP layers are built without the nanochat "
                 "block's inputs)")
    etp = par.expert_tp
    _validate_stage_split(m.num_layers, par, need, m.mtp.num_layers)
    shared = moe.shared_ffn_hidden_size
    need(shared is None or (shared > 0 and shared % par.tp == 0), "model.moe.shared_ffn_hidden_size",
         f"must be positive and divisible by tp={par.tp} (or null: no shared expert), got {shared}")
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    need(ffn % par.tp == 0, "parallel.tp", f"model.ffn_hidden_size={ffn} is not divisible by tp={par.tp}")
    need((moe.ffn_hidden_size or ffn) % etp == 0, "parallel.etp",
         f"expert ffn size {moe.ffn_hidden_size or ffn} is not divisible by etp={etp}")
    if m.layout != "dense" and moe.dispatcher == "sorted":
        need(par.ep == 1 and par.tp == 1 and etp == 1, "model.moe.dispatcher",
             f"sorted keeps every expert on one rank: needs parallel.ep, tp and etp of 1 "
             f"(got ep={par.ep}, tp={par.tp}, etp={etp}; use alltoall)")
        need(moe.capacity_factor is None and router.topk, "model.moe.dispatcher",
             "sorted needs exactly top-k experts per token: no capacity factor, no "
             f"{' or '.join(routers.names(lambda r: not r.topk))} router")
    if m.layout != "dense" and moe.grouped_gemm:
        align = 4 if cfg.precision == "fp32" else 8  # grouped_mm wants 16-byte strides
        expert_ffn = (moe.ffn_hidden_size or ffn) // etp
        need(m.hidden_size % align == 0 and expert_ffn % align == 0, "model.moe.grouped_gemm",
             f"grouped GEMMs in {cfg.precision} need model.hidden_size ({m.hidden_size}) and the expert "
             f"ffn size / etp ({expert_ffn}) to be multiples of {align}; set model.moe.grouped_gemm: false")
    _validate_kappa(m.kappa, need)
    need(cfg.zero.stage in (1, 2), "zero.stage",
         "ZeRO-3 is not supported: DeepSpeed refuses ZeRO-3 with expert parallelism; use 1 or 2"
         if cfg.zero.stage == 3 else f"expected 1 or 2, got {cfg.zero.stage} (checkpoints of expert "
         "weights need ZeRO's per-rank fp32 partitions)")
    if par.pp > 1:
        _validate_pipeline(cfg, router, need)
    if par.cp > 1:
        _validate_context(m, par, cfg.eval, router, need)
    if par.overlap_moe_expert_parallel_comm or par.delay_wgrad_compute:
        _validate_ep_overlap(cfg, router, need)
    need(cfg.train.global_batch % cfg.train.micro_batch == 0, "train.global_batch",
         f"{cfg.train.global_batch} is not a multiple of train.micro_batch={cfg.train.micro_batch}")
    for key in ("betas", "x0_betas"):
        betas = getattr(cfg.train, key)
        need(len(betas) == 2 and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                     for b in betas),
             f"train.{key}", f"expected two numbers in [0, 1), got {betas}")
    if (moe.capacity, moe.drop_order) != ("megatron", "probs") and m.layout != "dense":
        key = "model.moe.capacity" if moe.capacity != "megatron" else "model.moe.drop_order"
        need(router.capacity and moe.dispatcher != "sorted" and
             (moe.capacity_factor is not None or cfg.eval.capacity_factor is not None), key,
             "a capacity rule needs model.moe.capacity_factor or eval.capacity_factor, a router that "
             "drops tokens and not the sorted dispatcher")
    if cfg.eval.capacity_factor is not None and m.layout != "dense":
        need(router.capacity and moe.dispatcher != "sorted", "eval.capacity_factor",
             f"must be null with the {' or '.join(routers.names(lambda r: not r.capacity))} router or the "
             "sorted dispatcher (they drop no tokens)")
    _validate_muon(cfg.train, need)
    _validate_qk_clip(m, cfg.train, need)
    if cfg.precision == "fp8":
        _validate_fp8(m, par, cfg.train, need)
    _validate_profile(cfg.profile, need)
    if cfg.train.steps is not None:  # else the token budget's steps: checked by the trainer (profile_past_end)
        past = profile_past_end(cfg.profile.steps, cfg.train.steps, "train.steps")
        need(not past, "profile.steps", past)
    ckpt = cfg.checkpoint
    need(ckpt.hf_every % ckpt.interval == 0, "checkpoint.hf_every",
         f"{ckpt.hf_every} is not a multiple of checkpoint.interval ({ckpt.interval}): only checkpoints are "
         f"exported, so the exports would come every {math.lcm(ckpt.hf_every, ckpt.interval)} steps")


def profile_past_end(window: list[int], steps: int, source: str) -> str | None:
    """What is wrong with profile.steps `window` for a run of `steps` steps (named by `source`):
    a window that starts after the last step traces nothing; None when it is fine."""
    if window and window[0] > steps:
        return f"{window} starts after the run's last step ({source}={steps}): nothing would be traced"
    return None


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate_profile(p, need):
    """profile.steps: [] or [first, last] (step-line numbers); profile.ranks: global ranks (the
    world size is the preflight's to compare)."""
    need(p.steps == [] or (len(p.steps) == 2 and all(_whole(s) for s in p.steps) and 1 <= p.steps[0] <= p.steps[1]),
         "profile.steps", f"expected [] or [first, last] with 1 <= first <= last, got {p.steps}")
    need(all(_whole(r) and r >= 0 for r in p.ranks), "profile.ranks",
         f"expected a list of global ranks (integers >= 0), got {p.ranks}")


def _validate_stage_split(layers: int, par, need, mtp_layers: int = 0):
    """parallel.pp with first_stage_layers / last_stage_layers, or parallel.layout: megatron's split
    must add up."""
    first, last = par.first_stage_layers, par.last_stage_layers
    if par.layout is not None:
        need(par.pp > 1, "parallel.layout", "needs parallel.pp > 1")
        need(first is None and last is None, "parallel.layout",
             "set with parallel.first_stage_layers / last_stage_layers: use one or the other")
        stage_layout.check(par.layout, par.pp, layers, mtp_layers, need, par.vpp)
        return
    if par.vpp > 1:
        need(par.pp > 1, "parallel.vpp", f"{par.vpp} needs parallel.pp > 1 (virtual stages interleave pipeline stages)")
        need(first is None and last is None, "parallel.vpp",
             f"{par.vpp} with parallel.first_stage_layers / last_stage_layers: give uneven chunks as parallel.layout")
        chunks = par.pp * par.vpp
        need(layers % chunks == 0, "parallel.vpp",
             f"model.num_layers={layers} is not divisible by pp × vpp = {chunks} model chunks "
             "(or give parallel.layout)")
        return
    if first is None and last is None:
        need(layers % par.pp == 0, "parallel.pp",
             f"model.num_layers={layers} is not divisible by pp={par.pp} (the stages split the layers evenly; "
             "parallel.first_stage_layers / last_stage_layers make them uneven)")
        return
    key = "parallel.first_stage_layers" if first is not None else "parallel.last_stage_layers"
    need(par.pp > 1, key, "needs parallel.pp > 1")
    middle_stages = par.pp - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    need(middle_stages >= 0 and rest >= 0, key, f"more stages or layers than model.num_layers={layers} and "
         f"parallel.pp={par.pp} have")
    need((rest == 0) if middle_stages == 0 else (rest > 0 and rest % middle_stages == 0), key,
         f"the {rest} layers left for the {middle_stages} other stage(s) do not split evenly "
         f"(model.num_layers={layers}, parallel.pp={par.pp})")


def _validate_groups(moe, router, need):
    """model.moe.num_groups / group_topk (group-limited routing) and seq_aux_loss."""
    grouped = moe.num_groups is not None or moe.group_topk is not None
    if grouped:
        need(moe.num_groups is not None and moe.group_topk is not None, "model.moe.group_topk",
             "set model.moe.num_groups and group_topk together (or neither)")
        need(router.topk, "model.moe.num_groups", f"group-limited routing needs a top-k router, not {moe.router}")
        need(moe.num_experts % moe.num_groups == 0, "model.moe.num_groups",
             f"must divide model.moe.num_experts={moe.num_experts}, got {moe.num_groups}")
        need(moe.group_topk <= moe.num_groups and moe.topk % moe.group_topk == 0, "model.moe.group_topk",
             f"must be at most num_groups={moe.num_groups} and divide model.moe.topk={moe.topk}, got {moe.group_topk}")
        need(moe.topk // moe.group_topk <= moe.num_experts // moe.num_groups, "model.moe.group_topk",
             f"a group is scored by its best topk / group_topk = {moe.topk // moe.group_topk} experts, more than "
             f"the {moe.num_experts // moe.num_groups} it has")
    need(moe.seq_aux_loss == 0 or router.seq_aux_loss, "model.moe.seq_aux_loss",
         f"is for the {' or '.join(routers.names(lambda r: r.seq_aux_loss))} router (beside its aux-free bias); "
         f"the {moe.router} router balances with model.moe.aux_loss")


FP8_ALIGN = 16  # FP8 GEMMs (torch._scaled_mm, _scaled_grouped_mm) want every width a multiple of 16


def fp8_gemm_widths(m: ModelConfig, par: ParallelConfig, t: TrainConfig) -> dict[str, int]:
    """The width of each GEMM dimension that runs in FP8 on one rank, by the key that sets it."""
    f = m.fp8
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    widths = {"model.hidden_size": m.hidden_size,
              # the weight-gradient GEMMs reduce over the tokens of a micro-batch
              "model.seq_length × train.micro_batch": m.seq_length * t.micro_batch}
    if f.attention:  # the attention kind's projections (megatron_kappa.attention_kinds)
        kind = attention_kinds.of(m)
        if kind.fp8_widths is None:
            raise ConfigError(f"config: model.fp8.attention: the {attention_kinds.name_of(m)} attention kind names no "
                              "FP8 GEMM widths (its registry entry's fp8_widths)")
        widths.update(kind.fp8_widths(m, par.tp))
    if f.dense_mlp:
        widths["model.ffn_hidden_size / tp"] = ffn // par.tp
    if f.experts and m.layout != "dense":
        etp = par.expert_tp
        widths["model.moe.ffn_hidden_size / etp"] = (m.moe.ffn_hidden_size or ffn) // etp
    return widths


def fp8_capability_error(capability: tuple[int, int]) -> str | None:
    """Why a CUDA device of this compute capability cannot run the FP8 GEMMs (None: it can)."""
    if tuple(capability) < (9, 0):
        return (f"config: precision: fp8 needs a GPU of compute capability 9.0 or more (Hopper) for "
                f"torchao's FP8 GEMMs; this one is {capability[0]}.{capability[1]} (use bf16)")
    return None


def _validate_fp8(m: ModelConfig, par: ParallelConfig, t: TrainConfig, need):
    f = m.fp8
    need(f.backend == "torchao", "model.fp8.backend",
         "te is not supported: Transformer Engine does not import without CUDA, cannot be carried to "
         "the GPU machine, and without it megatron-core's fp8 flag silently stays bf16 (use torchao)")
    if m.layout != "dense" and f.experts:
        need(m.moe.grouped_gemm, "model.fp8.experts",
             "FP8 experts need model.moe.grouped_gemm: true (torchao's FP8 grouped GEMM; megatron's "
             "per-expert loop has no FP8 path here), or set model.fp8.experts: false")
    for key, width in fp8_gemm_widths(m, par, t).items():
        need(width % FP8_ALIGN == 0, "precision", f"fp8 needs {key} divisible by {FP8_ALIGN}, got {width} "
             "(or turn that GEMM off in model.fp8)")


def _validate_kappa(k, need):
    # the registered variants now (megatron_kappa.kappa.inputs.register may add some at run time)
    variants = kappa_inputs.VARIANTS
    need(k.input in variants, "model.kappa.input", f"expected one of {list(variants)}, got {k.input!r}")
    if not variants[k.input].config_scales:  # the variant fixes them
        free = " or ".join(name for name, v in variants.items() if v.config_scales)
        for key, value in (("logit_scale", k.logit_scale), ("tanh_gain", k.tanh_gain)):
            default = getattr(KAPPA, key)
            need(value == default, f"model.kappa.{key}",
                 f"must stay {default} with model.kappa.input={k.input}, which sets its own (got {value}; "
                 f"use input {free} to choose logit_scale and tanh_gain freely)")


def _validate_muon(t: TrainConfig, need):
    # DeepSpeed's ZeRO replaces each gradient by its orthogonalised update before it computes the
    # norm and clips, so a clip would rescale the update itself (the authors do not clip).
    need(t.optimizer == "adamw" or t.clip == 0, "train.grad_clip",
         f"must be 0 or null with train.optimizer={t.optimizer}: DeepSpeed's ZeRO would clip the "
         f"orthogonalised update, not the gradient (got {t.grad_clip})")


def _validate_qk_clip(m: ModelConfig, t: TrainConfig, need):
    """train.qk_clip: the step's largest logits are measured in the project's SDPA core attention,
    and the clip scales the query/key projections of megatron's SelfAttention (gqa) or
    MLASelfAttention (mla), the two layouts megatron-core's clip knows (megatron_kappa.optim.qk_clip)."""
    if t.qk_clip is None:
        return
    need(m.attention == "sdpa", "train.qk_clip",
         f"needs model.attention sdpa (the step's largest logits are measured in the project's SDPA core "
         f"attention), got {m.attention}")
    kind = attention_kinds.name_of(m)
    need(kind in ("gqa", "mla"), "train.qk_clip",
         f"scales the query/key weights of gqa or mla attention (megatron-core's two layouts), not {kind}")
    need(kind != "gqa" or not m.qk_layernorm, "train.qk_clip",
         "needs model.qk_layernorm false with gqa attention: the per-head query/key norms undo any scaling of "
         "the projection weights (MLA's norms sit on the latents, before the scaled up-projections)")


def _validate_recompute(m, need):
    """model.recompute_modules: megatron's module names that run here (its layernorm recompute
    needs Transformer Engine's FP8 state), each where it exists, with selective recompute."""
    need(m.recompute_layers is None or m.recompute == "full", "model.recompute_layers",
         f"applies to model.recompute: full (got {m.recompute})")
    mods = m.recompute_modules
    if mods is None:
        return
    need(m.recompute == "selective", "model.recompute_modules",
         f"applies to model.recompute: selective (got {m.recompute})")
    need(isinstance(mods, list) and len(mods) > 0 and all(x in selective.MODULES for x in mods)
         and len(set(mods)) == len(mods), "model.recompute_modules",
         f"expected a non-empty list of distinct names from {list(selective.MODULES)} (megatron's layernorm "
         f"needs Transformer Engine), got {mods!r}")
    for name in mods:
        why = selective.MODULES[name].needs(m)
        need(why is None, "model.recompute_modules", why)


def _validate_block(m: ModelConfig, par: ParallelConfig, need):
    """The nanochat block's parts (megatron_kappa.model.nanochat): their layers read this forward's
    tokens and x0 from an object the model fills, which a recomputed layer reads again later."""
    need(not (m.residual_scalars and m.recompute == "full"), "model.recompute",
         "full with model.residual_scalars: the recomputed layer would read x0 outside the graph that "
         "made it; use selective or none")
    need(not (m.value_embeddings and m.recompute == "full" and par.pp > 1), "model.recompute",
         "full with model.value_embeddings and parallel.pp > 1: a layer recomputed in backward would read "
         "a later micro-batch's tokens; use selective or none")
    need(not m.value_embeddings or m.hidden_size >= 32, "model.value_embeddings",
         f"the gate reads 32 channels of the hidden state; model.hidden_size is {m.hidden_size}")


def _validate_context(m: ModelConfig, par: ParallelConfig, ev: EvalConfig, router, need):
    """What context parallelism (parallel.cp > 1) needs: megatron's 2·cp chunks of each sequence,
    the project's SDPA core attention (megatron's local attention refuses CP, TE's cannot run
    here), and none of the parts not verified under it (docs/context_parallel.md)."""
    cp, tp = par.cp, par.tp
    need(m.seq_length % (2 * cp) == 0, "parallel.cp",
         f"model.seq_length={m.seq_length} is not divisible by 2 × cp = {2 * cp} (megatron's load-balanced causal "
         f"layout cuts each sequence into 2·cp chunks)")
    need((m.seq_length // cp) % tp == 0, "parallel.cp",
         f"the {m.seq_length // cp} tokens of a CP rank are not divisible by tp={tp} "
         "(sequence parallelism splits them)")
    need(m.attention == "sdpa", "model.attention",
         f"must be sdpa with parallel.cp={cp} (its context-parallel path; megatron's local attention refuses "
         f"context parallelism and Transformer Engine's does not run here), got {m.attention}")
    need(not m.mtp.num_layers, "model.mtp.num_layers",
         f"multi-token prediction with parallel.cp={cp} is not supported (not verified; use parallel.cp 1)")
    need(m.layout == "dense" or router.topk, "model.moe.router",
         f"{m.moe.router} with parallel.cp={cp} is not supported (not verified; use a top-k router or parallel.cp 1)")
    need(not ev.core_every, "eval.core_every",
         "the CORE subset during training runs whole prompts on each rank; with parallel.cp > 1 evaluate the "
         "checkpoints afterwards (eval/core.py)")


def _validate_pipeline(cfg: Config, router, need):
    """What pipeline stages (parallel.pp > 1) cannot be combined with."""
    pp = cfg.parallel.pp
    need(cfg.zero.stage == 1, "zero.stage",
         f"{cfg.zero.stage} with parallel.pp={pp}: ZeRO-2 reduces gradients inside backward hooks, which the "
         "pipeline schedule's backward passes bypass (the update comes out silently wrong); use zero.stage 1")
    need(cfg.model.layout == "dense" or not router.pipeline_refusal, "model.moe.router",
         f"{cfg.model.moe.router} {router.pipeline_refusal}; use parallel.pp 1")
    need(not cfg.eval.core_every, "eval.core_every",
         "the CORE subset during training needs the whole model on each rank; with parallel.pp > 1 "
         "evaluate the checkpoints afterwards (eval/core.py consolidates them)")


def _validate_ep_overlap(cfg: Config, router, need):
    """parallel.overlap_moe_expert_parallel_comm / delay_wgrad_compute: megatron-core's own rules
    (TransformerConfig.__post_init__, which would stop the build with an assert) first, then what
    the combined 1F1B schedule bypasses here: it calls each layer's attention, router, dispatcher
    and experts itself, not the layer's or the model's forward (docs/ep_overlap.md)."""
    m, par, key = cfg.model, cfg.parallel, "parallel.overlap_moe_expert_parallel_comm"
    need(par.overlap_moe_expert_parallel_comm, "parallel.delay_wgrad_compute",
         "needs parallel.overlap_moe_expert_parallel_comm (megatron runs the delayed weight gradients in its "
         "overlapped schedule only)")
    need(m.moe.grouped_gemm or not par.delay_wgrad_compute, "parallel.delay_wgrad_compute",
         "needs model.moe.grouped_gemm: true (megatron's per-expert linears compute their weight gradients in "
         "backward whatever the flag says; the grouped experts defer theirs)")
    need(not (par.delay_wgrad_compute and cfg.precision == "fp8" and m.fp8.experts), "parallel.delay_wgrad_compute",
         "with FP8 experts (model.fp8.experts): their FP8 grouped GEMM computes its weight gradient in backward; "
         "set model.fp8.experts: false or leave the flag off")
    need(m.layout != "dense" and par.ep >= 2, key, f"hides the expert all-to-all: needs an MoE model and "
         f"parallel.ep >= 2 (got layout {m.layout}, ep={par.ep})")
    need(m.moe.dispatcher == "alltoall", key,
         f"needs model.moe.dispatcher: alltoall (megatron: alltoall or flex; got {m.moe.dispatcher})")
    need(cfg.precision in ("bf16", "fp8"), key, f"needs precision bf16 or fp8, as megatron-core (got {cfg.precision})")
    need(par.pp == 1 or par.vpp > 1, key, f"with parallel.pp={par.pp} needs parallel.vpp > 1 (megatron's "
         "combined schedule interleaves virtual stages)")
    need(par.cp == 1, key, f"with parallel.cp={par.cp}: the overlapped schedule with context parallelism is "
         "not run or tested here; use parallel.cp 1")
    need(m.recompute != "full" and "moe" not in (m.recompute_modules or []), "model.recompute",
         "full, or selective with moe, cannot be combined with parallel.overlap_moe_expert_parallel_comm "
         "(megatron-core refuses them)")
    need(router.topk, "model.moe.router", f"{m.moe.router} with parallel.overlap_moe_expert_parallel_comm: the "
         "overlapped schedule runs here with the top-k routers only")
    for block in ("value_embeddings", "residual_scalars", "embedding_norm"):
        need(not getattr(m, block), f"model.{block}", "must be false with parallel.overlap_moe_expert_parallel_comm "
             "(the schedule calls megatron's layer and model pieces, not the nanochat block's forward)")
    need(not m.mtp.num_layers, "model.mtp.num_layers", "must be 0 with parallel.overlap_moe_expert_parallel_comm "
         "(the MTP block under the overlapped schedule is not built here)")
    need(cfg.zero.stage == 1, "zero.stage", f"{cfg.zero.stage} with parallel.overlap_moe_expert_parallel_comm: "
         "ZeRO-2 reduces gradients in backward hooks, which under megatron's schedule gave silently wrong updates "
         "with pipeline stages (docs/pipeline.md); use 1")
