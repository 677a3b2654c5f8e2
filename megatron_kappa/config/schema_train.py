"""The config schema's training sections: parallel, train (with train.muon) and zero.

megatron_kappa.config.schema gathers them into Config and re-exports them: import them from there."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megatron_kappa.config.facts import (
    AT_LEAST_ONE,
    FRACTION,
    NON_NEGATIVE,
    OPEN_FRACTION,
    OPEN_UNIT,
    POSITIVE,
    PROBABILITY,
)
from megatron_kappa.config.facts import key as _f
from megatron_kappa.config.facts import section as _section


@dataclass
class ParallelConfig:
    tp: int = _f(1, "tensor parallel size (sequence parallelism is on when tp > 1)", range=POSITIVE)
    ep: int = _f(1, "expert parallel size", range=POSITIVE)
    etp: Optional[int] = _f(None, "expert tensor parallel size (null: same as tp)", range=POSITIVE)
    pp: int = _f(1, "pipeline parallel size: model.num_layers split evenly over pp stages (or as first_stage_layers / "
                    "last_stage_layers say), the embedding on "
                    "the first and the output layer on the last; megatron-core's 1F1B schedule with ZeRO-1 "
                    "(ZeRO-2, softmoe and eval.core_every are refused with pp > 1; docs/pipeline.md)", range=POSITIVE)
    first_stage_layers: Optional[int] = _f(
        None, "uneven pipeline stages: layers on the first stage (megatron's num_layers_in_first_pipeline_stage; "
              "the stages without a set count split the rest evenly; null: an even split)", range=POSITIVE)
    last_stage_layers: Optional[int] = _f(
        None, "layers on the last stage (megatron's num_layers_in_last_pipeline_stage), e.g. fewer, to leave room "
              "for the output layer and the loss", range=POSITIVE)
    layout: Optional[str] = _f(
        None, "megatron's pipeline_model_parallel_layout instead of first/last_stage_layers: each stage's layers, "
              "stages separated by '|': E the embedding (opens the first), t a decoder layer, m an MTP layer, L the "
              "loss (closes the last); x*n and (...)*n repeat, e.g. 'Et*3|t*2mL'; one entry per stage and virtual "
                               "stage "
              "(pp × vpp, megatron's order: entry c on rank c mod pp); an entry without a t (e.g. 'Et|(tt|)*30mL') "
              "is the planner's only: the trainer refuses it (megatron_kappa/config/stage_layout.py)")
    vpp: int = _f(1, "virtual pipeline stages per pipeline rank (megatron's virtual_pipeline_model_parallel_size): "
                     "interleaved 1F1B over pp × vpp model chunks, chunk c on rank c mod pp; the layers split evenly "
                     "over the chunks, or as parallel.layout says with pp × vpp entries; the micro-batches per step "
                     "must be a multiple of pp (docs/pipeline.md)", range=POSITIVE)
    cp: int = _f(1, "context parallel size: each sequence split over cp ranks in megatron's load-balanced causal "
                    "layout (2·cp chunks, rank r holds chunks r and 2·cp−1−r; model.seq_length divisible by 2·cp), "
                    "keys and values all-gathered over them; needs model.attention sdpa, refused with model.mtp and "
                    "the softmoe router (docs/context_parallel.md)", range=POSITIVE)
    overlap_moe_expert_parallel_comm: bool = _f(
        False, "megatron-core's EP communication overlap: each step's micro-batches run through its combined 1F1B "
               "schedule, one micro-batch's forward interleaved layer by layer with the previous one's backward, so "
               "that on a GPU each all-to-all runs on a side stream beside the other micro-batch's compute; needs "
               "ep >= 2, the alltoall dispatcher, precision bf16 or fp8 and, with pp > 1, vpp > 1 (docs/ep_overlap.md)")
    delay_wgrad_compute: bool = _f(
        False, "with overlap_moe_expert_parallel_comm: the grouped experts' weight gradients are computed after the "
               "next micro-batch's dispatch is issued instead of inside their backward (megatron's backward_dw); "
               "needs model.moe.grouped_gemm (docs/ep_overlap.md)")
    timeout_s: float = _f(600.0, "seconds a collective waits for the other ranks before the job fails "
                                 "(a dead or hung rank; torch's defaults: 30 min gloo, 10 min NCCL)", range=POSITIVE)

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size in effect (`etp`, or `tp` when unset)."""
        return self.etp or self.tp

    @property
    def megatron_schedule(self) -> bool:
        """Whether a step runs through megatron-core's schedule (pipeline stages, or the EP overlap's
        combined 1F1B) instead of DeepSpeed's forward and backward per micro-batch."""
        return self.pp > 1 or self.overlap_moe_expert_parallel_comm


