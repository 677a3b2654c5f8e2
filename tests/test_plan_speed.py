"""The planner's step-time estimate (plan.speed): its FLOPs against torch's own
count of a real forward and backward (torch.utils.flop_counter), each traffic term and the bubble
against a hand computation, and --search ranking by it."""
import dataclasses

import pytest
import torch

from megatron_kappa import plan as planner
from megatron_kappa.config import load_config
from megatron_kappa.plan import Layout, search, speed
from tests.support.settings import MLA  # the tiny MLA settings

# per-expert matmuls (torch's counter has no formula for grouped_mm), 2 sequences of 64 tokens
SHAPE = ("model.moe.grouped_gemm=false", "model.seq_length=64", "train.global_batch=2", "train.micro_batch=2",
         "model.moe.shared_ffn_hidden_size=32")


def counted(cfg, recompute="none", modules=None):
    """torch's FLOP count of one forward (attention through the math kernel, whose matmuls it
    counts) and of the backward of the tiny model of `cfg` (matmuls only)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_kappa.model.build import build_model
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, recompute=recompute, recompute_modules=modules))
    model = build_model(cfg, "cpu")
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(cfg.model.seq_length).expand(2, -1)
    with FlopCounterMode(display=False) as forward, sdpa_kernel(SDPBackend.MATH):
        loss = model(ids, positions, None, labels=ids)
    with FlopCounterMode(display=False) as backward:
        loss.mean().backward()
    return forward.get_total_flops(), backward.get_flop_counts()["Global"]


@pytest.mark.parametrize("extra", [(), MLA], ids=["gqa", "mla"])
def test_forward_flops_equal_torchs_count(world1, extra):
    """Every matmul of a forward pass (attention projections or MLA's latents, the causal scores
    counted whole by the math kernel, dense MLP, router, routed and shared experts, output layer)."""
    cfg = load_config("configs/tiny.yaml", [*SHAPE, *extra])
    shape = planner.model_shape(cfg, Layout(1))
    tokens = 2 * cfg.model.seq_length
    layers = [speed.layer_flops(cfg.model, is_moe, tokens, 1) for is_moe in shape.moe_layers]
    output = 2 * tokens * cfg.model.hidden_size * shape.padded_vocab
    # the math kernel computes the whole s x s score matrix; the estimate counts the causal half
    want = sum(f["matmul"] + 2 * f["scores"] for f in layers) + output
    got, _ = counted(cfg)
    assert got == want
    assert got != sum(f["matmul"] + f["scores"] for f in layers) + output  # the causal half is visible


def test_backward_is_twice_the_forward_and_full_recompute_adds_one(world1):
    """Backward's matmuls are 2x the forward's; full recompute adds each layer's forward once more
    (not the output layer's), as stage_flops counts them."""
    cfg = load_config("configs/tiny.yaml", list(SHAPE))
    shape = planner.model_shape(cfg, Layout(1))
    tokens = 2 * cfg.model.seq_length
    layers = sum(speed.layer_flops(cfg.model, is_moe, tokens, 1)["matmul"] for is_moe in shape.moe_layers)
    output = 2 * tokens * cfg.model.hidden_size * shape.padded_vocab
    # the projections' matmuls (aten.mm); the scores' (bmm, from the forward's math kernel) are left out
    def mm(counts):
        return sum(v for k, v in counts.items() if str(k) == "aten.mm")
    _, plain = counted(cfg, "none")
    _, full = counted(cfg, "full")
    assert mm(plain) == 2 * (layers + output)
    assert mm(full) - mm(plain) == layers
    # model.recompute_layers 2: the first two layers only (the dense one and the first MoE one)
    _, two = counted(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, recompute_layers=2)), "full")
    first_two = sum(speed.layer_flops(cfg.model, is_moe, tokens, 1)["matmul"] for is_moe in shape.moe_layers[:2])
    assert mm(two) - mm(plain) == first_two < layers
    # stage_flops: 3 x forward, plus the layers once more under full recompute (scores included)
    scores = sum(speed.layer_flops(cfg.model, is_moe, tokens, 1)["scores"] for is_moe in shape.moe_layers)
    assert speed.stage_flops(cfg.model, shape, 0, tokens, 1, "none") == 3 * (layers + scores + output)
    assert speed.stage_flops(cfg.model, shape, 0, tokens, 1, "full") == 3 * (layers + scores + output) + layers + scores
    assert speed.stage_flops(cfg.model, shape, 0, tokens, 1, "selective") == 3 * (layers + scores + output) + scores
    two_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, recompute_layers=2))
    first_two = sum(speed.layer_flops(cfg.model, is_moe, tokens, 1)["matmul"]
                    + speed.layer_flops(cfg.model, is_moe, tokens, 1)["scores"] for is_moe in shape.moe_layers[:2])
    assert speed.stage_flops(two_cfg.model, shape, 0, tokens, 1, "full") == 3 * (layers + scores + output) + first_two


