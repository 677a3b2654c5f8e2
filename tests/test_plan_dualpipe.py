"""DualPipe as the planner models it (plan.dualpipe, planned only): the micro-batches
each rank holds against a replay of DualPipe's own schedule (deepseek-ai/DualPipe 3da1bbe,
dualpipe.py:358-420, its counts only), the bubble against the report's formula by hand, each
rank's parameters, activations and step terms by hand on tiny (8 layers: PP4 gives each stage 2),
and the layouts DualPipe cannot run refused."""
import pytest

from megatron_kappa import plan as planner
from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.plan import Layout, dualpipe, speed
from megatron_kappa.plan.planned import Planned

DUAL = Planned(dualpipe=True)


def tiny(*sets):
    return load_config("configs/tiny.yaml", ["precision=bf16", "train.micro_batch=1", "model.num_layers=8",
                                             "train.global_batch=16", *sets])


def replay(pp: int, rank: int, chunks: int) -> tuple[dict[int, int], int]:
    """DualPipe.step's eight steps on pipeline rank `rank` with `chunks` micro-batches, counting
    the forward chunks alive (run, their backward not yet) of each stage the rank holds: its
    module[phase ^ is_in_second_half] runs a phase's chunks, module[0] = stage `rank`, module[1]
    = stage pp − 1 − rank (examples/example_dualpipe.py:138). An overlapped F&B runs its forward
    first. Returns the peak per stage and the peak of their sum."""
    n, h, half = pp // 2, min(rank, pp - 1 - rank), chunks // 2
    module = (rank, pp - 1 - rank)
    stage = {phase: module[phase ^ (rank >= n)] for phase in (0, 1)}
    alive, peak, both = {0: 0, 1: 0}, {0: 0, 1: 0}, 0

    def f(phase):
        nonlocal both
        alive[phase] += 1
        peak[phase] = max(peak[phase], alive[phase])
        both = max(both, alive[0] + alive[1])

    def b(phase):
        alive[phase] -= 1
        assert alive[phase] >= 0

    for _ in range((n - h - 1) * 2):  # step 1: nF0
        f(0)
    for _ in range(h + 1):  # step 2: nF0F1
        f(0), f(1)
    for _ in range(n - h - 1):  # step 3: nB1W1F1
        b(1), f(1)
    for _ in range(half - pp + h + 1):  # step 4: nF0B1F1B0
        f(0), b(1), f(1), b(0)
    for _ in range(n - h - 1):  # step 5: nB1F1B0
        b(1), f(1), b(0)
    for _ in range(h + 1):  # step 6: nB1B0
        b(1), b(0)
    for _ in range(n - h - 1):  # step 7: nWB0
        b(0)
    assert alive == {0: 0, 1: 0}  # every forward got its backward
    return {stage[phase]: peak[phase] for phase in (0, 1)}, both


@pytest.mark.parametrize("pp", [2, 4, 8, 16])
def test_in_flight_equals_a_replay_of_dualpipes_schedule(pp):
    for chunks in (2 * pp, 2 * pp + 2, 4 * pp):
        for rank in range(pp):
            peaks, both = replay(pp, rank, chunks)
            assert [peaks[s] for s in dualpipe.stages_of(pp, rank)] == list(dualpipe.in_flight(pp, rank))
            assert both == pp + 1  # the README's table: PP + 1 chunks' activations per device
    # the control: 1F1B's stage 0 holds pp, DualPipe's rank 0 pp of stage 0 and 1 of the last stage
    assert dualpipe.in_flight(4, 0) == (4, 1) and dualpipe.in_flight(4, 3) == (4, 1)
    assert dualpipe.stages_of(4, 3) == (0, 3) and dualpipe.stages_of(4, 2) == (1, 2)


def test_bubble_by_hand():
    """(p/2 − 1)(F&B + B − 3W) with F&B = F + B, B = 2F + R, W = F, in chunks of F + B."""
    # 8 stages, 16 micro-batches, 12 s busy: a chunk is 0.75 s = 3F, so F = 0.25 s; 3 × 2F = 1.5 s
    assert dualpipe.bubble(12.0, 8, 16, forward=1.0, recomputed=0.0) == pytest.approx(3 * 0.75 * 2 / 3)
    # full recompute (R = F): a chunk is 4F, the bubble 3 × 4F, one chunk per idle slot
    assert dualpipe.bubble(12.0, 8, 16, forward=1.0, recomputed=1.0) == pytest.approx(3 * 0.75)
    assert dualpipe.bubble(12.0, 2, 16, forward=1.0, recomputed=0.0) == 0.0  # two stages: none
    # 1F1B idles (p − 1) chunks: 7 × 0.75 s here
    assert dualpipe.bubble(12.0, 8, 16, 1.0, 0.0) < 12.0 * 7 / 16