@dataclass
class MuonConfig:
    lr: float = _f(0.01, "peak learning rate of the orthogonalised matrices (train.lr's schedule; authors: 0.01)",
                   range=NON_NEGATIVE)
    momentum: float = _f(0.95, "momentum β of the EMA buffer M ← βM + (1-β)G", range=FRACTION)
    nesterov: bool = _f(True, "Nesterov: orthogonalise (1-β)G + βM instead of M")
    ns_steps: int = _f(5, "Newton–Schulz iterations per polar factor (authors: 5)", range=AT_LEAST_ONE)
    weight_decay: float = _f(0.05, "decoupled weight decay W ← W·(1 - lr·wd) of the orthogonalised matrices",
                             range=NON_NEGATIVE)
    aurora_rounds: int = _f(2, "aurora: row-equilibration rounds of a rectangular matrix (authors' pp_iterations)",
                            range=AT_LEAST_ONE)
    aurora_exponent: float = _f(0.5, "aurora: exponent of the row rescaling D ← D·((n/m)/‖u_i‖²)^exponent (pp_beta)",
                                range=NON_NEGATIVE)
    scale: Optional[Literal["original", "match_rms_adamw", "none"]] = _f(
        None, "step scale per [m, n] matrix: original √max(1, m/n), match_rms_adamw 0.2·√max(m, n) "
              "capped at 1, none (null: original for muon, match_rms_adamw for aurora, as the authors)")
    max_scale: Optional[float] = _f(None, "cap on the step scale (null: 1.0 for match_rms_adamw, none otherwise)",
                                    range=POSITIVE)


