"""The memory planner (plan): its per-rank parameter counts against meta-device
builds of every rank of a grid of layouts (slow: one torchrun of 4 processes), its byte
arithmetic, the verdict, --search and the command line."""
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_kappa import plan as planner
from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.plan import GIB, Layout, search, speed
from megatron_kappa.plan.planned import Planned
from megatron_kappa.plan.routing import routed_rows_per_rank
from tests.support.settings import MLA  # the tiny MLA settings

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
SHAPE = ["model.moe.shared_ffn_hidden_size=128", "model.qk_layernorm=true"]
GRID = {  # name: (tp, pp, ep, etp) over 4 ranks
    "dp4": (1, 1, 1, 1), "tp2": (2, 1, 1, 2), "tp4": (4, 1, 1, 4), "ep4": (1, 1, 4, 1),
    "tp2_ep2_etp1": (2, 1, 2, 1), "tp2_ep2_etp2": (2, 1, 2, 2), "pp2": (1, 2, 1, 1), "pp4": (1, 4, 1, 1),
    "pp2_tp2": (2, 2, 1, 2), "pp2_ep2": (1, 2, 2, 1), "pp2_ep2_etp1_tp2": (2, 2, 2, 1),
}

DROPLESS = ("model.moe.capacity_factor=null",)
ROWS = {  # name: (tp, pp, ep, etp), more settings; one forward and backward each
    "rows_tp2_ep2_etp1": ((2, 1, 2, 1), ()), "rows_tp2_ep2_etp2": ((2, 1, 2, 2), ()), "rows_ep4": ((1, 1, 4, 1), ()),
    "rows_tp2_etp2": ((2, 1, 1, 2), ()), "rows_ep2_dp2": ((1, 1, 2, 1), ()),
    "rows_tp2_no_shared": ((2, 1, 2, 1), ("model.moe.shared_ffn_hidden_size=null",)),
    "rows_tp2_mla": ((2, 1, 2, 1), MLA), "rows_tp4_loss_chunks": ((4, 1, 1, 4), ("model.cross_entropy_chunk=200",))}


def rows_case(name):
    lay, extra = ROWS[name]
    return overrides(*lay, (*DROPLESS, *extra))