def test_each_rank_holds_its_two_stages_by_hand():
    cfg = tiny()
    layout = Layout(4, pp=4)
    stages = [planner.stage_params(cfg, layout, s) for s in range(4)]
    plans = planner.plan(cfg, layout, gpu_mem_gib=80, planned=DUAL)
    assert plans.planned_only == ["DualPipe"]
    assert f"most loaded   pipeline rank {plans.most_loaded.stage} of 4 (stages 0 and 3: DualPipe)" \
        in planner.render(plans)
    assert "most loaded   pipeline stage " in planner.render(planner.plan(cfg, layout, gpu_mem_gib=80))
    for rank, (h, mirror) in enumerate(((0, 3), (1, 2), (1, 2), (0, 3))):
        got = planner.plan_stage(cfg, layout, rank, planned=DUAL)
        assert got.params == {k: stages[h][k] + stages[mirror][k] for k in stages[h]}
        assert got.bytes["weights"] == 2 * sum(stages[h].values()) + 2 * sum(stages[mirror].values())
        # the micro-batches in flight of each stage (replayed above), each stage's one micro-batch
        one = [planner.activation_bytes(cfg, layout, s, "none", 1, held=1) for s in (h, mirror)]
        held = {0: (4, 1), 1: (3, 2)}[h]
        assert got.bytes["activations"] == held[0] * one[0] + held[1] * one[1]
    # rank 0 holds the embedding and the output layer: both ends of the model
    assert planner.plan_stage(cfg, layout, 0, planned=DUAL).params["embedding"] == stages[0]["embedding"] > 0
    assert planner.plan_stage(cfg, layout, 0, planned=DUAL).params["output"] == stages[3]["output"] > 0
    # the control: 1F1B's rank 0 holds its own stage only, 4 micro-batches of it
    plain = planner.plan_stage(cfg, layout, 0)
    assert plain.params == stages[0]
    assert plain.bytes["activations"] == pytest.approx(4 * one_micro(cfg, layout, 0))
    # with activation offload, two chunks of the larger stage
    offload = Planned(dualpipe=True, offload_activations=True)
    assert planner.plan_stage(cfg, layout, 0, planned=offload).bytes["activations"] == \
        2 * max(one_micro(cfg, layout, 0), one_micro(cfg, layout, 3))


def one_micro(cfg, layout, stage):
    return planner.activation_bytes(cfg, layout, stage, "none", 1, held=1)


def test_step_terms_by_hand():
    """tiny on 8 GPUs of one node, PP4 DP2: each rank's compute and traffic are the mean of its two
    stages' (half the micro-batches through each); its ZeRO traffic both stages', plus the mirror's
    all-reduce of both stages' gradients (4 bytes each: fp32 accumulation, the default); the bubble
    DualPipe's. No latency, so that
    rank 0 (the embedding, the output layer) is the slowest."""
    cfg = tiny()
    layout = Layout(8, pp=4)
    rates = speed.Rates(tflops=100, nvlink_gbs=200, ib_gbs=25, latency_us=0)
    params = [planner.stage_params(cfg, layout, s) for s in range(4)]
    got = speed.step_time(cfg, layout, rates=rates, gpus_per_node=8, stage_params=params, dualpipe=True)
    shape = planner.model_shape(cfg, layout)
    tokens = 16 * 128 / 2  # the replica's tokens
    compute = [speed.stage_flops(cfg.model, shape, s, tokens, 1, "none") / 100e12 for s in range(4)]
    ranks = [(compute[0] + compute[3]) / 2, (compute[1] + compute[2]) / 2]
    assert got.terms["compute"] == pytest.approx(max(ranks))
    # ZeRO over DP2 on NVLink: the fp32 gradients' reduce-scatter (4 bytes a parameter) and the bf16
    # weights' all-gather (2), half on the wire (the experts over EDP 2 alike); then the mirror's
    # exchange of both stages' fp32 gradients
    def zero(p):
        return (4 + 2) * sum(p.values()) / 2 / 200e9
    data = [zero(params[h]) + zero(params[m]) + 4 * (sum(params[h].values()) + sum(params[m].values())) / 200e9
            for h, m in ((0, 3), (1, 2))]
    assert got.terms["data"] == pytest.approx(max(data))
    busy = sum(got.terms[k] for k in ("compute", "memory", "tensor", "context", "expert", "pipeline"))
    micro = 16 // 2
    assert got.terms["bubble"] == pytest.approx((4 / 2 - 1) * busy / micro * 2 / 3)
    assert got.seconds == pytest.approx(sum(got.terms.values()))
    # 2 messages of the mirror's all-reduce beside ZeRO's 2 of each of the two stages' 2 groups
    late = speed.step_time(cfg, layout, rates=speed.Rates(tflops=100, nvlink_gbs=200, ib_gbs=25, latency_us=1000),
                           gpus_per_node=8, stage_params=params, dualpipe=True)
    assert late.terms["data"] - got.terms["data"] == pytest.approx(1e-3 * (2 + 2 * 2 * 2))
    # the control: 1F1B's bubble on the same layout is (p − 1) chunks of its slowest stage
    one = speed.step_time(cfg, layout, rates=rates, gpus_per_node=8, stage_params=params)
    assert one.terms["bubble"] > got.terms["bubble"]
    # across nodes (2 GPUs a node) the mirror's exchange goes over InfiniBand
    far = speed.step_time(cfg, layout, rates=rates, gpus_per_node=2, stage_params=params, dualpipe=True)
    assert far.terms["data"] > got.terms["data"]