@pytest.mark.parametrize("modules,extra", [(["mlp"], ()), (["moe"], ()), (["shared_experts"], ()),
                                           (["mla_up_proj"], MLA)], ids=["mlp", "moe", "shared_experts", "mla_up_proj"])
def test_selective_modules_add_their_forward_matmuls(world1, modules, extra):
    """Each recompute module's extra backward matmuls, as torch counts them, are the parts
    recomputed_flops charges for it."""
    from megatron_kappa.config import recompute as selective
    cfg = load_config("configs/tiny.yaml", [*SHAPE, *extra])
    shape = planner.model_shape(cfg, Layout(1))
    tokens = 2 * cfg.model.seq_length
    def mm(counts):
        return sum(v for k, v in counts.items() if str(k) == "aten.mm")
    _, plain = counted(cfg, "none")
    _, chosen = counted(cfg, "selective", modules)
    chosen_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, recompute="selective",
                                                                     recompute_modules=modules))
    want = sum(speed.recomputed_flops(speed.layer_flops(cfg.model, is_moe, tokens, 1), "selective",
                                      selective.selected(chosen_cfg.model, True)) for is_moe in shape.moe_layers)
    assert want > 0 and mm(chosen) - mm(plain) == want


def test_step_terms_by_hand():
    """A small MoE on 16 GPUs, 4 per node, TP2 PP2 EP2 (DP4, EDP4), worked out on paper."""
    cfg = load_config("configs/tiny.yaml", ["model.seq_length=1024", "train.global_batch=32", "train.micro_batch=2",
                                            "model.moe.capacity_factor=null"])
    layout = Layout(16, tp=2, pp=2, ep=2, etp=1)
    rates = speed.Rates(tflops=100, nvlink_gbs=200, ib_gbs=25, latency_us=0)  # test_latency_by_hand: the messages
    params = [planner.stage_params(cfg, layout, s) for s in range(2)]
    got = speed.step_time(cfg, layout, rates=rates, gpus_per_node=4, stage_params=params)
    h, k = 64, 2  # tiny: hidden 64, top-2, 4 layers (the first dense), 2 per stage
    assert (cfg.model.hidden_size, cfg.model.moe.topk, cfg.model.num_layers, cfg.model.first_dense) == (h, k, 4, 1)
    tokens = 32 * 1024 / 4  # a DP4 replica's tokens per step: 8192
    micro = 32 // (2 * 4)  # 4 micro-batches per rank
    assert got.micro_batches == micro
    # tensor: stage 1's two MoE layers' attention blocks (5 collectives each: the routed experts
    # go through the dispatcher; tiny has no shared expert) and the output layer (3), each of
    # tokens x h x 2 bytes, half of it on the wire, NVLink (TP2 in a node)
    assert not cfg.model.moe.shared_ffn_hidden_size
    tensor = (5 * 2 + 3) * tokens * h * 2 * 0.5 / 200e9
    # expert: stage 1 has 2 MoE layers (stage 0 one): 4 x rows x h x 2 bytes x (EP - 1)/EP, rows =
    # tokens x k / TP; EP2 ranks 1 apart (ETP1) stay in a node
    expert = 4 * 2 * (tokens * k / 2) * h * 2 * 0.5 / 200e9
    # pipeline: stage 1 has one boundary, an activation forward and a gradient back, tokens x h x 2 / TP;
    # stages are TP x DP = 8 ranks apart: across nodes
    pipeline = 2 * tokens * h * 2 / 2 / 25e9
    flops = speed.stage_flops(cfg.model, planner.model_shape(cfg, layout), 1, tokens, 2, "none")
    compute = flops / 100e12
    t = got.terms
    assert t["tensor"] == pytest.approx(tensor) and t["expert"] == pytest.approx(expert)
    assert t["pipeline"] == pytest.approx(pipeline) and t["compute"] == pytest.approx(compute)
    # the bubble: (p - 1) / (v m) of the stage's busy time (the memory-bound experts' excess is
    # GEMM time: test_memory_bound_experts_by_hand)
    assert t["bubble"] == pytest.approx((compute + t["memory"] + tensor + expert + pipeline) * 1 / micro)
    # data: ZeRO-1's reduce-scatter and all-gather, (D - 1)/D on the wire, tiny's fp32 weights: the
    # gradients reduced and the weights gathered in fp32, 4 + 4 bytes a parameter (bf16: the next test);
    # DP4 ranks TP2 apart and EDP4 ranks EP x ETP = 2 apart both span 8 ranks: across nodes
    data = [(4 + 4) * sum(p.values()) * 3 / 4 / 25e9 for p in params]
    assert t["data"] == pytest.approx(max(data))
    assert got.seconds == pytest.approx(sum(t.values()))
    assert got.tokens_per_s == pytest.approx(32 * 1024 / got.seconds)


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_gradients_are_reduced_in_the_accumulation_dtype(zero_stage):
    """bf16 weights, train.grad_accum_dtype: ZeRO's traffic is the gradients' reduce-scatter in the
    dtype they are accumulated and reduced in (DeepSpeed's communication_data_type: fp32 by
    default, 4 bytes; bf16, 2) and the updated bf16 weights' all-gather (2 bytes), (D − 1)/D of
    each on the wire; the layout of test_step_terms_by_hand (DP4 and EDP4 across nodes, 25 GB/s).
    From bf16 to fp32 accumulation the gradient term doubles and nothing else moves: the step
    grows by exactly the bf16 gradients' reduce-scatter. Control: counting the gradients at the
    weights' 2 bytes (what the estimate did) misses the fp32 figure."""
    sets = ["precision=bf16", "model.seq_length=1024", "train.global_batch=32", "train.micro_batch=2",
            "model.moe.capacity_factor=null", f"zero.stage={zero_stage}"]
    layout = Layout(16, tp=2, pp=2, ep=2, etp=1)
    rates = speed.Rates(tflops=100, nvlink_gbs=200, ib_gbs=25, latency_us=0)
    got = {}
    for accum in ("bf16", "fp32"):
        cfg = load_config("configs/tiny.yaml", sets + [f"train.grad_accum_dtype={accum}"])
        params = [planner.stage_params(cfg, layout, s) for s in range(2)]
        got[accum] = speed.step_time(cfg, layout, rates=rates, gpus_per_node=4, stage_params=params)
    gradients = [2 * sum(p.values()) * 3 / 4 / 25e9 for p in params]  # bf16 gradients' reduce-scatter
    weights = [2 * sum(p.values()) * 3 / 4 / 25e9 for p in params]  # the bf16 weights' all-gather
    worst = max(range(2), key=lambda s: sum(params[s].values()))
    assert got["bf16"].terms["data"] == pytest.approx(gradients[worst] + weights[worst])
    assert got["fp32"].terms["data"] == pytest.approx(2 * gradients[worst] + weights[worst])
    assert got["fp32"].terms["data"] != pytest.approx(gradients[worst] + weights[worst])  # the control
    assert got["fp32"].seconds - got["bf16"].seconds == pytest.approx(gradients[worst])
    for term in speed.TERMS:
        if term != "data":
            assert got["fp32"].terms[term] == got["bf16"].terms[term], term