@dataclass
class TrainConfig:
    steps: Optional[int] = _f(None, "optimizer steps (null: the token budget 5 × N_eff); the schedules run over "
                                    "them, so a resume that changes them needs allow_schedule_change", range=POSITIVE)
    allow_schedule_change: bool = _f(
        False, "let a resume change the schedules' length (train.steps, or with it null the token budget's "
               "inputs): the learning-rate, weight-decay, κ and aux-loss schedules are recomputed over the new "
               "length from the step reached, so the rate jumps there (false: refused in one line, as Megatron-LM "
               "refuses without --override-opt_param-scheduler; docs/checkpoints.md)")
    seed: int = _f(24, "random seed (paper: 24, 26, 28)", range=NON_NEGATIVE)
    micro_batch: int = _f(1, "sequences per rank per forward", range=POSITIVE)
    global_batch: int = _f(8, "sequences per optimizer step (gradient accumulation fills the rest; "
                              "the authors' automatic size is printed by megatron_kappa.summary)", range=POSITIVE)
    tokens_per_param: float = _f(5.0, "token budget = tokens_per_param × N_eff when train.steps is null "
                                      "(paper App. 8; authors' --target-param-data-ratio 5)", range=POSITIVE)
    budget_discount: Optional[bool] = _f(
        None, "count the routed experts at √(k/E) in N_eff (true/false); null: the authors' rule, "
              "true only when MoE layers ≥ num_layers / 5 (false for the sandwich models)")
    optimizer: Literal["adamw", "muon", "aurora"] = _f(
        "adamw", "matrix optimizer: adamw, or the orthogonalised update of Muon (KellerJordan/Muon, as DeepSpeed "
                 "has it; not the authors' Muon variant) or of the authors' Aurora (train.muon; attention, "
                 "dense-MLP and expert matrices, AdamW for the rest; docs/optimizer.md)", state=True)
    router_optimizer: Literal["adamw", "matrix"] = _f(
        "adamw", "muon/aurora: the routers' optimizer: adamw (train.lr, train.weight_decay) or matrix (the "
                 "orthogonalised update with the matrices, as the authors' code does); adamw: no effect", state=True)
    lr: float = _f(3e-4, "peak learning rate of matrix parameters under AdamW (muon/aurora: of the routers "
                         "when train.router_optimizer is adamw)", range=NON_NEGATIVE)
    lr_non_matrix: float = _f(3e-4, "peak AdamW learning rate of norms and other non-matrix parameters, and of "
                                    "the embedding and output layer unless lr_embedding/lr_output are set",
                                    range=NON_NEGATIVE)
    lr_embedding: Optional[float] = _f(None, "peak AdamW learning rate of the input embedding (null: "
                                             "lr_non_matrix; authors: 0.3)", range=NON_NEGATIVE)
    lr_output: Optional[float] = _f(None, "peak AdamW learning rate of the output layer (null: lr_non_matrix; "
                                          "authors: 0.004)", range=NON_NEGATIVE)
    adamw_width_scaling: bool = _f(False, "multiply the embedding, output and non-matrix learning rates by "
                                          "(hidden_size / 768)^-0.5 (the authors' dmodel_lr_scale)")
    batch_lr_scaling: bool = _f(False, "multiply every learning rate but κ's by sqrt(global_batch · seq_length "
                                       "/ 2^19) (the authors' batch_lr_scale)")
    lr_decay_style: Literal["cosine", "wsd"] = _f(
        "cosine", "cosine: linear warmup, cosine decay to min_lr_ratio at the last step; wsd (Megatron's "
                  "name): linear warmup, constant, then linear decay over the last lr_wsd_decay_fraction of "
                  "the steps towards min_lr_ratio (the authors' get_lr_multiplier)")
    lr_wsd_decay_fraction: float = _f(0.5, "wsd: fraction of the steps in the final decay (authors' "
                                           "--warmdown-ratio 0.5)", range=OPEN_FRACTION)
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of the peak (authors: 0)", range=PROBABILITY)
    warmup: int = _f(100, "learning-rate warmup steps (authors: 0)", range=NON_NEGATIVE)
    weight_decay: float = _f(0.05, "AdamW weight decay on matrices (muon/aurora: on the routers when they "
                                   "stay on AdamW)", range=NON_NEGATIVE)
    wd_decay_style: Literal["constant", "linear"] = _f(
        "constant", "weight decay over the run: constant, or linear: × (1 - step / steps), towards 0 at the "
                    "end (the authors' get_weight_decay)")
    wd_depth_scaling: bool = _f(False, "multiply the weight decay by (12 / num_layers)^2 (the authors' "
                                       "weight_decay_scaled, tuned at depth 12)")
    lr_resid_scalar: float = _f(0.005, "peak AdamW learning rate of model.residual_scalars' λ_resid (authors: "
                                       "0.01 × their scalar_lr 0.5; no width scaling)", range=NON_NEGATIVE)
    lr_x0_scalar: float = _f(0.5, "peak AdamW learning rate of model.residual_scalars' λ_x0 (authors: 0.5; no "
                                  "width scaling)", range=NON_NEGATIVE)
    x0_betas: list = _f([0.96, 0.95], "AdamW betas of λ_x0 (the authors' x0 group)", allowed='two numbers in [0, 1)')
    betas: list = _f([0.9, 0.95], "AdamW betas (every AdamW group, also under muon/aurora; authors: [0.8, 0.95])",
                     allowed='two numbers in [0, 1)')
    adam_eps: float = _f(1e-8, "AdamW epsilon of every AdamW group (authors: 1e-10)", range=NON_NEGATIVE)
    nonfinite_steps: int = _f(1, "consecutive steps with a non-finite loss or gradient norm (or skipped by DeepSpeed "
                                 "for one) that end the run, in one line and without a checkpoint of them "
                                 "(Megatron-LM's --check-for-nan-in-loss-and-grad: the first; 0: never; read on "
                                 "logging and checkpoint steps: megatron_kappa/train/divergence.py)",
                              range=NON_NEGATIVE)
    grad_clip: Optional[float] = _f(None, "global gradient-norm clip (0: off; null: 1.0 for adamw, off for "
                                          "muon/aurora, which refuse a nonzero clip)", range=NON_NEGATIVE)
    qk_clip: Optional[float] = _f(
        None, "QK-Clip τ (Kimi K2's MuonClip, arXiv 2507.20534 §2.1; megatron-core's qk_clip_threshold; K2: 100): "
              "after each optimizer step, the query/key weights of a head whose largest pre-softmax logit in the "
              "step's training forwards S exceeds τ are scaled so that its logits shrink by γ = τ/S (GQA: the "
              "group's largest, its key being shared; MLA: q_C × γ^α, k_C × γ^(1-α), q_R × γ, the shared k_R "
              "untouched), in the weights and in ZeRO's fp32 master copy; any optimizer; model.attention sdpa, "
              "and for gqa model.qk_layernorm false (megatron_kappa/optim/qk_clip.py). null: off",
        range=POSITIVE)
    qk_clip_alpha: float = _f(0.5, "QK-Clip's split α of γ between query (γ^α) and key (γ^(1-α)) weights "
                                   "(megatron-core's qk_clip_alpha; K2: 0.5, √γ each)", range=OPEN_UNIT)
    grad_accum_dtype: Literal["fp32", "bf16"] = _f(
        "fp32", "precision bf16/fp8: dtype in which the micro-batches' gradients are summed and reduced over "
                "data-parallel ranks (fp32 precision: fp32 always). fp32, Megatron-LM's default: every optimizer "
                "update sees an fp32 gradient (Muon/Aurora momentum in fp32 too), at the cost of an fp32 "
                "gradient copy (4 instead of 2 bytes per parameter) and fp32 reductions (twice the gradient "
                "traffic). bf16 saves that memory and traffic but rounds every addition to 8 bits of mantissa "
                "(DeepSpeed: not safe with many accumulation steps) and Muon/Aurora keep a bf16 momentum "
                "(megatron_kappa/parallel/grad_precision.py, docs/optimizer.md)")
    init_weights: Optional[str] = _f(None, "full-layout state dict (.pt, launch/consolidate.py's) or Hugging Face "
                                          "model folder (the export's classes: python -m megatron_kappa.import_hf "
                                          "prints the model settings it needs) to start from instead of a random "
                                          "init; ignored when resuming from a checkpoint", derived=True)
    deterministic: bool = _f(False, "deterministic kernels (torch.use_deterministic_algorithms): "
                                    "bit-exact resume and reruns on GPUs, at some speed; CPU runs "
                                    "are deterministic anyway")
    muon: MuonConfig = _section(MuonConfig)

    @property
    def clip(self) -> float:
        """The gradient clip in effect: grad_clip, or by optimizer when it is null."""
        if self.grad_clip is not None:
            return self.grad_clip
        return 1.0 if self.optimizer == "adamw" else 0.0


@dataclass
class ZeroConfig:
    stage: int = _f(1, "DeepSpeed ZeRO stage for optimizer state: 1 or 2 (3 is refused with expert parallelism)",
                    range=POSITIVE, derived=True)
    offload_optimizer: bool = _f(False, "DeepSpeed's ZeRO-Offload: the fp32 master copy and the optimizer's "
                                 "state in CPU memory, the step on the CPU (the configured torch optimizer)")
