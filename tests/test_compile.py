"""model.compile (megatron_kappa/model/compile.py): each transformer layer compiled on its own.

- no graph break inside any compiled layer, counted by Dynamo's own counters, for tiny, the
  paper block (nanochat, κ scaled) and MLA; the MoE dispatch's named boundary is the only eager
  crossing. Negative control: an unsupported op put in a layer on purpose is counted.
- compiled equals eager: the same steps from the same weights, losses and gradient norms within
  1e-5 (fp32), and a run resumes across the switch both ways; with full and selective recompute
  (megatron's checkpoints eager at a second named boundary).
Compiling on CPU is slow (tens of seconds a model): the models are tiny and the tests few.
"""
import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.model import compile as model_compile
from tests.support.settings import MLA  # the tiny MLA settings

S = 16
COMMON = ["data.mock=true", f"model.seq_length={S}", "train.micro_batch=2", "train.global_batch=4",
          "log.tensorboard=false", "train.warmup=1", "eval.valid_every=0", "log.interval=1"]
NANOCHAT = ["model.block=nanochat", "model.kappa.input=scaled", "model.kappa.u_warmup=0"]


@pytest.fixture
def dynamo(monkeypatch):
    """Dynamo on for the test (conftest's TORCHDYNAMO_DISABLE=1 keeps the rest of the suite eager;
    torch.compile reads the variable itself), with empty caches and counters."""
    from torch._dynamo.utils import counters
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    # (the recompile limits at torch's defaults, restored after: model_compile raises them)
    with torch._dynamo.config.patch(disable=False, recompile_limit=8, accumulated_recompile_limit=256):
        torch._dynamo.reset()
        counters.clear()
        yield counters
        torch._dynamo.reset()


def test_key_resolves_and_refuses_bad_values():
    assert load_config("configs/tiny.yaml").model.compile == "auto"
    assert model_compile.enabled("auto", "cuda") and not model_compile.enabled("auto", "cpu")
    assert model_compile.enabled(True, "cpu") and not model_compile.enabled(False, "cuda")
    for bad in ("maybe", "1"):
        with pytest.raises(ConfigError, match=r"model\.compile: expected one of"):
            load_config("configs/tiny.yaml", [f"model.compile={bad}"])
    with torch._dynamo.config.patch(disable=True), pytest.raises(ValueError, match="TORCHDYNAMO_DISABLE"):
        model_compile.check_dynamo(True)
    model_compile.check_dynamo("auto")  # auto under TORCHDYNAMO_DISABLE=1: eager, not refused


def test_every_feature_loads_with_compile_true():
    """Nothing is refused with model.compile true: full and selective recompute, FP8, the EP
    overlap with and without the deferred weight gradients (each compiles: the tests below)."""
    overlap = ["parallel.overlap_moe_expert_parallel_comm=true", "parallel.ep=2", "precision=bf16"]
    for sets in (["model.recompute=full"], ["precision=fp8"], ["model.recompute=selective"], overlap,
                 overlap + ["parallel.delay_wgrad_compute=true"]):
        assert load_config("configs/tiny.yaml", ["model.compile=true", *sets]).model.compile is True


def test_fusers_eager_on_cpu(world1, dynamo):
    """compat.apply (and model_compile.apply, for modules imported later) leaves megatron's
    jit_fuser functions eager on CPU, with Dynamo on; torch.compile'd ones are found (control)."""
    from megatron.core.fusions import fused_bias_swiglu
    assert not hasattr(fused_bias_swiglu.weighted_swiglu, "_torchdynamo_orig_callable")
    assert model_compile.apply(torch.nn.Linear(1, 1), "auto", "cpu") is None
    assert model_compile.eager_fusers() == 0  # nothing left to unwrap
    wrapped = torch.compile(fused_bias_swiglu.swiglu)
    original, fused_bias_swiglu.swiglu = fused_bias_swiglu.swiglu, wrapped
    try:
        assert model_compile.eager_fusers() == 1 and fused_bias_swiglu.swiglu is original
    finally:
        fused_bias_swiglu.swiglu = original