def test_search_ranks_by_estimated_speed_and_lets_ep_cross_nodes():
    """--search sorts by tokens/s and picks each layout's fastest fitting micro-batch and
    recompute; with fast links between nodes, a layout whose EP crosses nodes can lead (the old
    rule put every such layout last)."""
    cfg = load_config("configs/moe8.yaml")
    slow = search.search(cfg, 16, gpu_mem_gib=80, gpus_per_node=2, top=100)
    speeds = [r.speed.tokens_per_s for r in slow]
    assert speeds == sorted(speeds, reverse=True)
    keys = ("tp", "pp", "ep", "etp", "cp", "vpp")  # each layout once, at its fastest setting
    assert len({tuple(getattr(r.layout, k) for k in keys) for r in slow}) == len(slow)
    fast = search.search(cfg, 16, gpu_mem_gib=80, gpus_per_node=2, top=100,
                          rates=speed.Rates(ib_gbs=speed.Rates().nvlink_gbs))
    assert not fast[0].ep_inside_node or any(not r.ep_inside_node for r in fast[:3])
    # memory still decides what is listed: on 24 GiB GPUs only recompute or small micro-batches fit
    tight = search.search(cfg, 16, gpu_mem_gib=24, gpus_per_node=8, top=100)
    assert all(r.fits for r in tight)


