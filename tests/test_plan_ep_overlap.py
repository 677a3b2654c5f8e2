"""The planner's model of the trainer's EP overlap (plan.ep_overlap, parallel.overlap_moe_expert_parallel_comm).

The step estimate with the overlap on is the estimate with it off less exactly the expert traffic
megatron's combined 1F1B can hide: min(expert, compute + memory) x the paired share (m·v − W)/(m·v),
recomputed here from the off plan's own terms (and, with stages, the bubble that scales with the
busy time). W is megatron's own: its no-pipelining combined schedule replayed with the
layer work stubbed out (the forwards and backwards it runs alone counted), and its
get_pp_rank_microbatches for the interleaved schedule. The row is not planned only. Negative
controls: one micro-batch per step hides nothing (no pair); the planned-only whole-all-to-all
overlap (--overlap expert) hides more, so the test tells the two rules apart.
"""
import dataclasses
import types

import pytest

from megatron_kappa.config import load_config
from megatron_kappa.plan import Layout, Planned, ep_overlap, plan, speed


def tiny(*sets):
    return load_config("configs/tiny.yaml", ["precision=bf16", *sets])


def with_overlap(cfg, on: bool):
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, overlap_moe_expert_parallel_comm=on))


def megatron_unpaired_no_pipelining(micro_batches: int) -> tuple[int, int, int]:
    """Megatron's combined 1F1B without stages, replayed with its layer work stubbed: (forwards
    alone, backwards alone, paired steps)."""
    from megatron.core.pipeline_parallel import combined_1f1b
    calls = []

    def step(f_step, data, f_model, n, f_input, store, b_model, *rest, **kwargs):
        calls.append((f_model is not None, b_model is not None))
        return object(), 1, None
    saved = (combined_1f1b.combined_forward_backward_step, combined_1f1b.set_streams, combined_1f1b.find_megatron_fsdp)
    try:
        combined_1f1b.combined_forward_backward_step = step
        combined_1f1b.set_streams = lambda **kw: None
        combined_1f1b.find_megatron_fsdp = lambda model: None
        config = types.SimpleNamespace(high_priority_a2a_comm_stream=False)
        combined_1f1b.combined_1f1b_schedule_for_no_pipelining(
            None, iter(()), object(), micro_batches, None, None, [], config, False, False, False,
            __import__("contextlib").nullcontext, 0, lambda first: first)
    finally:
        (combined_1f1b.combined_forward_backward_step, combined_1f1b.set_streams,
         combined_1f1b.find_megatron_fsdp) = saved
    return calls.count((True, False)), calls.count((False, True)), calls.count((True, True))


def megatron_warmup(pp: int, vpp: int, rank: int, micro_batches: int) -> int:
    """get_pp_rank_microbatches' warm-up passes of the interleaved schedule with the overlap."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches
    group = types.SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    p2p = types.SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vpp)
    return get_pp_rank_microbatches(micro_batches, vpp, pp, overlap_moe_expert_parallel_comm=True,
                                    p2p_communicator=p2p)[2]


def test_warmup_is_megatrons():
    for m in (1, 2, 3, 8):
        alone_f, alone_b, paired = megatron_unpaired_no_pipelining(m)
        assert alone_f == alone_b == ep_overlap.warmup(1, 1, 0, m) == 1 and paired == m - 1
        assert ep_overlap.paired_share(1, 1, 0, m) == paired / m
    for pp, vpp in ((2, 2), (4, 2), (2, 3), (4, 4)):
        for rank in range(pp):
            for m in (pp, 2 * pp, 4 * pp):
                assert ep_overlap.warmup(pp, vpp, rank, m) == megatron_warmup(pp, vpp, rank, m), (pp, vpp, rank, m)
    # the control: without the overlap megatron warms up one pass fewer
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches
    p2p = types.SimpleNamespace(pp_group=types.SimpleNamespace(size=lambda: 4, rank=lambda: 1),
                                virtual_pipeline_model_parallel_size=2)
    assert get_pp_rank_microbatches(16, 2, 4, p2p_communicator=p2p)[2] == ep_overlap.warmup(4, 2, 1, 8) - 1


def hidden_by_hand(off, m: int, v: int, pp: int, stage: int) -> float:
    """What the combined 1F1B hides on the slowest stage, from the off plan's own terms and
    megatron's own warm-up count."""
    t = off.speed.terms
    warm = megatron_unpaired_no_pipelining(m)[0] if pp == 1 else megatron_warmup(pp, v, stage, m)
    return min(t["expert"], t["compute"] + t["memory"]) * (m * v - warm) / (m * v)


