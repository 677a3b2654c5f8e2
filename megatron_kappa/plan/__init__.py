"""The memory planner: what the most-loaded rank of a layout holds, and whether it fits.

    python -m plan --config X --world N [--gpu-mem 80] [--gpus-per-node 8] [--search] [--json]

Arithmetic only (no torch, no model): the parameters each rank builds, counted from the shapes
the way megatron-core shards them (tests/test_plan.py checks the counts against meta-device
builds of every rank of a grid of layouts), then bytes for them under DeepSpeed's bf16 ZeRO-1/2
as this project configures it (megatron_kappa.parallel.engine.ds_config), and an activation
estimate per recompute mode. docs/plan.md says where each number comes from, and why the planner
is a tool beside the trainer (this top-level package) rather than a part of megatron_kappa.

Modules:
  __main__.py     `python -m plan`: the planner's command line
  accepted.py     Whether the trainer runs a plan: its layout and settings through the trainer's own
                  config reading and checks
  activations.py  The activations one rank of a pipeline stage keeps for backward: an estimate, per
                  recompute mode
  context.py      Context parallelism's costs in the plan: the trainer's all-gather of keys and
                  values, and (planned only) Transformer Engine's ring
  dualpipe.py     DeepSeek-V3's DualPipe as the planner models it (planned only: the trainer runs
                  1F1B or interleaved 1F1B)
  ep_overlap.py   The trainer's expert-parallel overlap as the estimate counts it: megatron's
                  combined 1F1B (`parallel.overlap_moe_expert_parallel_comm`, docs/ep_overlap.md)
                  hides the all-to-all of one micro-batch behind another's compute, except in its
                  warm-up and cool-down
  estimate.py     The plan of one layout: what the most-loaded rank holds (parameters, training
                  state, buckets, activations at the config's recompute mode), whether it fits, and
                  the step-time estimate
  layout.py       A parallel layout as the planner sees it (TP, PP, EP, ETP, CP, virtual stages in a
                  world of ranks), the config split by it, and the checks that refuse a layout the
                  model cannot be split by
  params.py       The parameters one rank of a layout builds, by kind, counted from the shapes the
                  way megatron-core shards them (tests/test_plan.py checks the counts against meta-
                  device builds of every rank of a grid of layouts)
  planned.py      Settings the planner models that the trainer does not run: each is printed as
                  "planned only"
  published.py    The layouts and memory settings the published frontier runs trained with, each
                  with its source, as data: one YAML file per run in configs/frontier/published/
                  (its README says what each field means and where each group of runs comes from)
  render.py       The planner's text output: a plan, a search's table and a published run's line
  routing.py      The routed rows the busiest expert-parallel rank holds: read by the activation
                  estimate (the rows' saved tensors) and the step-time estimate (the experts' FLOPs
                  and the all-to-all)
  search.py       `--search`: the layouts that fit, fastest first, each at its fastest micro-batch,
                  recompute mode and EP overlap (the step-time estimate of plan.speed)
  speed.py        A step-time estimate per layout: compute from FLOPs, the pipeline bubble, and the
                  traffic of tensor, expert, pipeline and data parallelism at stated bandwidths
  state.py        Bytes of the training state one rank holds under DeepSpeed's bf16 ZeRO-1/2 as this
                  project configures it (megatron_kappa.parallel.engine.ds_config): weights,
                  gradients at their two peaks (summed in bf16 or, train.grad_accum_dtype's default,
                  in fp32), the fp32 master copy, the optimizer moments (Muon's momentum with the
                  copy ZeRO stages it in) and the reduce bucket
  tables.py       docs/plan.md's tables of the published runs, generated from their plans
                  (`--published`)
  units.py        Units the planner counts in: GiB, and the bytes of one value in a precision
"""
from __future__ import annotations

from megatron_kappa.plan import speed
from megatron_kappa.plan.activations import activation_bytes
from megatron_kappa.plan.estimate import HEADROOM, Plan, StagePlan, plan, plan_stage
from megatron_kappa.plan.layout import Layout, check, layout_of, model_shape, with_layout
from megatron_kappa.plan.params import (
    EXPERT_KINDS,
    KINDS,
    attention_matrices,
    attention_params,
    largest_tensors,
    layer_params,
    stage_params,
)
from megatron_kappa.plan.planned import Planned
from megatron_kappa.plan.render import render, render_search
from megatron_kappa.plan.state import (
    REDUCE_BUCKET_ELEMENTS,
    bucket_bytes,
    gradient_bytes,
    optimizer_groups,
    state_bytes,
)
from megatron_kappa.plan.units import GIB, value_bytes

__all__ = ["EXPERT_KINDS", "GIB", "HEADROOM", "KINDS", "Layout", "Plan", "Planned", "REDUCE_BUCKET_ELEMENTS",
           "activation_bytes", "attention_matrices", "attention_params", "bucket_bytes", "check", "gradient_bytes",
           "largest_tensors", "layer_params", "layout_of", "model_shape", "optimizer_groups",
           "plan", "plan_stage", "render", "render_search", "speed", "StagePlan", "stage_params", "state_bytes",
           "value_bytes", "with_layout"]