def test_expert_imbalance_scales_the_busiest_ranks_routed_work():
    """--expert-imbalance F (dropless routing): the busiest EP rank's expert matmuls, all-to-all
    and routed-row activations are F x the balanced ones; a capacity factor caps them instead."""
    cfg = load_config("configs/tiny.yaml", ["model.seq_length=1024", "train.global_batch=32", "train.micro_batch=2",
                                            "model.moe.capacity_factor=null"])
    layout = Layout(16, tp=2, pp=2, ep=2, etp=1)
    params = [planner.stage_params(cfg, layout, s) for s in range(2)]
    even = speed.step_time(cfg, layout, rates=speed.Rates(), gpus_per_node=8, stage_params=params)
    busy = speed.step_time(cfg, layout, rates=speed.Rates(), gpus_per_node=8, stage_params=params, imbalance=1.5)
    latency = 1e-5 * (4 + 2 + 1) * 2 * 4 * 1  # the dispatcher's messages do not grow (test_latency_by_hand)
    assert busy.terms["expert"] - latency == pytest.approx(1.5 * (even.terms["expert"] - latency))
    tokens = 32 * 1024 / 4
    experts = sum(speed.layer_flops(cfg.model, True, tokens, 2)["experts"] for _ in range(2))  # stage 1: 2 MoE layers
    assert (busy.terms["compute"] - even.terms["compute"]) * speed.Rates().tflops * 1e12 == \
        pytest.approx(3 * 0.5 * experts)
    # fp32, per MoE layer: the extra half of the rows, tokens·k·etp/tp of them on a rank (TP2, ETP1)
    rows_bytes = 0.5 * tokens * 2 * 1 / 2 * (64 + 3 * 256) * 4
    got = [planner.activation_bytes(cfg, layout, 1, "none", 2, imbalance=f) for f in (1.0, 1.5)]
    in_flight, micro_tokens = 1, 2 * 1024  # stage 1 of 2 holds one micro-batch; per micro-batch
    assert got[1] - got[0] == pytest.approx(2 * rows_bytes * micro_tokens / tokens * in_flight)
    capped = load_config("configs/tiny.yaml", ["model.seq_length=1024", "train.global_batch=32", "train.micro_batch=2",
                                               "model.moe.capacity_factor=1.25"])
    assert speed.step_time(capped, layout, rates=speed.Rates(), gpus_per_node=8, stage_params=params,
                           imbalance=1.5).terms == \
        speed.step_time(capped, layout, rates=speed.Rates(), gpus_per_node=8, stage_params=params).terms


def test_expert_tp_gathers_the_rows_by_hand():
    """Expert TP: after the all-to-all, megatron's dispatcher all-gathers the routed rows over the
    ETP group and the combine reduce-scatters them (token_dispatcher.py's dispatch_postprocess and
    combine_preprocess, on the expert-TP group): per MoE layer, forward and backward, 4 collectives
    in which a rank receives (or sends) rows x (ETP - 1) x h x 2 bytes, rows = tokens x k / TP.
    The layout of test_step_terms_by_hand with ETP2 (EP2 x ETP2 = 4 ranks: one node of 4) against
    ETP1."""
    cfg = load_config("configs/tiny.yaml", ["model.seq_length=1024", "train.global_batch=32", "train.micro_batch=2",
                                            "model.moe.capacity_factor=null"])
    rates = speed.Rates(tflops=100, nvlink_gbs=200, ib_gbs=25, latency_us=0)
    terms = {}
    for etp in (1, 2):
        layout = Layout(16, tp=2, pp=2, ep=2, etp=etp)
        params = [planner.stage_params(cfg, layout, s) for s in range(2)]
        terms[etp] = speed.step_time(cfg, layout, rates=rates, gpus_per_node=4, stage_params=params).terms
    tokens, h, k = 32 * 1024 / 4, 64, 2
    gather = 4 * 2 * (tokens * k / 2) * (2 - 1) * h * 2 / 200e9  # stage 1: 2 MoE layers; ETP2 in a node
    assert terms[2]["expert"] - terms[1]["expert"] == pytest.approx(gather)
    assert terms[2]["tensor"] == terms[1]["tensor"]  # sequence parallelism's own collectives are apart
    one = Layout(16, tp=2, pp=2, ep=2, etp=2)
    params = [planner.stage_params(cfg, one, s) for s in range(2)]
    ms = speed.step_time(cfg, one, rates=speed.Rates(latency_us=1000), gpus_per_node=4, stage_params=params)
    zero = speed.step_time(cfg, one, rates=speed.Rates(latency_us=0), gpus_per_node=4, stage_params=params)
    # per MoE layer and micro-batch: over EP2 (1 peer) and over ETP2 (1 peer) the tokens' 4 and the
    # probabilities' 2 collectives each, and the counts' all-gather over EP x ETP = 4 ranks (3 peers)
    assert ms.terms["expert"] - zero.terms["expert"] == pytest.approx(1e-3 * (6 + 6 + 3) * 2 * 4)