def overrides(tp, pp, ep, etp, extra=()):
    return SHAPE + [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.ep={ep}", f"parallel.etp={etp}", *extra]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    cases = [{"name": n, "overrides": overrides(*lay)} for n, lay in GRID.items()]
    for name in ROWS:  # dropless: every routed row reaches an expert
        cases.append({"name": name, "overrides": rows_case(name), "rows": True})
    cases.append({"name": "sandwich_pp2_plain", "overrides": overrides(1, 2, 2, 1, (
        "model.layout=sandwich", "model.kappa.enabled=false", "model.moe.shared_ffn_hidden_size=null"))})
    for name, lay in (("nanochat_tp2_ep2_etp2", (2, 1, 2, 2)), ("nanochat_pp2_tp2", (2, 2, 1, 2))):
        cases.append({"name": name, "overrides": overrides(*lay, ("model.block=nanochat",))})
    for name, lay in (("mla_tp2_ep2_etp1", (2, 1, 2, 1)), ("mla_pp2_tp2", (2, 2, 1, 2))):
        cases.append({"name": name, "overrides": overrides(*lay, MLA)})
    cases.append({"name": "mtp_tp2_ep2_etp2", "overrides": overrides(2, 1, 2, 2, ("model.mtp.num_layers=2",))})
    cases.append({"name": "mtp_pp2_tp2", "overrides": overrides(2, 2, 1, 2, ("model.mtp.num_layers=1",))})
    cases.append({"name": "uneven_pp2_tp2", "overrides": overrides(2, 2, 1, 2, (
        "model.num_layers=5", "parallel.first_stage_layers=3"))})
    (tmp / "plan.json").write_text(json.dumps(cases))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={WORLD}", "tests/support/plan_worker.py", str(tmp / "plan.json"),
                           str(tmp / "out.json")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return cases, json.loads((tmp / "out.json").read_text())


@pytest.mark.slow
def test_parameter_counts_equal_meta_builds_of_every_rank(built):
    cases, results = built
    assert len(results) == len(cases)
    for case in cases:
        cfg = load_config("configs/tiny.yaml", case["overrides"])
        layout = planner.layout_of(cfg.parallel, WORLD)
        ranks = results[case["name"]]
        assert sorted({r["stage"] for r in ranks}) == list(range(layout.pp))
        for rank, got in enumerate(ranks):
            want = {k: v for k, v in planner.stage_params(cfg, layout, got["stage"]).items() if v}
            assert got["counts"] == want, (case["name"], rank, got, want)
        if "model.moe.shared_ffn_hidden_size=null" not in case["overrides"]:
            assert any("shared_experts" in r["counts"] for r in ranks)


@pytest.mark.slow
def test_routed_rows_per_rank_equal_what_the_dispatcher_delivers(built):
    """The activation estimate's routed rows per rank (tokens·k·etp/tp: each TP rank routes its
    sequence-parallel share, megatron's dispatcher gathers the rows over expert TP) against the
    rows each rank's experts received in one forward, averaged over the ranks (dropless routing:
    the average is exact whatever the balance). The negative control is the ETP1 case: counting
    every token's rows on each TP rank, as the estimate did, gives twice the rows received."""
    _, results = built
    for name in ROWS:
        cfg = load_config("configs/tiny.yaml", rows_case(name))
        layout = planner.layout_of(cfg.parallel, WORLD)
        received = [r["rows"] for r in results[name]]
        moe_layers = len(received[0])
        assert moe_layers == cfg.model.num_layers - cfg.model.first_dense > 0
        average = sum(map(sum, received)) / WORLD / moe_layers
        tokens = cfg.model.seq_length * cfg.train.micro_batch
        assert average == routed_rows_per_rank(cfg.model.moe, layout, tokens), (name, received)


@pytest.mark.slow
def test_estimated_messages_equal_the_collectives_megatron_calls(built):
    """The step-time estimate's messages per micro-batch against the collectives each rank called
    in one forward and backward (with the loss), each call on n ranks counted n - 1, every rank:
    - through megatron's alltoall dispatcher (speed.dispatcher_messages: the tokens' and
      probabilities' all-to-alls over EP, their all-gathers and reduce-scatters over expert TP,
      forward and backward, and the counts' all-gather), on the dispatcher's groups;
    - sequence parallelism's on the TP group (speed.tensor_collectives: 5 per TP-split block, the
      embedding's 2, the output layer's 3, 3 all-reduces per loss chunk, and MLA's narrow gathers
      3 times each), with and without a shared expert, MLA (with a q latent: without one megatron
      needs the fused norm + linear the CPU path lacks), and a loss in 3 chunks.
    The earlier counts (4 all-to-alls per MoE layer and no expert TP; 8 per layer on TP) gave 36
    for EP4 against 63 and 32 for TP2 against 48."""
    _, results = built
    for name in ROWS:
        cfg = load_config("configs/tiny.yaml", rows_case(name))
        layout = planner.layout_of(cfg.parallel, WORLD)
        moe_layers = cfg.model.num_layers - cfg.model.first_dense
        want = moe_layers * speed.dispatcher_messages(layout.ep, layout.etp)
        assert [r["messages"] for r in results[name]] == [want] * WORLD, name
        _, count = speed.tensor_collectives(cfg.model, cfg.train, planner.model_shape(cfg, layout), 0)
        assert [r["tensor_messages"] for r in results[name]] == [count * (layout.tp - 1)] * WORLD, (name, count)


def test_parameter_counts_sum_to_the_full_model():
    """Negative-control style cross-check without processes: summed over the ranks that hold
    distinct shards, the counts give the full model's count from megatron_kappa.summary."""
    for block in ("megatron", "nanochat"):
        _counts_sum_to_full(load_config("configs/tiny.yaml", [*SHAPE, f"model.block={block}"]))
    _counts_sum_to_full(load_config("configs/tiny.yaml", [*SHAPE, *MLA]))


def _counts_sum_to_full(cfg):
    full = planner.stage_params(cfg, Layout(1), 0)
    for tp, pp, ep, etp in GRID.values():
        layout = Layout(WORLD, tp, pp, ep, etp)
        total = dict.fromkeys(full, 0)
        for stage in range(pp):
            for kind, n in planner.stage_params(cfg, layout, stage).items():
                shards = (ep * etp) if kind in planner.EXPERT_KINDS else (
                    1 if kind in ("norm", "router") else tp)
                total[kind] += n * shards
        assert total == full, (tp, pp, ep, etp)


def test_state_bytes_follow_zero_stage():
    """bf16 accumulation (train.grad_accum_dtype bf16); fp32's: the next test."""
    cfg1 = load_config("configs/tiny.yaml", ["precision=bf16", "zero.stage=1", "train.grad_accum_dtype=bf16"])
    cfg2 = load_config("configs/tiny.yaml", ["precision=bf16", "zero.stage=2", "train.grad_accum_dtype=bf16"])
    params = {"attention": 1000, "experts": 4000}
    layout = Layout(8, 1, 1, 4, 1)  # DP 8, EDP 2
    one, two = planner.state_bytes(params, cfg1, layout), planner.state_bytes(params, cfg2, layout)
    assert one["weights"] == two["weights"] == 2 * 5000
    assert one["master"] == two["master"] == 4 * 1000 / 8 + 4 * 4000 / 2
    assert one["moments"] == 8 * 1000 / 8 + 8 * 4000 / 2
    g1, g2 = planner.gradient_bytes(params, cfg1, layout), planner.gradient_bytes(params, cfg2, layout)
    assert g1["step"] == g2["step"] and g1["partitions"] == 2 * (1000 / 8 + 4000 / 2)
    assert g1["largest_group"] == 4000 / 2  # the experts, reduced over EDP 2, are a group of their own
    assert g1["step"] == g1["partitions"] + g1["edges"] + 4 * 4000 / 2
    assert g1["backward"] == 2 * 5000  # ZeRO-1: autograd's full bf16 gradients
    # ZeRO-2: the partitions, up to two whole tensors across each group's edges, the tensor just produced
    assert g1["edges"] == 2 * (min(1000 - 1000 / 8, 2 * 1000) + min(4000 - 4000 / 2, 2 * 4000))
    assert g2["backward"] == g2["partitions"] + g2["edges"] + 2 * 4000
    assert one["gradients"] == max(g1["backward"], g1["step"]) and two["gradients"] == g2["step"]
    aurora = planner.state_bytes(params, load_config("configs/tiny.yaml", ["precision=bf16", "train.optimizer=aurora",
                                                                          "train.grad_clip=0"]), layout)
    # Muon/Aurora: a momentum over the whole tensors of each Muon group's partition (its edges: here
    # every tensor, tiny's being larger than these groups) in the gradients' dtype (fp32 accumulation:
    # 4 bytes), and DeepSpeed's staged copy of it (plan.state.muon_momentum_bytes; measured against
    # DeepSpeed's buffers in tests/test_plan_muon_state.py): 2 × 4 × (1000 + 4000), where the count
    # before the staged copy was found held one fp32 momentum of the partitions (one["moments"] / 2)
    assert aurora["moments"] == 2 * 4 * ((1000 / 8 + (1000 - 1000 / 8)) + (4000 / 2 + (4000 - 4000 / 2)))
    aurora_bf16 = planner.state_bytes(params, load_config("configs/tiny.yaml", [
        "precision=bf16", "train.optimizer=aurora", "train.grad_clip=0", "train.grad_accum_dtype=bf16"]), layout)
    assert aurora_bf16["moments"] == aurora["moments"] / 2  # bf16 gradients: a bf16 momentum
    assert planner.bucket_bytes(cfg1.precision, cfg1.train.grad_accum_dtype) == 5e8 * 2


def test_gradient_bytes_with_fp32_accumulation():
    """train.grad_accum_dtype fp32 (the default) by hand, on the groups of the test above (DP 8,
    EDP 2; attention 1000, experts 4000; tiny's tensors are larger than both, so a group's
    largest tensor is the group): fp32 partitions; the AdamW groups' exact, the Muon/Aurora
    groups' with their edges and the copy of the largest at the step; ZeRO-1's backward an fp32
    accumulator per parameter and the bf16 tensor being added; an fp32 bucket. fp32 weights
    and bf16 accumulation are unchanged by the key (the memory test below measures both)."""
    params, layout = {"attention": 1000, "experts": 4000}, Layout(8, 1, 1, 4, 1)

    def grads(*sets):
        cfg = load_config("configs/tiny.yaml", ["precision=bf16", *sets])
        return (planner.gradient_bytes(params, cfg, layout),
                planner.bucket_bytes(cfg.precision, cfg.train.grad_accum_dtype))
    share = 1000 / 8 + 4000 / 2
    for stage in (1, 2):
        (g, bucket) = grads(f"zero.stage={stage}")  # AdamW: every group exact
        assert g["partitions"] == 4 * share and g["edges"] == 0 and g["largest_group"] == 0
        assert g["step"] == 4 * share and bucket == 5e8 * 4
        assert g["backward"] == (4 * 5000 + 2 * 4000 if stage == 1 else 4 * share + 2 * 4000)
        (a, _) = grads(f"zero.stage={stage}", "train.optimizer=aurora", "train.grad_clip=0")
        edges = (1000 - 1000 / 8) + (4000 - 4000 / 2)  # both groups Aurora's, each under two tensors
        assert a["edges"] == 4 * edges and a["largest_group"] == 4000 / 2
        # ZeRO-1 keeps a second copy of the Aurora groups' partitions (here every group) to the step
        assert a["muon_updates"] == (4 * (share + edges) if stage == 1 else 0)
        assert a["step"] == 4 * (share + edges) + a["muon_updates"] + 4 * 4000 / 2
        assert a["backward"] == (4 * 5000 + 2 * 4000 if stage == 1 else 4 * (share + edges) + 2 * 4000)
        # the key's bf16 and fp32 weights: as before the key
        (b, b_bucket) = grads(f"zero.stage={stage}", "train.grad_accum_dtype=bf16")
        assert b["partitions"] == 2 * share and b_bucket == 5e8 * 2
        for precision in ("fp32",):
            keyed = [planner.gradient_bytes(params, load_config("configs/tiny.yaml", [
                f"precision={precision}", f"zero.stage={stage}", f"train.grad_accum_dtype={d}"]), layout)
                for d in ("fp32", "bf16")]
            assert keyed[0] == keyed[1]
    # a partition past one reduce bucket (5e8 elements): ZeRO-1 makes the fp32 partitions while
    # the accumulators of all but the first bucket still exist
    big, one = {"attention": 8 * 10 ** 9}, Layout(8)
    cfg = load_config("configs/tiny.yaml", ["precision=bf16"])
    assert planner.gradient_bytes(big, cfg, one)["backward"] == 4 * 8e9 + 4 * (1e9 - 5e8)


def test_activations_by_recompute_and_pipeline_depth():
    cfg = load_config("configs/tiny.yaml", ["precision=bf16", "train.global_batch=64", "train.micro_batch=2"])
    one = Layout(4, 1, 1, 1, 1)
    modes = {m: planner.activation_bytes(cfg, one, 0, m, 2) for m in ("none", "selective", "full")}
    assert modes["full"] < modes["selective"] < modes["none"]
    pp2 = Layout(4, 1, 2, 1, 1)  # DP 2
    first, last = (planner.activation_bytes(cfg, pp2, s, "none", 2) for s in (0, 1))
    # 1F1B: stage 0 holds 2 micro-batches in flight; with one micro-batch per step, only one
    single = load_config("configs/tiny.yaml", ["precision=bf16", "train.global_batch=4", "train.micro_batch=2"])
    assert first == 2 * planner.activation_bytes(single, pp2, 0, "none", 2)
    assert last == planner.activation_bytes(single, pp2, 1, "none", 2)


def test_activations_drop_what_each_recompute_module_recomputes():
    """model.recompute_modules against a hand count on tiny (fp32: 4 bytes; one micro-batch of 2 x
    128 tokens; one dense layer of ffn 256, three MoE layers of 4 experts, top-2, ffn 256, a shared
    expert of 32): each module drops its tensors from every layer that has it."""
    def act(*modules, extra=(), planned=Planned()):
        sets = ["model.recompute=selective", f"model.recompute_modules=[{','.join(modules)}]",
                "model.moe.shared_ffn_hidden_size=32", "train.micro_batch=2", "train.global_batch=2", *extra]
        cfg = load_config("configs/tiny.yaml", sets)
        return planner.activation_bytes(cfg, Layout(1), 0, "selective", 2, planned=planned)
    tokens, size = 2 * 128, 4
    assert (cfg := load_config("configs/tiny.yaml")).model.moe.topk == 2 and cfg.model.first_dense == 1
    # the dense layer's fc1 output (2F), and megatron's unfused glu's silu(gate), copy of up and product;
    # fused, fc1's output and the product
    assert act("core_attn", "mlp") - act("core_attn") == -1 * tokens * 5 * 256 * size
    assert act("core_attn", "mlp", planned=Planned(fused_swiglu=True)) \
        - act("core_attn", planned=Planned(fused_swiglu=True)) == -1 * tokens * 3 * 256 * size
    for kappa in ("true", "false"):  # κ-SwiGLU and megatron's weighted SwiGLU keep the same
        grouped = ["model.moe.grouped_gemm=true", f"model.kappa.enabled={kappa}"]
        assert act("core_attn", "moe_act", extra=grouped) - act("core_attn", extra=grouped) == \
            -3 * tokens * 2 * 256 * size  # the experts' activation, top-2 rows per token
    assert act("core_attn", "shared_experts") - act("core_attn") == -3 * tokens * 5 * 32 * size  # glu as the dense
    # moe: every routed row's fc1 input, output and activation, and the shared expert's
    assert act("core_attn", "moe") - act("core_attn") == -3 * (tokens * 2 * (64 + 3 * 256) + tokens * 5 * 32) * size
    heads = cfg.model.num_attention_heads
    assert MLA[3:] == ["model.mla.qk_head_dim=16", "model.mla.qk_pos_emb_head_dim=8", "model.mla.v_head_dim=24"]
    assert act("core_attn", "mla_up_proj", extra=MLA) - act("core_attn", extra=MLA) == \
        -4 * tokens * heads * (2 * (16 + 8) + 24) * size  # q, k (nope + rope) and v of every layer


def test_routed_rows_per_rank_follow_tp_and_expert_tp():
    """Each TP rank routes its sequence-parallel share of the tokens and megatron's dispatcher
    gathers the rows over expert TP: tokens·k·etp/tp routed rows per rank, each keeping its fc1
    input (h) and fc1 output and activation (3F/etp). Hand count on tiny (fp32, one micro-batch of
    2 x 128 tokens, three MoE layers of top-2, expert ffn 256): TP2 with ETP2 keeps 2·128·2 rows of
    64 + 3·128 per layer, with ETP1 half the rows of 64 + 3·256; the difference is tokens·k·h/2."""
    cfg = load_config("configs/tiny.yaml", ["train.micro_batch=2", "train.global_batch=2", "parallel.tp=2"])
    tokens, k, h, ffn, size = 2 * 128, 2, 64, 256, 4
    assert (cfg.model.moe.topk, cfg.model.hidden_size, cfg.model.ffn_hidden_size) == (k, h, ffn)
    etp1, etp2 = (planner.activation_bytes(cfg, Layout(2, tp=2, etp=e), 0, "none", 2) for e in (1, 2))
    rows_etp2, rows_etp1 = tokens * k, tokens * k / 2
    assert rows_etp2 * (h + 3 * ffn / 2) - rows_etp1 * (h + 3 * ffn) == tokens * k * h / 2
    assert etp2 - etp1 == 3 * tokens * k * h / 2 * size
    # TP1: every token's rows on the one rank, ffn whole
    one = planner.activation_bytes(cfg, Layout(1), 0, "none", 2)
    dense_and_attention_tp1 = one - 3 * tokens * k * (h + 3 * ffn) * size
    dense_and_attention_tp2 = etp1 - 3 * rows_etp1 * (h + 3 * ffn) * size
    assert dense_and_attention_tp2 < dense_and_attention_tp1  # the rest is split by TP too


def test_activations_when_only_the_first_layers_are_recomputed():
    """model.recompute_layers N: the stage's first N layers keep their input only, the others
    everything, plus one recomputed layer's activations (hand count from the per-mode totals)."""
    base = ["train.micro_batch=2", "train.global_batch=2"]
    plain = load_config("configs/tiny.yaml", base)
    two = load_config("configs/tiny.yaml", [*base, "model.recompute=full", "model.recompute_layers=2"])
    every = planner.activation_bytes(plain, Layout(1), 0, "full", 2)
    none = planner.activation_bytes(plain, Layout(1), 0, "none", 2)
    got = planner.activation_bytes(two, Layout(1), 0, "full", 2)
    tokens, h, size = 2 * 128, 64, 4
    # per layer with nothing recomputed: none's total less the logits' loss chunk, split as built
    chunk = min(plain.model.cross_entropy_chunk, tokens) * planner.model_shape(plain, Layout(1)).padded_vocab * 4
    per = {n: planner.activation_bytes(load_config("configs/tiny.yaml", [*base, f"model.num_layers={n}"]),
                                       Layout(1), 0, "none", 2) for n in (2, 3, 4)}
    moe = per[4] - per[3]  # tiny: a dense layer, then MoE layers
    dense = per[2] - chunk - moe
    assert dense + 3 * moe + chunk == pytest.approx(none) and moe > dense
    # layers 0-1 recomputed (their inputs kept, and the larger one's activations while recomputed),
    # layers 2-3 keep everything
    want = 2 * tokens * h * size + max(dense, moe) + 2 * moe + chunk
    assert got == pytest.approx(want) and every < got < none


def test_verdict_and_search():
    cfg = load_config("configs/moe8.yaml")
    small = planner.plan(cfg, Layout(8, 1, 1, 8, 1), gpu_mem_gib=80)
    assert small.fits and small.most_loaded.total_bytes < 72 * GIB
    tight = planner.plan(cfg, Layout(8, 1, 1, 8, 1), gpu_mem_gib=4)
    assert not tight.fits
    rows = search.search(cfg, 16, gpu_mem_gib=80, gpus_per_node=8)
    assert rows and all(r.fits for r in rows)
    speeds = [r.speed.tokens_per_s for r in rows]
    assert speeds == sorted(speeds, reverse=True)  # fastest first (tests/test_plan_speed.py: the estimate)
    assert all(r.layout.tp <= 8 for r in rows)


def test_bad_layout_is_a_one_line_error():
    cfg = load_config("configs/tiny.yaml")
    with pytest.raises(ConfigError,
                       match=r"parallel.ep: model.moe.num_experts=4 is not divisible by ep=8 \(TP1 PP1 EP8 "):
        planner.plan(cfg, Layout(8, 1, 1, 8, 1), gpu_mem_gib=80)
    with pytest.raises(ConfigError, match=r"world size 8 is not divisible by ep × etp × pp = 4 × 1 × 4 .*\(TP1 PP4 EP4 "
                                          r"ETP1 DP2 \(EDP\?\)\)$"):  # a floor of 8 / 16 would read EDP0
        planner.plan(cfg, Layout(8, 1, 4, 4, 1), gpu_mem_gib=80)
    with pytest.raises(ConfigError, match=r"num_layers=4 is not divisible by pp=8 .*\(TP1 PP8 "):
        planner.plan(cfg, Layout(8, 1, 8, 1, 1), gpu_mem_gib=80)
    with pytest.raises(ConfigError, match=r"^plan: world size 7 is not divisible by tp × pp × cp = 1 × 2 × 1$"):
        planner.plan(cfg, Layout(7, 1, 2, 1, 1), gpu_mem_gib=80)  # the factors, no layout label


def test_command_line(tmp_path):
    def run(*a):
        return subprocess.run([sys.executable, "-m", "plan", *a], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    done = run("--config", "configs/moe8.yaml", "--world", "8", "--set", "parallel.ep=8", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["fits"] and out["layout"]["ep"] == 8 and out["most_loaded"]["params"]["experts"] > 0
    done = run("--config", "configs/moe8.yaml", "--world", "8", "--set", "parallel.ep=8", "--gpu-mem", "2")
    assert done.returncode == 1 and "does NOT fit" in done.stdout
    done = run("--config", "configs/moe8.yaml", "--world", "3", "--set", "parallel.ep=2")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "parallel.ep" in done.stderr
    # --search shows its progress over the candidate layouts on stderr, and not with --no-progress
    done = run("--config", "configs/tiny.yaml", "--world", "8", "--search", "--top", "3")
    assert done.returncode == 0 and done.stdout.startswith("layout ") and done.stdout.count("\n") == 4
    totals = set(re.findall(r"layouts: +\d+%\|[^|]*\| \d+/(\d+) \[", done.stderr))
    assert totals == {str(len(list(search.candidates(load_config(ROOT / "configs/tiny.yaml"), 8, 8))))}, done.stderr
    done = run("--config", "configs/tiny.yaml", "--world", "8", "--search", "--top", "3", "--no-progress")
    assert done.returncode == 0 and done.stdout.count("\n") == 4 and done.stderr == ""
    # Ctrl-C half-way through a search: one line, no traceback
    search_run = subprocess.Popen([sys.executable, "-m", "plan", "--config",
                                   "configs/frontier/mixtral_8x22b.yaml", "--world", "128", "--search"],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = ""
    while "layouts:" not in seen and search_run.poll() is None:
        seen += search_run.stderr.read(1)
    search_run.send_signal(signal.SIGINT)
    out, err = search_run.communicate(timeout=60)
    assert search_run.returncode == 130 and out == "", (search_run.returncode, err[-2000:])
    assert err.rstrip().endswith("interrupted: the planner writes nothing, so nothing is lost; run it again")
    assert "Traceback" not in seen + err


# --- bytes against what DeepSpeed holds (slow) --------------------------------------------------

# every layout with the gradients summed in bf16 (one micro-batch a step) and in fp32 (train.grad_accum_dtype's
# default; two or more micro-batches a step, so that the accumulators hold a sum), and two Aurora runs in fp32
MEMORY_SHAPE = ["precision=bf16", "train.steps=1", "data.mock=true",
                "model.seq_length=32", "train.micro_batch=2", "log.tensorboard=false",
                "checkpoint.interval=100", "eval.valid_every=0", "model.hidden_size=256", "model.vocab_size=8192"]
MEMORY_CASES = {  # name: (world, tp, pp, ep, etp, zero stage)
    "dp2_zero1": (2, 1, 1, 1, 1, 1), "dp2_zero2": (2, 1, 1, 1, 1, 2), "ep2_zero1": (2, 1, 1, 2, 1, 1),
    "ep2_zero2": (2, 1, 1, 2, 1, 2), "tp2_zero2": (2, 2, 1, 1, 2, 2), "pp2_zero1": (2, 1, 2, 1, 1, 1),
    "ep2_etp2_zero1": (4, 1, 1, 2, 2, 1), "pp2_ep2_zero1": (4, 1, 2, 2, 1, 1)}
ACCUM = {"bf16": {name: [] for name in MEMORY_CASES},
         "fp32": {**{name: [] for name in MEMORY_CASES},
                  **{f"{name} aurora": ["train.optimizer=aurora", "train.grad_clip=0"] for name in ("dp2_zero1",
                                                                                                    "ep2_zero2")}}}


def memory_cases(tmp) -> list[dict]:
    out = []
    for accum, names in ACCUM.items():
        for name, sets in names.items():
            w, tp, pp, ep, etp, z = MEMORY_CASES[name.split()[0]]
            label = f"{name} {accum}"
            out.append({"name": label, "world": w, "accum": accum, "overrides": MEMORY_SHAPE + sets + [
                f"train.grad_accum_dtype={accum}", f"train.global_batch={(2 if accum == 'bf16' else 4) * w}",
                f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.ep={ep}", f"parallel.etp={etp}",
                f"zero.stage={z}", f"run.dir={tmp / label.replace(' ', '_')}"]})
    return out


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    from tests.support.processes import env, free_port
    tmp = tmp_path_factory.mktemp("memory")
    cases, results = memory_cases(tmp), {}
    for world in (2, 4):
        mine = [case for case in cases if case["world"] == world]
        (tmp / f"plan{world}.json").write_text(json.dumps(mine))
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={world}", f"--master_port={free_port()}",
                               "tests/support/memory_worker.py",
                               str(tmp / f"plan{world}.json"), str(tmp / f"out{world}.json")],
                              cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        results.update(json.loads((tmp / f"out{world}.json").read_text()))
    return cases, results


@pytest.mark.slow
def test_state_bytes_equal_what_deepspeed_holds(held):
    """On every rank of every case: the weights exactly; the fp32 master copy and the AdamW
    moments (after the first step) within DeepSpeed's partition padding (1 %); the reduce bucket
    exactly; the gradients at both of their peaks (planner.gradient_bytes) within 1 %, given the
    edges of DeepSpeed's partitions as it drew them (which the planner bounds, not knows: the
    order of the tensors decides which ones straddle an edge). With bf16 and with fp32
    accumulation (train.grad_accum_dtype); counting bf16's buffers for an fp32 run is the
    negative control."""
    cases, results = held
    assert len(cases) == sum(len(names) for names in ACCUM.values())
    for case in cases:
        cfg = load_config("configs/tiny.yaml", case["overrides"])
        layout = planner.layout_of(cfg.parallel, case["world"])
        fp32 = case["accum"] == "fp32"
        size = 4 if fp32 else 2  # bytes of an accumulated gradient
        for rank in results[case["name"]]:
            name = (case["name"], rank["stage"])
            params = planner.stage_params(cfg, layout, rank["stage"])
            want = planner.state_bytes(params, cfg, layout)
            grads = planner.gradient_bytes(params, cfg, layout)
            largest = max(planner.largest_tensors(cfg.model, layout).values())
            assert rank["after_step"]["weights"] == want["weights"], name
            kept = rank["after_step"]["other"]
            if cfg.train.optimizer == "adamw":  # Muon's state (its staged momentum): tests/test_plan_muon_state.py
                assert kept == pytest.approx(want["master"] + want["moments"], rel=0.01), (name, kept, want)

            # the step: the partitions with their edges, then one group's fp32 gradient at a time
            # (fp32 accumulation: the AdamW groups' partitions are exact and stepped in place)
            edges = size * rank["edges"]
            assert 0 <= edges <= grads["edges"], (name, edges, grads)
            copied = [n for n, muon in zip(rank["groups"], rank["muon_groups"]) if muon or not fp32]
            assert max(copied, default=0) == pytest.approx(grads["largest_group"], rel=0.01), name
            # ZeRO-1's fp32 accumulators point into the reduce bucket until the step ends (seen
            # wherever DP > 1; the planner counts the bucket on top of the peaks either way)
            bucket_held = rank["bucket_at_step"]
            assert bucket_held == (rank["bucket"] if fp32 and cfg.zero.stage == 1 and layout.dp > 1 else 0), name
            at_step, in_step, freeing = (rank[k]["gradients"] - bucket_held for k in ("at_step", "in_step", "freeing"))
            # ZeRO-1 under fp32 accumulation: a second copy of the Muon groups' partitions (their updates)
            muon = [n for n, m in zip(rank["groups"], rank["muon_groups"]) if m]
            updates = size * (sum(muon) + rank["edges"]) if grads["muon_updates"] else 0
            assert (updates > 0) == (fp32 and cfg.zero.stage == 1 and bool(muon)), name
            assert at_step == pytest.approx(grads["partitions"] + edges + updates, rel=0.01), (name, at_step, grads)
            # the peak as a group's fp32 gradient is made: the planner's with the edges drawn. With fp32
            # accumulation the AdamW groups' partitions are released group by group as each steps, so
            # the planner's (the largest copy beside every partition) bounds it: reached with one Muon group
            with_drawn_edges = grads["step"] - grads["edges"] + edges - grads["muon_updates"] + updates
            if fp32 and len(muon) != 1:
                assert at_step + 4 * (muon[0] if muon else 0) <= freeing <= with_drawn_edges, (name, freeing, grads)
            else:
                assert freeing == pytest.approx(with_drawn_edges, rel=0.01), (name, freeing, grads)
            assert in_step <= freeing <= grads["step"], name
            # nothing large goes uncounted: besides the gradients, the step holds the master copy (and
            # under 1 MiB of small tensors: 0.17 MB with four micro-batches through two stages; Muon's
            # momentum and its staged copy are its state's: tests/test_plan_muon_state.py)
            if cfg.train.optimizer == "adamw":
                assert rank["at_step"]["other"] - rank["at_step"]["gradients"] == pytest.approx(
                    want["master"], rel=0.02, abs=2 ** 20), name
            # a negative control: an fp32 gradient for every group at once is well off what is held
            assert freeing < 0.9 * (grads["partitions"] + edges + updates + 4 * sum(rank["groups"])), name

            # backward: the reduce bucket; ZeRO-1's full gradients (fp32: an accumulator for every
            # parameter, and the bf16 tensor just produced, as the last gradient hook fires); ZeRO-2
            # has copied all but the last gradient into the bucket (the model is smaller than one
            # bucket, so nothing was reduced into the partitions yet: with fp32 accumulation the
            # AdamW groups' partitions hold the earlier micro-batches' sum)
            assert rank["bucket"] == planner.bucket_bytes(cfg.precision, cfg.train.grad_accum_dtype), name
            backward = rank["backward"]["gradients"] - rank["bucket"]
            if cfg.zero.stage == 1 and not fp32:
                assert backward == grads["backward"], (name, backward, grads)
            elif cfg.zero.stage == 1:
                assert 0 < backward - 4 * sum(params.values()) <= 2 * largest, (name, backward, grads)
                assert backward <= grads["backward"]
            else:
                compact = 4 * sum(n for n, muon in zip(rank["groups"], rank["muon_groups"]) if fp32 and not muon)
                assert 0 < backward - compact <= 2 * largest, (name, backward)
                assert backward <= grads["backward"]
            if fp32:  # the negative control: the planner counting bf16's buffers
                as_bf16 = load_config("configs/tiny.yaml", case["overrides"] + ["train.grad_accum_dtype=bf16"])
                bf16 = planner.gradient_bytes(params, as_bf16, layout)
                bf16_bucket = planner.bucket_bytes(as_bf16.precision, as_bf16.train.grad_accum_dtype)
                assert rank["bucket"] == 2 * bf16_bucket, name
                if cfg.zero.stage == 1:
                    assert backward > 1.5 * bf16["backward"], (name, backward, bf16)
