"""The trainer's expert-parallel overlap as the estimate counts it: megatron's combined 1F1B
(`parallel.overlap_moe_expert_parallel_comm`, docs/ep_overlap.md) hides the all-to-all of one
micro-batch behind another's compute, except in its warm-up and cool-down.

The schedule (megatron-core 0.19: pipeline_parallel/combined_1f1b.py, schedules.py) runs a
stage's m·v passes per step (m micro-batches, v virtual stages: each chunk of each micro-batch)
forward and backward. W of them warm up: their forwards run alone, and W backwards run alone
in the cool-down at the end. Each of the other m·v − W forwards runs paired with an earlier
pass's backward, layer by layer, each dispatch or combine all-to-all of the one on the
communication stream while the other computes. W (`warmup`) is 1 without stages
(forward_backward_no_pipelining's combined path: the first forward alone, the last backward
alone) and with stages megatron's interleaved warm-up, which the overlap lengthens by one:
2 (p − r − 1) + (v − 1)·p + 1 for pipeline rank r (get_pp_rank_microbatches), at most m·v.

The estimate: a stage's expert traffic E (plan.speed's "expert" term: the all-to-alls, the
expert-TP gathers and their messages) and its GEMM time C (compute + memory) are spread evenly
over its passes, E/(m·v) and C/(m·v) each. A paired step takes the longer of its compute and
its all-to-alls instead of their sum, a warm-up forward or a cool-down backward their sum, so
over the step the stage saves (`hidden`)

    min(E, C) × (m·v − W) / (m·v)

and stays busy C + E − that. This is an upper bound on the hiding: the schedule pairs each
all-to-all with one compute node (the dispatch with the other micro-batch's expert backward,
the combine with its attention, ...), and one longer than its node still waits; the estimate
lets a layer's all-to-alls hide behind the layer's whole paired compute. The fixed per-layer
time (`Rates.layer_ms`) hides nothing, as for the planned-only overlap (plan.planned), and the
all-to-all hides behind the compute the planned-only terms (`--overlap tensor,context,pipeline`)
leave: min(E, max(C − H, 0)) for their sum H. With `--overlap expert` (planned only: the whole
all-to-all hidden, DualPipe's) that rule applies instead, and under DualPipe (planned only;
the trainer runs the overlap only with virtual stages, which DualPipe has none of) nothing is
added here. parallel.delay_wgrad_compute changes only when the experts' weight gradients are
computed within a paired step: the estimate does not tell it apart.

Memory (plan.activations) is left as without the overlap: a paired step frees the backward's
layers as its forward keeps its own, so the peak is the passes held before it, plus about one
layer (not counted). Without stages that is one micro-batch, as before; with stages, W passes:
megatron's warm-up without the overlap and the one more, the same W + 1 passes the plain
interleaved schedule holds when each 1F1B step's forward ends before its backward starts.
"""
from __future__ import annotations

from megatron_kappa.config import ParallelConfig


def runs(parallel: ParallelConfig, overlap: tuple[str, ...] = (), dualpipe: bool = False) -> bool:
    """Whether the estimate applies the trainer's EP overlap: the config sets it, and neither the
    planned-only whole-all-to-all overlap (`overlap` with "expert") nor DualPipe replaces it."""
    return parallel.overlap_moe_expert_parallel_comm and "expert" not in overlap and not dualpipe


def warmup(pp: int, vpp: int, stage: int, micro_batches: int) -> int:
    """Passes of pipeline rank `stage` whose forward runs alone (and as many backwards at the
    end): 1 without stages, megatron's interleaved warm-up plus one with them (PP without virtual
    stages, which the trainer refuses with the overlap, counted as v = 1); at most m·v."""
    count = 1 if pp == 1 else 2 * (pp - stage - 1) + (vpp - 1) * pp + 1
    return min(count, micro_batches * vpp)


def paired_share(pp: int, vpp: int, stage: int, micro_batches: int) -> float:
    """The share of the stage's passes that run paired: (m·v − W) / (m·v)."""
    total = micro_batches * vpp
    return (total - warmup(pp, vpp, stage, micro_batches)) / total


def hidden(expert: float, gemms: float, planned_hidden: float, paired: float) -> float:
    """Seconds of the stage's expert traffic (`expert`) hidden per step: behind the GEMM time
    (`gemms`) the planned-only hidden terms (`planned_hidden`) leave, over the paired share."""
    return min(expert, max(gemms - planned_hidden, 0.0)) * paired