def test_latency_by_hand():
    """Each term's messages at 1 ms each, on the layout of test_step_terms_by_hand (the slowest
    stage, 1, has two MoE layers; 4 micro-batches per step)."""
    cfg = load_config("configs/tiny.yaml", ["model.seq_length=1024", "train.global_batch=32", "train.micro_batch=2",
                                            "model.moe.capacity_factor=null"])
    layout = Layout(16, tp=2, pp=2, ep=2, etp=1)
    params = [planner.stage_params(cfg, layout, s) for s in range(2)]
    none = speed.step_time(cfg, layout, rates=speed.Rates(latency_us=0), gpus_per_node=4, stage_params=params).terms
    ms = speed.step_time(cfg, layout, rates=speed.Rates(latency_us=1000), gpus_per_node=4, stage_params=params).terms
    micro = 4
    # 5 per attention block, 3 for the output layer, 3 all-reduces for the loss's one chunk; TP2: 1 peer
    assert ms["tensor"] - none["tensor"] == pytest.approx(1e-3 * (5 * 2 + 3 + 3) * micro * 1)
    # stage 1: 2 MoE layers, EP2: the tokens' 4 all-to-alls, the probabilities' 2, the counts' all-gather
    assert ms["expert"] - none["expert"] == pytest.approx(1e-3 * (4 + 2 + 1) * 2 * micro * 1)
    assert ms["pipeline"] - none["pipeline"] == pytest.approx(1e-3 * 2 * micro)  # one boundary, there and back
    assert ms["data"] - none["data"] == pytest.approx(1e-3 * 2 * (3 + 3))  # DP4 and EDP4 rings
    assert ms["context"] == none["context"] == 0


def test_every_recompute_module_is_known_to_each_estimate():
    """megatron_kappa/config/recompute.py owns the module names: each one, alone, makes the
    activation estimate keep less than no recompute (the estimate has its rule), and its FLOP
    parts are parts layer_flops computes (test_selective_modules_add_their_forward_matmuls checks
    them against torch's count)."""
    from megatron_kappa.config import recompute as selective
    from megatron_kappa.plan.activations import activation_bytes
    cfg = load_config("configs/tiny.yaml", ["model.moe.grouped_gemm=true", "model.moe.shared_ffn_hidden_size=32",
                                            *MLA])
    layout = Layout(1)
    plain = activation_bytes(cfg, layout, 0, "none", 1)
    parts = speed.layer_flops(cfg.model, True, 64, 1).keys() | speed.layer_flops(cfg.model, False, 64, 1).keys()
    for name, module in selective.MODULES.items():
        chosen = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, recompute="selective",
                                                                    recompute_modules=[name]))
        assert module.needs(chosen.model) is None, name
        assert activation_bytes(chosen, layout, 0, "selective", 1) < plain, name
        assert set(module.flops) <= parts, name


