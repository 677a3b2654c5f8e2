"""fp32 gradient accumulation and reduction with bf16 parameters (`train.grad_accum_dtype`).

Megatron-LM accumulates the micro-batches' gradients of bf16 parameters in an fp32 buffer
(`main_grad`) and all-reduces that buffer in fp32. DeepSpeed 0.19.8 has the same in its ZeRO
optimizer (`data_types.grad_accum_dtype: fp32` and `communication_data_type: fp32`, `ds_entries`),
with four gaps that this module closes, all checked against upstream by `missing_upstream`:

1. Routing. With bf16 parameters, fp32 accumulation and ZeRO stage 1 (no offload) the engine
   (`DeepSpeedEngine._do_optimizer_sanity_check`) picks its BF16_Optimizer instead of the ZeRO
   optimizer. That one refuses Muon with an mpu or expert layers ("BF16 Muon currently requires
   FP32 accumulation, dense DP and eager execution") and 3-D expert matrices, and keeps another
   state layout than megatron_kappa.checkpoint.optimizer_state reads. `zero_routing` keeps the
   ZeRO optimizer, which implements stage-1 fp32 accumulation itself (`use_grad_accum_attribute`:
   every backward adds `param.grad` into an fp32 `param.grad_accum`).
2. The copy after the reduction. Groups without ZeRO's fp32 "compact" gradient partition (the
   Muon/Aurora groups: their update needs each parameter's whole gradient) get their reduced
   gradient copied into `grads_in_partition`, which ZeRO allocates in the parameters' dtype: the
   fp32 sum was rounded to bf16 there, and at stage 2 the next micro-batches were added into it
   in bf16. `keep_fp32` allocates it in fp32 first, sized for those groups' parameters alone
   (ZeRO sizes it for every group's, which the compact groups never use: at 4 bytes an element
   that would be a second fp32 gradient of the AdamW groups).
3. The stage-2 staging bucket. At stage 2 ZeRO reduces every micro-batch in backward hooks from
   a bucket in the parameters' dtype and writes the fp32 result back into that bucket, which is
   the gradient the Muon groups accumulate. `keep_fp32` makes the bucket fp32, as stage 1's is.
4. The stage-2 merge. ZeRO-2's reduce-scatter (`average_tensor`) merges a gradient slice into the
   slice before it when both go to the same rank, and gives the merged slice no compact
   partition to add into: when a Muon/Aurora matrix (no compact partition) follows an AdamW
   group's parameter (norms, κ, router, embedding) bound for the same rank, that parameter's
   reduced gradient was dropped, and it stepped with a zero gradient (only with both kinds of
   group and fp32 accumulation: without compact partitions nothing is dropped).
   `fixed_average_tensor` merges only slices without a compact partition, as upstream means to.

With these, every Muon/Aurora update receives an fp32 gradient and keeps an fp32 momentum (ZeRO
sizes the momentum by the gradient's dtype), and the AdamW groups read an fp32 partition
(tests/test_grad_accum.py hooks both). `train.grad_accum_dtype: bf16` is DeepSpeed's default
path as it was: bf16 accumulation and bf16 reduction.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import textwrap

import torch

# What the module relies on upstream (tests/test_grad_accum.py: in a fresh interpreter).
UPSTREAM = [("deepspeed.runtime.engine", "DeepSpeedEngine._do_optimizer_sanity_check", ("return BFLOAT16",)),
            ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.copy_grads_in_partition",
             ("if self.grads_in_partition is None:", "self.grads_in_partition_offset")),
            ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer._gradient_reduction_buffer_dtype",
             ("self.gradient_accumulation_dtype",)),
            ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer._use_compact_grad_partition_buffer",
             ("_is_muon_group",)),
            ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer._get_param_group_idx", ("def ",))]
# item 4: upstream's merge condition, and the one this module compiles in its place
MERGE = ("if (grad_partition_output is None and partition_id == prev_id\n",
         "if (grad_partition_output is None and partition_id == prev_id and rank_and_offsets[-1][4] is None\n")
UPSTREAM.append(("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.average_tensor", (MERGE[0],
                 "rank_and_offsets[-1] = (prev_pid, prev_size, prev_numel + numel, copy_ranks, None)")))


def fp32_accumulation(precision: str, grad_accum_dtype: str) -> bool:
    """Whether the run accumulates low-precision gradients in fp32 (fp32 runs are fp32 anyway)."""
    return precision in ("bf16", "fp8") and grad_accum_dtype == "fp32"


def ds_entries(precision: str, grad_accum_dtype: str) -> dict:
    """DeepSpeed config entries: fp32 accumulation and fp32 reduction, or none (DeepSpeed's
    default with bf16 parameters: both in bf16)."""
    if not fp32_accumulation(precision, grad_accum_dtype):
        return {}
    return {"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}


@contextlib.contextmanager
def zero_routing(enabled: bool):
    """While DeepSpeed starts its engine: the ZeRO optimizer where the engine would choose
    BF16_Optimizer (stage 1, bf16 parameters, fp32 accumulation; item 1 above)."""
    if not enabled:
        yield
        return
    from deepspeed.runtime import engine as ds_engine
    original = ds_engine.DeepSpeedEngine._do_optimizer_sanity_check

    def sanity_check(self, basic_optimizer):
        chosen = original(self, basic_optimizer)
        return ds_engine.ZERO_OPTIMIZATION if chosen == ds_engine.BFLOAT16 and self.zero_optimization() else chosen
    ds_engine.DeepSpeedEngine._do_optimizer_sanity_check = sanity_check
    try:
        yield
    finally:
        ds_engine.DeepSpeedEngine._do_optimizer_sanity_check = original


@functools.cache
def fixed_average_tensor():
    """DeepSpeed's DeepSpeedZeroOptimizer.average_tensor with item 4's merge condition, compiled
    from its own source in its own module (one line differs: MERGE)."""
    from deepspeed.runtime.zero import stage_1_and_2
    source = textwrap.dedent(inspect.getsource(stage_1_and_2.DeepSpeedZeroOptimizer.average_tensor))
    if source.count(MERGE[0]) != 1:
        raise RuntimeError("DeepSpeed's average_tensor changed: megatron_kappa.parallel.grad_precision item 4 "
                           "needs a look (tests/test_grad_accum.py)")
    namespace = {}
    exec(compile(source.replace(*MERGE), stage_1_and_2.__file__, "exec"), vars(stage_1_and_2), namespace)
    return namespace["average_tensor"]


def keep_fp32(zero, merge_fix: bool = True) -> None:
    """Items 2 to 4 above, on this ZeRO-1/2 optimizer's instance (nothing else changes).
    `merge_fix` False leaves item 4 out (the test's negative control)."""
    if zero.gradient_accumulation_dtype != torch.float32 or zero.dtype == torch.float32:
        return
    if merge_fix:  # compact partitions exist here, beside Muon groups or not: the merge must keep them
        zero.average_tensor = fixed_average_tensor().__get__(zero)
    if zero.cpu_offload:  # offload accumulates in its fp32 CPU buffers
        return
    dtype = zero.gradient_accumulation_dtype
    zero._gradient_reduction_buffer_dtype = lambda: dtype
    copy = zero.copy_grads_in_partition

    def copy_grads_in_partition(param, group_idx=None):
        if group_idx is None:
            group_idx = zero._get_param_group_idx(param)
        # compact groups (fp32 partition already) return before ZeRO would allocate: so do we.
        # ZeRO sizes the buffer for every group's parameters, but only the other groups' (the
        # Muon/Aurora ones) are copied into it, one after another: it is sized for those alone
        # (the planner's bytes, megatron_kappa/plan/state.py, count it so)
        if zero.grads_in_partition is None and not zero._use_compact_grad_partition_buffer(group_idx):
            zero.grads_in_partition_offset = 0
            total = sum(p.numel() for i, group in enumerate(zero.params_in_partition)
                        if not zero._use_compact_grad_partition_buffer(i) for p in group)
            zero.grads_in_partition = torch.empty(total, dtype=dtype, device=param.device)
        return copy(param, group_idx)
    zero.copy_grads_in_partition = copy_grads_in_partition


def missing_upstream() -> list[str]:
    """What this module relies on that this DeepSpeed lacks."""
    import importlib
    missing = []
    for module, attr, needed in UPSTREAM:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part, None)
        source = inspect.getsource(obj) if obj is not None else ""
        missing += [f"{module}.{attr}: {text}" for text in needed if text not in source]
    from deepspeed.runtime import engine as ds_engine
    missing += [f"deepspeed.runtime.engine.{name}" for name in ("ZERO_OPTIMIZATION", "BFLOAT16")
                if not hasattr(ds_engine, name)]
    return missing