def forward_backward(sets, break_on_purpose=False):
    from megatron_kappa.model.build import build_model
    cfg = load_config("configs/tiny.yaml", COMMON + list(sets))
    model = build_model(cfg, "cpu")
    done = model_compile.compile_layers(model)
    if break_on_purpose:  # an op Dynamo cannot put in a graph: a tensor read on the host
        model.decoder.layers[0].self_attention.register_forward_pre_hook(
            lambda module, args: print(end="" if args[0].sum().item() else ""))
    tokens = torch.randint(0, 2048, (2, S), generator=torch.Generator().manual_seed(0))
    loss = model(tokens, torch.arange(S).expand(2, -1), None, labels=tokens)
    loss.float().mean().backward()
    return done


@pytest.mark.parametrize("sets", [[], NANOCHAT, MLA], ids=["tiny", "nanochat-scaled", "mla"])
def test_no_graph_break_inside_the_compiled_layers(world1, dynamo, sets):
    done = forward_backward(sets)
    assert done["layers"] == 4
    assert model_compile.break_reasons() == []
    breaks = model_compile.graph_breaks()
    assert breaks["other"] == 0 and breaks["deliberate"] >= 1  # tiny: 3 MoE layers, one named boundary each
    line = model_compile.describe(done)
    assert line.startswith("compile: 4 layers, 0 graph breaks, ") and "MoE dispatch of 3 layers eager" in line


@pytest.mark.slow
def test_no_graph_break_with_the_experts_compiled_in_bf16(world1, dynamo):
    """bf16, where the grouped GEMMs trace and the experts compile inside the dispatch boundary
    with κ-SwiGLU (the GPU's path), with the frontier configs' MoE settings (configs/frontier/
    base.yaml: grouped GEMM, dropless) at tiny's size: 0 breaks but the boundary's; it was 4 ("Data
    dependent operator": the κ op read the expert counts on the host) and recompiled at each row
    count. (Their selective recompute: test_selective_recompute_sites_compile_without_a_graph_break.)"""
    done = forward_backward(["precision=bf16", "model.moe.grouped_gemm=true", "model.moe.capacity_factor=null"])
    assert done["eager_experts"] == {} and model_compile.break_reasons() == []
    assert model_compile.graph_breaks()["other"] == 0