def test_memory_bound_experts_by_hand():
    """The routed experts' GEMMs as a roofline (speed.expert_memory_seconds): each takes the longer
    of its FLOPs at --tflops and its bytes at --hbm-tbs; "memory" is the excess. The layout of
    test_step_terms_by_hand at 2 TB/s, where tiny's (fp32) experts are memory-bound. Per micro-batch a
    rank's expert sees M = etp·ep·k·s·b / (cp·tp·E) = 2·2·2048 / (2·4) = 1024 rows; the bytes
    are each operand's and the result's, counted from real tensors, the FLOPs torch's own count."""
    from torch.utils.flop_counter import FlopCounterMode
    cfg = load_config("configs/tiny.yaml", ["model.seq_length=1024", "train.global_batch=32", "train.micro_batch=2",
                                            "model.moe.capacity_factor=null"])
    layout = Layout(16, tp=2, pp=2, ep=2, etp=1)
    rates = speed.Rates(tflops=100, nvlink_gbs=200, ib_gbs=25, latency_us=0, hbm_tbs=2.0)
    params = [planner.stage_params(cfg, layout, s) for s in range(2)]
    assert speed.expert_gemm_rows(cfg.model, cfg.train, layout) == 1024
    excess = 0.0
    for k, n in ((64, 2 * 256), (256, 64)):  # fc1 (gate and up), fc2; h 64, F 256
        a, b = torch.empty(1024, k), torch.empty(k, n)  # tiny runs in fp32
        with FlopCounterMode(display=False) as counter:
            out = a @ b
        moved = a.nbytes + b.nbytes + out.nbytes
        excess += max(0.0, moved / 2e12 - counter.get_total_flops() / 100e12)
    # stage 1: 2 MoE layers, 2 experts a rank (4 / EP2), 4 micro-batches, forward + 2 backward passes
    want = excess * 2 * 2 * 4 * 3
    got = speed.step_time(cfg, layout, rates=rates, gpus_per_node=4, stage_params=params)
    t = got.terms
    assert want > 0 and t["memory"] == pytest.approx(want)
    assert t["bubble"] == pytest.approx((t["compute"] + t["memory"] + t["tensor"] + t["expert"] + t["pipeline"]) / 4)
    assert got.seconds == pytest.approx(sum(t.values()))
    # the experts recomputed (selective "moe"): a fourth pass; EP4 gives each expert twice the rows
    again = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, recompute="selective",
                                                               recompute_modules=("moe",)))
    assert speed.step_time(again, layout, rates=rates, gpus_per_node=4,
                           stage_params=params).terms["memory"] == pytest.approx(want * 4 / 3)
    # full recompute of the stage's first layer only (model.recompute_layers 1): 4 + 3 passes
    first = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, recompute="full", recompute_layers=1))
    assert speed.step_time(first, layout, rates=rates, gpus_per_node=4,
                           stage_params=params).terms["memory"] == pytest.approx(want * 7 / 6)
    assert speed.expert_gemm_rows(cfg.model, cfg.train, Layout(16, tp=2, pp=2, ep=4, etp=1)) == 2048
    # controls: at 10 TB/s these GEMMs are compute-bound (no memory term), and the FLOPs-only
    # compute term is the same either way
    fast = speed.step_time(cfg, layout, rates=dataclasses.replace(rates, hbm_tbs=10.0), gpus_per_node=4,
                           stage_params=params).terms
    assert fast["memory"] == 0 and fast["compute"] == t["compute"]


def test_search_trades_micro_batch_for_memory_bound_experts():
    """With the experts' GEMMs bound by a slow HBM (0.05 TB/s), the search's fastest layouts run
    micro-batch 8 (each expert reads its weights once per micro-batch: fewer, larger ones read them
    less often) and the largest EP first (more rows per expert); the control, an HBM that bounds
    nothing, keeps micro-batch 1 and puts plain DP first (the FLOPs alike, the all-to-all not free)."""
    cfg = load_config("configs/tiny.yaml", ["train.global_batch=64", "model.moe.capacity_factor=null"])
    slow = search.search(cfg, 4, gpu_mem_gib=80, gpus_per_node=4, top=None,
                         rates=speed.Rates(hbm_tbs=0.05, latency_us=0))
    assert all(r.micro_batch == 8 for r in slow[:5]) and slow[0].layout.ep == 4
    free = search.search(cfg, 4, gpu_mem_gib=80, gpus_per_node=4, top=None,
                         rates=speed.Rates(hbm_tbs=1e6, latency_us=0))
    assert all(r.micro_batch == 1 for r in free[:5]) and free[0].layout.ep == 1
    assert all(r.speed.terms["memory"] == 0 for r in free)


