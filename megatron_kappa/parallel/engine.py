"""DeepSpeed around a megatron-core model: the mpu adapter, the expert wiring, the engine.

DeepSpeed recognises expert parameters only through its own MoE layer. megatron-core marks
them with `allreduce=False` and nothing else, and without the four pieces below DeepSpeed
silently averages different experts together (tests/test_training.py has that negative control):
  1. every `allreduce=False` parameter gets `group_name = "ep_size_<EP>"`;
  2. DeepSpeed's expert(-data)-parallel group tables are filled from megatron's groups;
  3. a parameter-free `deepspeed.moe.layer.MoE` marker in the model sets `has_moe_layers`;
  4. optimizer groups are split with `split_params_into_different_moe_groups_for_optimizer`.
The optimizer itself is built by megatron_kappa.optim.optimizer; gradients of bf16 parameters
are accumulated and reduced in fp32 unless train.grad_accum_dtype says bf16
(megatron_kappa.parallel.grad_precision).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.utils import groups as ds_groups
from megatron.core import parallel_state as ps

from megatron_kappa.config import ParallelConfig, TrainConfig, ZeroConfig
from megatron_kappa.model.params import is_expert
from megatron_kappa.parallel import grad_precision, stage_norm


def _with_context(function):
    return staticmethod(lambda: function(with_context_parallel=True))


class MegatronMPU:
    """The model-parallel-unit interface DeepSpeed asks for, over megatron's parallel state.

    DeepSpeed's data-parallel group is megatron's with the context-parallel ranks in it (as
    megatron's own DDP and distributed optimizer): they hold the same weights, so their gradients
    are averaged and ZeRO partitions over them (megatron_kappa.parallel.context scales the loss).
    Deliberately no `initialize_sequence_parallel`: DeepSpeed reads its presence as Ulysses.
    """

    get_data_parallel_group = _with_context(ps.get_data_parallel_group)
    get_data_parallel_world_size = _with_context(ps.get_data_parallel_world_size)
    get_data_parallel_rank = _with_context(ps.get_data_parallel_rank)
    get_tensor_model_parallel_group = staticmethod(ps.get_tensor_model_parallel_group)
    get_tensor_model_parallel_world_size = staticmethod(ps.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_rank = staticmethod(ps.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_src_rank = staticmethod(ps.get_tensor_model_parallel_src_rank)
    get_pipeline_model_parallel_group = staticmethod(ps.get_pipeline_model_parallel_group)
    get_pipeline_model_parallel_world_size = staticmethod(ps.get_pipeline_model_parallel_world_size)
    get_pipeline_model_parallel_rank = staticmethod(ps.get_pipeline_model_parallel_rank)
    # "model parallel" in DeepSpeed means TP × PP, which is megatron's model-parallel group.
    get_model_parallel_group = staticmethod(ps.get_model_parallel_group)

    @staticmethod
    def get_model_parallel_world_size():
        return dist.get_world_size(ps.get_model_parallel_group())

    @staticmethod
    def get_model_parallel_rank():
        return dist.get_rank(ps.get_model_parallel_group())


class ExpertMarker(MoE):
    """Parameter-free stand-in that only tells DeepSpeed the model has expert parameters."""

    def __init__(self, ep_size: int, num_experts: int):
        torch.nn.Module.__init__(self)
        self.ep_size, self.num_experts = ep_size, num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = expert_group_name()

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False):
        pass  # groups come from megatron (wire_experts)

    def forward(self, *args, **kwargs):
        raise RuntimeError("ExpertMarker is a marker, not a layer")


def expert_group_name() -> str:
    return f"ep_size_{ps.get_expert_model_parallel_world_size()}"


def wire_experts(model) -> bool:
    """Pieces 1-3. Returns False when the model has no experts that DeepSpeed must reduce apart:
    megatron marks them (`allreduce=False`) only when EP > 1 or expert-TP differs from TP;
    otherwise the expert-data-parallel group is the data-parallel group and they reduce as dense."""
    experts = [p for n, p in model.named_parameters() if is_expert(n)]
    if not experts or all(getattr(p, "allreduce", True) for p in experts):
        return False
    name = expert_group_name()
    for p in experts:
        p.group_name = name
    ep_group = ps.get_expert_model_parallel_group()
    edp_group = ps.get_expert_data_parallel_group()
    ds_groups._EXPERT_PARALLEL_GROUP[name] = ep_group
    ds_groups._EXPERT_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(ep_group)
    ds_groups._EXPERT_DATA_PARALLEL_GROUP[name] = edp_group
    ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(edp_group)
    if not any(isinstance(m, ExpertMarker) for m in model.modules()):
        model.deepspeed_expert_marker = ExpertMarker(ps.get_expert_model_parallel_world_size(),
                                                     model.config.num_moe_experts)
    return True


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What the DeepSpeed engine is set up from, read together from four sections (`of`)."""
    micro_batch: int  # train.micro_batch
    clip: float  # train.clip: train.grad_clip, or the optimizer's default where it is null
    grad_accum_dtype: str  # train.grad_accum_dtype
    zero_stage: int  # zero.stage
    offload_optimizer: bool  # zero.offload_optimizer
    precision: str
    megatron_schedule: bool  # parallel.megatron_schedule: pipeline stages or the EP overlap
    pp: int  # parallel.pp

    @classmethod
    def of(cls, train: TrainConfig, zero: ZeroConfig, par: ParallelConfig, precision: str) -> EngineSettings:
        return cls(micro_batch=train.micro_batch, clip=train.clip, grad_accum_dtype=train.grad_accum_dtype,
                   zero_stage=zero.stage, offload_optimizer=zero.offload_optimizer, precision=precision,
                   megatron_schedule=par.megatron_schedule, pp=par.pp)


def ds_config(s: EngineSettings, grad_accum: int) -> dict:
    zero = {"stage": s.zero_stage, "contiguous_gradients": True, "reduce_scatter": True, "overlap_comm": False}
    if s.offload_optimizer:  # ZeRO-Offload with this project's optimizer (not DeepSpeed's C++ CPU Adam)
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "zero_force_ds_cpu_optimizer": False,
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": s.clip,  # null: by optimizer (TrainConfig.clip)
        "zero_optimization": zero,
        "bf16": {"enabled": s.precision in ("bf16", "fp8")},
        # pipeline stages or the EP overlap: megatron's schedule does the backward passes and
        # engine.step() is the accumulation boundary (megatron_kappa.train.pipeline)
        "managed_gradient_accumulation": not s.megatron_schedule,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        **grad_precision.ds_entries(s.precision, s.grad_accum_dtype),
    }


def initialize(model, param_groups: list[dict], s: EngineSettings, grad_accum: int,
               build_optimizer: Callable[[list[dict]], torch.optim.Optimizer]):
    """Wire experts, split the optimizer groups for them, build the optimizer from the groups and
    start the DeepSpeed engine. Returns (engine, optimizer)."""
    if "LOCAL_RANK" not in os.environ:  # plain `python` (a world of one): DeepSpeed asks for it
        os.environ["LOCAL_RANK"] = "0"
    if wire_experts(model):
        param_groups = split_params_into_different_moe_groups_for_optimizer(param_groups)
    optimizer = build_optimizer([g for g in param_groups if g["params"]])
    fp32_grads = grad_precision.fp32_accumulation(s.precision, s.grad_accum_dtype)
    with grad_precision.zero_routing(fp32_grads):  # ZeRO-1 too keeps DeepSpeed's ZeRO optimizer
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, mpu=MegatronMPU(), config=ds_config(s, grad_accum),
            dist_init_required=False)
    if fp32_grads:
        grad_precision.keep_fp32(optimizer)
    if s.pp > 1:  # stages hold different groups: the gradient norm keyed by group name
        stage_norm.install(optimizer)
    return engine, optimizer