def test_fp8_linears_compile_whole_and_as_eager(world1, dynamo):
    """precision fp8 (torchao's rowwise recipe, emulated on the CPU): one FP8 linear compiled as a
    single graph (fullgraph) gives the eager one's output and both gradients to the bit (the same
    casts, amax and scales). Negative control: torchao's configs looked up inside the traced code,
    as before, do not trace."""
    from megatron_kappa.model import fp8
    cfg = load_config("configs/tiny.yaml", ["precision=fp8"])
    settings = fp8.settings("fp8", cfg.model.fp8, "cpu", "attention")
    configs = fp8._linear_configs(settings)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=gen).bfloat16(), (torch.randn(128, 256, generator=gen) * 0.05).bfloat16()
    dy = torch.randn(64, 128, generator=gen).bfloat16()
    def linear(x, w):
        return fp8.fp8_linear(x, w, settings, configs)
    results = []
    for fn in (linear, torch.compile(linear, fullgraph=True)):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xx, ww)
        y.backward(dy)
        results.append((y.detach(), xx.grad, ww.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert (results[0][0].float() - x.float() @ w.float().t()).abs().max() > 0  # FP8, not bf16
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="sourceless builder"):
        torch.compile(lambda x, w: fp8.fp8_linear(x, w, settings), fullgraph=True)(x, w)


@pytest.mark.slow
def test_fp8_models_compile_without_a_graph_break(world1, dynamo):
    """tiny's and MLA's layers with precision fp8: no break but the MoE boundary (it was one in
    every FP8 linear: torchao's configs, test_fp8_linears_compile_whole_and_as_eager)."""
    mla = MLA + ["model.mla.kv_lora_rank=32", "model.mla.qk_pos_emb_head_dim=16"]  # widths FP8 takes (multiples of 16)
    for sets in ([], mla):  # MLA: its down projections made FP8 linears by a class swap (mla.py)
        torch._dynamo.reset()
        dynamo.clear()
        done = forward_backward(["precision=fp8", *sets])
        assert done["layers"] == 4 and model_compile.break_reasons() == [], sets


@pytest.mark.slow
def test_more_layers_than_dynamos_recompile_limit_all_compile(world1, dynamo, monkeypatch):
    """10 layers (9 MoE): each router's graph is specialised to its layer number, so the router's
    code object needs 10 cache entries, past Dynamo's default limit of 8; compile_layers raises the
    limit and every frame compiles. Negative control: at the default limit the later routers run
    eager, and that is counted as a break (it was a silent "0 graph breaks")."""
    from torch._dynamo.utils import counters
    with monkeypatch.context() as unraised:  # first, while the fixture keeps the default limit
        unraised.setattr(model_compile, "raise_recompile_limit", lambda layers: 8)
        done = forward_backward(["model.num_layers=10"])
    assert model_compile.graph_breaks()["other"] >= 1
    assert any("recompile limit" in reason for reason in model_compile.break_reasons())
    assert " 0 graph breaks" not in model_compile.describe(done)
    torch._dynamo.reset()
    counters.clear()
    done = forward_backward(["model.num_layers=10"])
    assert done["layers"] == 10 and model_compile.graph_breaks()["other"] == 0, model_compile.break_reasons()
    assert counters["frames"]["ok"] == counters["frames"]["total"]


def test_negative_control_an_unsupported_op_is_counted(world1, dynamo):
    forward_backward([], break_on_purpose=True)
    assert model_compile.graph_breaks()["other"] >= 1
    assert any("item" in reason.lower() or "scalar" in reason.lower() for reason in model_compile.break_reasons())



def _router_grads(model) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    tokens = torch.randint(0, 2048, (2, S), generator=torch.Generator().manual_seed(0))
    model(tokens, torch.arange(S).expand(2, -1), None, labels=tokens).float().mean().backward()
    return torch.cat([p.grad.flatten() for n, p in model.named_parameters() if "router" in n])


def test_compiled_routers_scale_their_losses_as_megatron(world1, dynamo):
    """The routers compile with their aux loss and z-loss (0 breaks) and scale those losses'
    gradients by megatron's scale as it is at the backward, here set to 8 after compiling (copied in
    place, as the pipeline schedule sets it after each forward): router gradients equal eager's.
    Negative control: eager's under another scale (1) differ, so the scale shows in them."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_kappa.model import aux_loss
    from megatron_kappa.model.build import build_model
    cfg = load_config("configs/tiny.yaml", COMMON + ["model.moe.aux_loss=1.0", "model.moe.z_loss=0.1"])
    compiled = build_model(cfg, "cpu")
    eager = build_model(cfg, "cpu")
    eager.load_state_dict(compiled.state_dict())
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    try:
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        unscaled = _router_grads(eager)
        model_compile.compile_layers(compiled)
        router_module = sys.modules[aux_loss.ROUTER_MODULE]  # megatron's name, the one patched symbol
        assert router_module.MoEAuxLossAutoScaler is aux_loss.TraceableAuxLossScaler
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(8.0))
        want, got = _router_grads(eager), _router_grads(compiled)
        assert model_compile.break_reasons() == []
        assert ((got - want).norm() / want.norm()).item() < 1e-5
        assert ((got - unscaled).norm() / unscaled.norm()).item() > 1e-3
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = None



@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_kappa_op_compiles_whole_for_every_row_count(dynamo, backend):
    """κ-SwiGLU of rows grouped by expert (the authors' scale and gain, U 4) compiled, with either
    backend setting: no graph break (the eager torch op reads the expert counts on the host and
    walks row chunks; the Triton kernels are left to eager code), at most one recompile as the row
    counts change from step to step, and values and gradients equal to the eager torch op's in
    float64 within 1e-5. Negative control: other expert counts (α, b gathered for the wrong rows)
    differ."""
    from megatron_kappa.kappa import kappa_swiglu
    from megatron_kappa.kappa.reference import kappa_swiglu_traced

    def op(gate, up, logit, alpha, bias, counts, backend="torch"):
        return kappa_swiglu(gate, up, logit, alpha, bias, 4.0, 0.15, 2.0, backend=backend, tokens_per_expert=counts)
    compiled = torch.compile(functools.partial(op, backend=backend))
    generator = torch.Generator().manual_seed(0)
    for counts in ([5, 0, 7], [2, 9, 1], [4, 4, 4], [0, 3, 10]):
        n, counts = sum(counts), torch.tensor(counts)
        inputs = [torch.randn(shape, generator=generator, dtype=torch.float64)
                  for shape in ((n, 8), (n, 8), (n,), (3, 8), (3, 8))]
        grads = []
        for fn, dtype in ((op, torch.float64), (compiled, torch.float32)):
            leaves = [t.to(dtype).clone().requires_grad_() for t in inputs]
            out = fn(*leaves, counts)
            out.backward(torch.ones_like(out))
            grads.append([out.double(), *(t.grad.double() for t in leaves)])
        for want, got in zip(*grads):
            assert (got - want).abs().max().item() < 1e-5
    assert model_compile.break_reasons() == []
    assert dynamo["stats"]["unique_graphs"] <= 2, dict(dynamo["stats"])
    wrong = kappa_swiglu_traced(*inputs, 4.0, 0.15, 2.0, counts.flip(0))
    assert (wrong - op(*inputs, counts)).abs().max().item() > 1e-3


# ---- compiled equals eager, and resumes across the switch --------------------------------------
def train(run_dir, sets, steps=4):
    from megatron_kappa.train.loop import run
    from tests.support.processes import records
    lines = []
    run(load_config("configs/tiny.yaml", COMMON + list(sets) + [
        f"run.dir={run_dir}", f"train.steps={steps}", "checkpoint.interval=2", "checkpoint.keep=3"]),
        log=lines.append)
    return records(run_dir), lines


def close(a, b, keys=("loss", "grad_norm")):
    """The largest difference of the records' losses and gradient norms, relative to values of at
    least 1 (the norms are about 2: inductor's fp32 sums reorder, 1e-5 relative after 3 steps)."""
    assert len(a) == len(b) > 0
    return max(abs(x[k] - y[k]) / max(1.0, abs(x[k])) for x, y in zip(a, b) for k in keys)


def test_compiled_equals_eager_and_resumes_across_the_switch(world1, dynamo, tmp_path):
    eager, _ = train(tmp_path / "eager", ["model.compile=false"])
    compiled, lines = train(tmp_path / "compiled", ["model.compile=true"])
    assert [r["step"] for r in compiled] == [1, 2, 3, 4]
    assert any(line.startswith("compile: 4 layers, 0 graph breaks, ") for line in lines), lines
    assert close(eager, compiled) <= 1e-5
    # resume: step 2's checkpoint of one run continued by the other switch, each way
    for written, continued in (("eager", "true"), ("compiled", "false")):
        resumed = tmp_path / f"{written}-resumed"
        shutil.copytree(tmp_path / written, resumed)
        shutil.rmtree(resumed / "checkpoints" / "step_4")
        (resumed / "metrics.jsonl").write_text("")
        after, lines = train(resumed, [f"model.compile={continued}"])
        assert any(line.startswith("resumed from") for line in lines), lines
        assert [r["step"] for r in after] == [3, 4]
        assert close(eager[2:], after) <= 1e-5, (written, continued)


def test_composes_with_full_recompute_mtp_and_the_sorted_dispatcher(world1, dynamo, tmp_path):
    """One run with the three at once: 0 breaks in the 5 layers (4 and MTP's), equal to eager."""
    sets = ["model.recompute=full", "model.mtp.num_layers=1", "model.moe.dispatcher=sorted", "checkpoint.interval=100"]
    eager, _ = train(tmp_path / "eager", sets + ["model.compile=false"], steps=3)
    compiled, lines = train(tmp_path / "compiled", sets + ["model.compile=true"], steps=3)
    assert model_compile.break_reasons() == []
    assert any(line.startswith("compile: 5 layers, 0 graph breaks, ") for line in lines), lines
    assert close(eager, compiled) <= 1e-5


def test_composes_with_selective_recompute(world1, dynamo, tmp_path, monkeypatch):
    """Selective recompute of the attention core, the dense layer's MLP and the whole MoE layer:
    megatron's checkpoints eager at their named boundary, 0 other breaks, equal to eager. Negative
    control: without the boundary the checkpoints break the layers' graphs, and it is counted."""
    sets = ["model.recompute=selective", "model.recompute_modules=[core_attn,mlp,moe]", "checkpoint.interval=100"]
    eager, _ = train(tmp_path / "eager", sets + ["model.compile=false"], steps=3)
    compiled, lines = train(tmp_path / "compiled", sets + ["model.compile=true"], steps=3)
    assert model_compile.break_reasons() == [] and model_compile.graph_breaks()["deliberate"] > 0
    line = next(line for line in lines if line.startswith("compile:"))
    assert line.startswith("compile: 4 layers, 0 graph breaks, ") and "checkpoints eager: core_attn, mlp)" in line
    assert close(eager, compiled) <= 1e-5
    torch._dynamo.reset()
    monkeypatch.setattr(model_compile, "_eager_recompute_sites", lambda layer: [])
    forward_backward(sets[:2])
    assert model_compile.graph_breaks()["other"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("sets, sites", [
    (MLA + ["model.recompute_modules=[mla_up_proj,core_attn]"], ["core_attn", "mla_up_proj"]),
    (["precision=bf16", "model.moe.grouped_gemm=true", "model.moe.capacity_factor=null",
      "model.moe.shared_ffn_hidden_size=64", "model.recompute_modules=[moe_act,shared_experts]"], ["moe_act"])],
    ids=["mla_up_proj", "moe_act-bf16"])
def test_selective_recompute_sites_compile_without_a_graph_break(world1, dynamo, sets, sites):
    """MLA's up-projections (its forward eager, its projections and core compiled) and the experts'
    activation in bf16 (fc1 compiled, the checkpointed activation and fc2 eager; the shared
    experts' checkpoint is inside the dispatch boundary): 0 breaks but the named boundaries'."""
    done = forward_backward(["model.recompute=selective", *sets])
    assert model_compile.break_reasons() == [] and model_compile.graph_breaks()["other"] == 0
    assert done["recompute"] == sites and (done["eager_experts"] == {}) == ("precision=bf16" in sets)


# ---- the same in 2-process layouts (tests/support/compile_worker.py: eager then compiled in one launch) ----
def _two_processes(tmp_path, sets):
    from tests.support.processes import env, records
    root = Path(__file__).resolve().parents[1]
    environment = {**env(), "PYTHONPATH": str(root)}
    environment.pop("TORCHDYNAMO_DISABLE")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "tests/support/compile_worker.py", str(tmp_path), *COMMON, "train.steps=3",
                           "checkpoint.interval=100", *sets],
                          cwd=root, env=environment, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return (json.loads((tmp_path / "breaks.json").read_text()), records(tmp_path / "eager"),
            records(tmp_path / "compiled"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["parallel.ep=2", "parallel.tp=2 model.recompute=selective",
                                    "parallel.pp=2 parallel.vpp=2", "parallel.cp=2"],
                         ids=["ep2", "tp2-selective", "pp2-vpp2", "cp2"])
def test_compiled_equals_eager_in_two_processes(tmp_path, layout):
    """PP with virtual stages (2 model chunks a rank, interleaved 1F1B) covers plain PP's path too:
    the layers of every chunk compiled. TP2 runs with selective recompute (the attention core's
    checkpoint eager, under the tensor-parallel RNG tracker)."""
    breaks, eager, compiled = _two_processes(tmp_path, layout.split())
    assert breaks["other"] == 0, breaks["reasons"]
    layers = 2 if "parallel.pp=2" in layout else 4  # rank 0's share of tiny's 4 (with VPP: 2 chunks of 1)
    assert breaks["lines"] and breaks["lines"][0].startswith(f"compile: {layers} layers, 0 graph breaks, "), breaks
    if "selective" not in layout:  # (its checkpoint's break makes Dynamo compile the attention's frame apart)
        assert breaks["attention_graphs"] == 0  # inside the layers' graphs: the control for the EP overlap's test
    assert [r["step"] for r in compiled] == [1, 2, 3]
    assert close(eager, compiled) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("delay", [False, True], ids=["overlap", "overlap-delay-wgrad"])
def test_compiled_under_the_ep_overlap(tmp_path, delay):
    """EP2 with megatron's overlapped schedule (bf16, as megatron runs it), which calls each layer's
    attention, norm, router, experts and MLP apart instead of its forward: those parts are compiled
    apart (graphs of the attention counted; 0 in the plain layouts above, the control), 0 breaks.
    With the deferred weight gradients the experts stay eager and the line says why. Compiled
    equals eager within bf16's rounding (1e-3 in the loss, 1 % in the gradient norm)."""
    overlap = ["parallel.ep=2", "precision=bf16", "parallel.overlap_moe_expert_parallel_comm=true"]
    breaks, eager, compiled = _two_processes(tmp_path, overlap + ["parallel.delay_wgrad_compute=true"] * delay)
    assert breaks["other"] == 0, breaks["reasons"]
    assert breaks["attention_graphs"] >= 1
    line = breaks["lines"][0]
    assert line.startswith("compile: 4 layers, 0 graph breaks, ") and "EP overlap's schedule" in line, line
    assert ("experts eager in 3: parallel.delay_wgrad_compute" in line) == delay, line
    assert [r["step"] for r in compiled] == [1, 2, 3]
    assert close(eager, compiled, ("loss",)) <= 1e-3 and close(eager, compiled, ("grad_norm",)) <= 1e-2


# ---- the vector width in the compiled-graph cache key ----------------------------------------
def _isa_run(cache, capability, mode) -> float:
    from tests.support.processes import env
    root = Path(__file__).resolve().parents[1]
    environment = {**env(), "PYTHONPATH": str(root), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    environment.pop("TORCHDYNAMO_DISABLE")
    environment.pop("ATEN_CPU_CAPABILITY", None)
    if capability:
        environment["ATEN_CPU_CAPABILITY"] = capability
    done = subprocess.run([sys.executable, "tests/support/isa_cache_worker.py", mode], cwd=root, env=environment,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return float(done.stdout.split()[-1])


@pytest.mark.slow
def test_a_graph_cached_at_one_vector_width_is_not_reused_at_another(tmp_path):
    """A graph compiled at the CPU's widest vector ISA, then the same graph in a process under
    ATEN_CPU_CAPABILITY=avx2 with the same inductor cache: equal to eager within fp32 rounding,
    because model.compile pins the width into the cache key (pin_vector_isa). Negative control,
    on CPUs wider than AVX2 (AVX-512): unpinned, the second process reuses the 16-wide graph built
    with 8-wide vectors, and its norm is wrong (it was nan at step 1 of compiled training)."""
    from torch._inductor import cpu_vec_isa
    assert _isa_run(tmp_path / "pinned", None, "pin") < 1e-5
    assert _isa_run(tmp_path / "pinned", "avx2", "pin") < 1e-5
    if cpu_vec_isa.valid_vec_isa_list()[0].bit_width() <= 256:
        pytest.skip("negative control needs a vector ISA wider than AVX2 (AVX-512); the pinned runs passed")
    assert _isa_run(tmp_path / "bare", None, "bare") < 1e-5
    assert not _isa_run(tmp_path / "bare", "avx2", "bare") < 1e-3