def test_layouts_dualpipe_cannot_run_are_refused():
    cfg = tiny()
    for sets, layout, message in ((["model.num_layers=6"], Layout(3, pp=3), "even number of pipeline stages, got 3"),
                                  ([], Layout(2, pp=2, vpp=2), "DualPipe has no virtual stages, got 2")):
        with pytest.raises(ConfigError, match=message):
            planner.plan(tiny(*sets), layout, gpu_mem_gib=80, planned=DUAL)
        assert planner.plan(tiny(*sets), layout, gpu_mem_gib=80).fits  # the control: 1F1B runs it
    few = tiny("train.global_batch=6")  # 6 micro-batches for 4 stages: DualPipe needs 8
    with pytest.raises(ConfigError, match=r"at least 2 × PP = 8, got 6 \(TP1 PP4"):
        planner.plan(few, Layout(4, pp=4), gpu_mem_gib=80, planned=DUAL)
    assert planner.plan(few, Layout(4, pp=4), gpu_mem_gib=80).fits  # the control: 1F1B runs it
    # no stages, no schedule: DualPipe changes nothing and is not named
    assert planner.plan(cfg, Layout(1), gpu_mem_gib=80, planned=DUAL) == planner.plan(cfg, Layout(1), gpu_mem_gib=80)


def test_search_tries_dualpipe_beside_1f1b():
    """With DualPipe asked for, each layout with stages is planned both ways (DualPipe's second
    copy of the parameters may not fit where 1F1B does); the faster that fits is kept."""
    from megatron_kappa.plan.search import schedules, search
    cfg = tiny()
    assert schedules(DUAL, Layout(4, pp=4)) == [DUAL, Planned()] and schedules(DUAL, Layout(4)) == [DUAL]
    rates = speed.Rates(latency_us=0)  # at 10 µs a message tiny's ZeRO traffic, doubled by DualPipe, decides
    rows = search(cfg, 8, gpu_mem_gib=80, gpus_per_node=8, top=None, rates=rates, planned=DUAL)
    dual = [r for r in rows if "DualPipe" in r.planned_only]
    assert dual and all(r.layout.pp % 2 == 0 and r.layout.vpp == 1 for r in dual)
    assert any(r.layout.vpp > 1 for r in rows)  # interleaved 1F1B layouts are still searched
    # on a GPU too small for DualPipe's two stages, the same layout comes back under 1F1B
    layout = Layout(8, pp=4)
    one, two = (planner.plan(cfg, layout, gpu_mem_gib=80, planned=p).most_loaded.total_bytes for p in (Planned(), DUAL))
    assert two > one
    small = (one + two) / 2 / 2 ** 30 / planner.HEADROOM  # GiB: 1F1B fits, DualPipe does not
    assert not planner.plan(cfg, layout, gpu_mem_gib=small, planned=DUAL).fits
    assert planner.plan(cfg, layout, gpu_mem_gib=small).fits
    label = planner.plan(cfg, layout, gpu_mem_gib=80).label
    row = next(r for r in search(cfg, 8, gpu_mem_gib=small, gpus_per_node=8, top=None, rates=rates,
                                 planned=DUAL) if r.label == label)
    assert "DualPipe" not in row.planned_only