@pytest.mark.parametrize("rates,expert_exceeds", [(speed.Rates(), True), (speed.Rates(tflops=1e-3), False)],
                         ids=["traffic-bound", "compute-bound"])
@pytest.mark.parametrize("layout", [
    Layout(2, ep=2),                # DP2: 4 micro-batches of 1 sequence
    Layout(4, tp=2, ep=2),          # TP2 EP2 DP2
    Layout(4, pp=2, ep=2, vpp=2),   # interleaved: 4 micro-batches x 2 chunks, warm-up 3 on the last stage
], ids=["EP2", "TP2xEP2", "PP2xVPP2xEP2"])
def test_overlap_hides_exactly_the_expert_traffic_it_can(layout, rates, expert_exceeds):
    cfg = tiny("train.micro_batch=1")
    off = plan(with_overlap(cfg, False), layout, rates=rates)
    on = plan(with_overlap(cfg, True), layout, rates=rates)
    t = off.speed.terms
    assert (t["expert"] > t["compute"] + t["memory"]) == expert_exceeds  # both sides of the min
    m, v, p = off.speed.micro_batches, layout.vpp, layout.pp
    assert m >= 2
    hidden = hidden_by_hand(off, m, v, p, stage=p - 1)  # the last stage (the output layer) is the slowest here
    assert hidden > 0
    bubble_scale = 1 + (p - 1) / (v * m)  # the bubble is a share of the busy time
    assert on.speed.seconds == pytest.approx(off.speed.seconds - hidden * bubble_scale, rel=1e-12)
    assert on.speed.seconds < off.speed.seconds
    # the traffic is still counted in full; "overlapped" is what is hidden, and the terms add up
    assert {k: on.speed.terms[k] for k in t if k != "bubble"} == {k: t[k] for k in t if k != "bubble"}
    assert on.speed.terms["bubble"] == pytest.approx(t["bubble"] - hidden * (p - 1) / (v * m), rel=1e-9, abs=1e-18)
    assert on.speed.terms["overlapped"] == pytest.approx(-hidden, rel=1e-9)
    assert on.speed.seconds == pytest.approx(sum(on.speed.terms.values()), rel=1e-12)
    # the trainer runs it: not planned only, and the row says the overlap is on
    assert on.planned_only == [] and on.ep_overlap and not off.ep_overlap
    # the control: the planned-only whole-all-to-all overlap hides more than the combined 1F1B
    whole = plan(with_overlap(cfg, False), layout, rates=rates, planned=Planned(overlap=("expert",)))
    assert whole.speed.seconds < on.speed.seconds and whole.planned_only == ["overlap (expert)"]


def test_one_micro_batch_hides_nothing():
    """No forward is paired with a backward when a step has one micro-batch: the control."""
    cfg = tiny("train.micro_batch=4")  # 8 sequences over DP2, 4 a micro-batch
    layout = Layout(2, ep=2)
    off, on = (plan(with_overlap(cfg, o), layout) for o in (False, True))
    assert off.speed.micro_batches == 1 and off.speed.terms["expert"] > 0
    assert on.speed.seconds == off.speed.seconds and on.speed.terms["overlapped"] == 0


def test_planned_terms_share_the_compute():
    """With the planned-only tensor overlap the all-to-all hides behind the compute those terms
    leave (min(expert, max(compute + memory − tensor, 0)) x the paired share)."""
    cfg, layout = tiny("train.micro_batch=1"), Layout(4, tp=2, ep=2)
    planned = Planned(overlap=("tensor",))
    # a GEMM rate that puts the compute between the tensor traffic and it plus the all-to-all
    # (no memory-bound experts at that HBM rate: the compute scales with 1 / tflops alone)
    base = plan(with_overlap(cfg, False), layout, rates=speed.Rates(hbm_tbs=1e9), planned=planned).speed.terms
    rates = speed.Rates(hbm_tbs=1e9, tflops=400 * base["compute"] / (base["tensor"] + base["expert"] / 2))
    off = plan(with_overlap(cfg, False), layout, rates=rates, planned=planned)
    on = plan(with_overlap(cfg, True), layout, rates=rates, planned=planned)
    t, m = off.speed.terms, off.speed.micro_batches
    left = max(t["compute"] + t["memory"] - t["tensor"], 0.0)
    assert 0 < left < t["expert"]
    assert on.speed.seconds == pytest.approx(off.speed.seconds - left * (m - 1) / m, rel=1e-12)
    assert on.planned_only == off.planned_only == ["overlap (tensor)"]