def test_attention_rate_and_fixed_layer_time_by_hand():
    """--attention-tflops puts the attention cores at their own rate and --layer-ms adds a fixed
    time per layer and micro-batch, on test_step_terms_by_hand's layout worked out on paper: stage
    1 holds 2 of tiny's layers, each with QKᵀ and AV over the causal half of 1,024² for its 4
    heads of 16 (64 wide, split over TP2), forward and twice that backward; 4 micro-batches. With
    the defaults (the control) the terms are the same as before, "fixed" 0."""
    cfg = load_config("configs/tiny.yaml", ["model.seq_length=1024", "train.global_batch=32", "train.micro_batch=2",
                                            "model.moe.capacity_factor=null"])
    layout, s, tokens, micro = Layout(16, tp=2, pp=2, ep=2, etp=1), 1024, 32 * 1024 / 4, 4
    base = dict(tflops=100, nvlink_gbs=200, ib_gbs=25, latency_us=0)
    params = [planner.stage_params(cfg, layout, st) for st in range(2)]
    plain = speed.step_time(cfg, layout, rates=speed.Rates(**base), gpus_per_node=4, stage_params=params)
    got = speed.step_time(cfg, layout, rates=speed.Rates(**base, attention_tflops=25, layer_ms=2.0), gpus_per_node=4,
                          stage_params=params)
    scores = 3 * 2 * (2 * tokens * s * (64 + 64) / 2 / 2)  # 3 passes, 2 layers: QKᵀ and AV (64 wide each), half, / TP
    shape = planner.model_shape(cfg, layout)
    assert speed.stage_flops(cfg.model, shape, 1, tokens, 2, "none", scores_only=True) == scores
    t, p = got.terms, plain.terms
    assert t["compute"] == pytest.approx(p["compute"] - scores / 100e12 + scores / 25e12)
    assert t["fixed"] == pytest.approx(2.0e-3 * micro * 2) and p["fixed"] == 0
    assert {k: v for k, v in t.items() if k not in ("compute", "fixed", "bubble")} == \
        {k: v for k, v in p.items() if k not in ("compute", "fixed", "bubble")}
    busy = t["compute"] + t["memory"] + t["fixed"] + t["tensor"] + t["expert"] + t["pipeline"]
    assert t["bubble"] == pytest.approx(busy / micro) and got.seconds == pytest.approx(sum(t.values()))
    # full recompute does the scores again once: 4 passes
    full = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, recompute="full"))
    assert speed.stage_flops(full.model, planner.model_shape(full, layout), 1, tokens, 2, "full", scores_only=True) \
        == scores * 4 / 3


def test_fp8_speedup_scales_the_gemms_not_a_separate_attention_rate():
    """--fp8-speedup (default 2, the peak ratio) divides an fp8 model's GEMM time; at 1.25 the
    compute term is exactly 2 / 1.25 times the default's. With --attention-tflops the attention
    cores keep their own rate whatever the precision. A bf16 model (the control) ignores it."""
    sets = ["model.seq_length=1024", "train.global_batch=32", "train.micro_batch=2", "model.moe.capacity_factor=null"]
    layout = Layout(16, tp=2, pp=2, ep=2, etp=1)
    base = dict(tflops=100, nvlink_gbs=200, ib_gbs=25, latency_us=0, hbm_tbs=1e6)
    for precision in ("fp8", "bf16"):
        cfg = load_config("configs/tiny.yaml", [*sets, f"precision={precision}"])
        params = [planner.stage_params(cfg, layout, st) for st in range(2)]
        compute = {k: speed.step_time(cfg, layout, rates=speed.Rates(**base, fp8_speedup=k), gpus_per_node=4,
                                      stage_params=params).terms["compute"]
                   for k in (2.0, 1.25)}
        assert compute[1.25] == pytest.approx(compute[2.0] * (2 / 1.25 if precision == "fp8" else 1))
    cfg = load_config("configs/tiny.yaml", [*sets, "precision=fp8"])
    scores = speed.stage_flops(cfg.model, planner.model_shape(cfg, layout), 1, 32 * 1024 / 4, 2, "none",
                               scores_only=True)
    params = [planner.stage_params(cfg, layout, st) for st in range(2)]
    split = {k: speed.step_time(cfg, layout, rates=speed.Rates(**base, fp8_speedup=k, attention_tflops=50),
                                gpus_per_node=4, stage_params=params)
             .terms["compute"] for k in (2.0, 1.25)}
    gemms = {k: split[k] - scores / 50e12 for k in split}  # the rest scales, the scores do not
    assert gemms[1.25] == pytest.approx(gemms[2.0] * 2 / 1.25)
