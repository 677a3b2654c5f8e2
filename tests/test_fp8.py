"""precision: fp8 (model/fp8.py): each FP8 GEMM against a float64 reference, inside the FP8 error
band (the lower bound shows FP8 is on the path, bf16 stays under it) with negative controls; the
emulated casts bit-equal to torchao's references; the padding the CUDA grouped GEMM needs; which
layers run in FP8; the config and preflight checks; whole-model training (slow)."""
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.config.checks import fp8_capability_error
from megatron_kappa.model import fp8

torchao = pytest.importorskip("torchao")
from torchao.float8.config import ScalingGranularity  # noqa: E402 (torchao only once importorskip found it)
from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated  # noqa: E402
from torchao.prototype.moe_training.utils import (  # noqa: E402
    torch_to_3d_rowwise_float8_transpose_rhs,
    torch_to_float8_per_group_colwise,
)

ROOT = Path(__file__).resolve().parents[1]
BAND = (0.015, 0.08)  # relative error of one e4m3 GEMM with rowwise scales: ≈ 0.037 here
E4M3 = torch.float8_e4m3fn


def rel(got, ref):
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def in_band(*errors):
    return all(BAND[0] <= e <= BAND[1] for e in errors)


def bits(t):
    return t.view(torch.uint8)


# --- casts --------------------------------------------------------------------------------------

def torchao_axiswise(x, dim):
    scale = tensor_to_scale(x, E4M3, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
                            round_scales_to_power_of_2=True)
    return to_fp8_saturated(x.float() * scale, E4M3), scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_casts_bit_equal_to_torchao_references(dtype):
    torch.manual_seed(0)
    a = (torch.randn(40, 32) * torch.logspace(-3, 3, 40)[:, None]).to(dtype)  # rows of very different size
    b_t = torch.randn(3, 48, 32).to(dtype).transpose(1, 2)  # [E, K, N], column-major per expert
    for x, dim in ((a, -1), (b_t, -2)):  # the forward's left (per row) and right (per column) operands
        data, scale = fp8.cast_along(x, dim)
        ref_data, ref_scale = torchao_axiswise(x, dim)
        assert torch.equal(bits(data), bits(ref_data)) and torch.equal(scale, ref_scale)
    # the input gradient's right operand: torchao's pure-torch reference of its Triton kernel
    data, scale = fp8.cast_along(b_t, -1)
    ref_data, ref_scale = torch_to_3d_rowwise_float8_transpose_rhs(b_t, E4M3, round_scales_to_power_of_2=True)
    assert torch.equal(bits(data), bits(ref_data.transpose(-2, -1))) and torch.equal(scale, ref_scale.transpose(-2, -1))
    # the weight gradient's operands: one scale per group and column
    offs = torch.tensor([7, 20, 40], dtype=torch.int32)
    data, scale = fp8.cast_per_group_columns(a, offs)
    ref_data, ref_scale = torch_to_float8_per_group_colwise(a, offs, E4M3, round_scales_to_power_of_2=True)
    assert torch.equal(bits(data), bits(ref_data))
    starts = [0, 7, 20]
    assert torch.equal(scale[starts], ref_scale.view(3, 32))
    assert all(torch.equal(scale[i], scale[s]) for i, s in zip(range(40), [0] * 7 + [7] * 13 + [20] * 20))
    # every scale is a power of 2, so dequantizing is exact
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)


def test_per_group_cast_with_empty_groups_and_rows_past_the_counts():
    torch.manual_seed(1)
    a = torch.randn(12, 16)
    a[10:] = 1e4  # rows past the last group must not enter any group's scale
    offs = torch.tensor([0, 4, 4, 10], dtype=torch.int32)
    _, scale = fp8.cast_per_group_columns(a, offs)
    for lo, hi in ((0, 4), (4, 10)):
        _, ref = torchao_axiswise(a[lo:hi], 0)
        assert torch.equal(scale[lo:hi], ref.expand(hi - lo, -1))


# --- grouped GEMM (experts) ---------------------------------------------------------------------

COUNTS = [5, 0, 17, 10]  # expert 1 gets no rows


def grouped_reference(a, w, counts, grad):
    """float64, one matmul per expert: output, grad of a, grad of w."""
    a, w = a.double().requires_grad_(), w.double().requires_grad_()
    starts = [sum(counts[:i]) for i in range(len(counts))]
    out = torch.cat([a[s:s + c] @ w[i].T for i, (s, c) in enumerate(zip(starts, counts))])
    out.backward(grad.double())
    return out.detach(), a.grad, w.grad


def grouped_errors(gemm, dtype=torch.bfloat16, counts=COUNTS):
    torch.manual_seed(0)
    a, w = torch.randn(sum(counts), 64), torch.randn(len(counts), 96, 64)
    grad = torch.randn(sum(counts), 96)
    ref = grouped_reference(a, w, counts, grad)
    a, w = a.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    out = gemm(a, w, offs)
    out.backward(grad.to(dtype))
    assert out.dtype == a.grad.dtype == w.grad.dtype == dtype
    assert torch.count_nonzero(w.grad[1]) == 0  # the empty expert gets no gradient
    return [rel(out, ref[0]), rel(a.grad, ref[1]), rel(w.grad, ref[2])]


def fp8_grouped(a, w, offs):
    return fp8.grouped_mm(a, w, offs, fp8.FP8Settings(emulate=True))


def bf16_grouped(a, w, offs):
    return F.grouped_mm(a, w.transpose(1, 2), offs=offs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_gemm_error_in_fp8_band(dtype):
    errors = grouped_errors(fp8_grouped, dtype)
    assert in_band(*errors), errors
    plain = grouped_errors(bf16_grouped, torch.bfloat16)
    assert max(plain) < BAND[0], plain  # bf16 alone stays under the band: the band is FP8's


def test_negative_control_grouped_scale_not_undone(monkeypatch):
    monkeypatch.setattr(fp8, "dequantize", lambda x8, scale: x8.to(torch.float32))
    errors = grouped_errors(fp8_grouped)
    assert not in_band(*errors) and min(errors) > 1, errors


def test_padded_grouped_gemm_equals_unpadded():
    """The row padding the CUDA kernel needs, run with the emulated GEMM: zero rows change
    neither the scales nor the products, and each padded group starts at a multiple of 16."""
    seen = []

    def emulated(a, b_t, offs):
        seen.append(offs.clone())
        return fp8.EmulatedFloat8GroupedMM.apply(a, b_t, offs)

    def padded(a, w, offs):
        return fp8.padded_grouped_mm(emulated, a, w.transpose(1, 2), offs)
    for counts in (COUNTS, [16, 0, 3, 33]):
        assert grouped_errors(padded, counts=counts) == pytest.approx(grouped_errors(fp8_grouped, counts=counts),
                                                                      rel=1e-4, abs=1e-7)
    assert seen and all(bool((o % 16 == 0).all()) for o in seen)
    assert seen[0].tolist() == [16, 16, 48, 64]


# --- parallel linears ---------------------------------------------------------------------------

def linear_errors(kind, recipe, dtype=torch.bfloat16):
    from megatron_kappa.model.build import transformer_config
    cfg = load_config("configs/tiny.yaml", ["precision=bf16"])
    tconfig = transformer_config(cfg)
    cls = fp8.FP8ColumnParallelLinear if kind == "column" else fp8.FP8RowParallelLinear
    extra = dict(gather_output=False) if kind == "column" else dict(input_is_parallel=True)
    torch.manual_seed(0)
    layer = cls(64, 96, config=tconfig, init_method=torch.nn.init.normal_, bias=False, skip_bias_add=False,
                is_expert=False, fp8=fp8.FP8Settings(recipe=recipe), **extra)
    assert layer.weight.dtype == torch.bfloat16
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == (0 if kind == "column" else 1)
    x = torch.randn(16, 2, 64)
    grad = torch.randn(16, 2, 96)
    w64 = layer.weight.detach().double().requires_grad_()
    x64 = x.double().requires_grad_()
    ref = x64 @ w64.T
    ref.backward(grad.double())
    x = x.to(dtype).requires_grad_()
    out, _ = layer(x)
    out.backward(grad.to(dtype))
    return [rel(out, ref), rel(x.grad, x64.grad), rel(layer.weight.grad, w64.grad)]


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_parallel_linear_error_in_fp8_band(world1, kind, recipe):
    out, dgrad, wgrad = linear_errors(kind, recipe)
    assert in_band(out, dgrad), (out, dgrad)
    if recipe == "rowwise_with_gw_hp":  # the weight gradient stays in high precision
        assert wgrad < BAND[0], wgrad
    else:
        assert in_band(wgrad), wgrad


def test_negative_control_linear_scale_not_undone(world1, monkeypatch):
    """The weight's scale off by 2 (as if half of it were not undone) leaves the band."""
    import torchao.float8.float8_linear as tl
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
    cast = tl.hp_tensor_to_float8_dynamic

    def bad_cast(*args, **kwargs):
        t = cast(*args, **kwargs)
        if kwargs.get("gemm_input_role") != GemmInputRole.WEIGHT:
            return t
        return Float8TrainingTensor(t._data, t._scale * 2, t._orig_dtype, t._linear_mm_config,
                                    t._gemm_input_role, t._axiswise_dim)
    monkeypatch.setattr(tl, "hp_tensor_to_float8_dynamic", bad_cast)
    out, dgrad, _ = linear_errors("column", "rowwise")
    assert not in_band(out) and out > 0.3, out


# --- the model ----------------------------------------------------------------------------------

def linears(model):
    names = {}
    for name, module in model.named_modules():
        if name.endswith(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")):
            names[name] = type(module).__name__
    return names


@pytest.mark.parametrize("off", [None, "attention", "dense_mlp", "experts"])
def test_which_gemms_run_in_fp8(world1, off):
    from megatron_kappa.model.build import build_model
    from megatron_kappa.model.experts import GroupedExperts
    sets = ["precision=fp8"] + ([f"model.fp8.{off}=false"] if off else [])
    model = build_model(load_config("configs/tiny.yaml", sets), "cpu", meta=True)
    found = linears(model)
    for name, cls in found.items():
        part = "dense_mlp" if ".mlp." in name else "attention" if "self_attention" in name else None
        if part is None:  # the output layer stays bf16, as do embedding, norms and router
            assert cls == "ColumnParallelLinear"
        else:
            assert cls.startswith("FP8") == (part != off), (name, cls)
    assert sum(".mlp." in n for n in found) == 2 and sum("self_attention" in n for n in found) == 8
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert len(experts) == 3 and all((m.fp8 is not None) == (off != "experts") for m in experts)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # bf16 weights; FP8 only inside GEMMs


def test_bf16_model_has_no_fp8_gemm(world1):
    from megatron_kappa.model.build import build_model
    model = build_model(load_config("configs/tiny.yaml", ["precision=bf16"]), "cpu", meta=True)
    assert not any(c.startswith("FP8") for c in linears(model).values())


# --- checks -------------------------------------------------------------------------------------

@pytest.mark.parametrize("setting,message", [
    ("model.fp8.backend=te", "model.fp8.backend: te is not supported"),
    ("model.moe.grouped_gemm=false", "model.fp8.experts: FP8 experts need model.moe.grouped_gemm"),
    ("model.hidden_size=72", "fp8 needs model.hidden_size divisible by 16, got 72"),
    ("model.moe.ffn_hidden_size=200", "model.moe.ffn_hidden_size / etp divisible by 16, got 200"),
    ("model.seq_length=34", "model.seq_length × train.micro_batch divisible by 16, got 136"),
])
def test_config_refuses_what_fp8_cannot_run(setting, message):
    with pytest.raises(ConfigError, match=message.replace("×", ".")):
        load_config("configs/tiny.yaml", ["precision=fp8", "model.num_attention_heads=4", setting])
    load_config("configs/tiny.yaml", ["precision=fp8"])  # the tiny model itself is fine


def test_turned_off_gemms_are_not_checked():
    load_config("configs/tiny.yaml", ["precision=fp8", "model.moe.grouped_gemm=false", "model.fp8.experts=false"])


def test_preflight_fp8_needs_torchao_and_hopper(monkeypatch):
    import importlib.util

    from megatron_kappa.preflight import check_precision
    cfg = load_config("configs/tiny.yaml", ["precision=fp8"])
    check_precision(cfg.precision)  # CPU: emulated
    assert fp8_capability_error((9, 0)) is None and fp8_capability_error((10, 0)) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.delenv("MEGATRON_KAPPA_DEVICE", raising=False)
    with pytest.raises(ConfigError, match=r"capability 9.0 or more .* this one is 8.0"):
        check_precision(cfg.precision)
    monkeypatch.setenv("MEGATRON_KAPPA_DEVICE", "cpu")  # forced onto the CPU: emulated, fine
    check_precision(cfg.precision)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match="precision: fp8 needs torchao"):
        check_precision(cfg.precision)


def test_log_line_says_emulated():
    line = fp8.describe(load_config("configs/tiny.yaml", ["precision=fp8", "model.fp8.attention=false"]).model.fp8,
                        "cpu")
    assert line == ("fp8: torchao rowwise for dense_mlp, experts; emulated on the CPU (same casts, fp32 "
                    "products: no FP8 speed-up)")


# --- on a GPU: the real FP8 kernels ------------------------------------------------------------

CUDA_CHILD = r"""
import json, torch
from megatron_kappa.model import fp8
torch.manual_seed(0)
s = fp8.FP8Settings(recipe="rowwise", emulate=False)
def rel(a, b): return ((a.double() - b.double()).norm() / b.double().norm()).item()
counts = [5, 0, 17, 42]  # an empty expert and groups that are not multiples of 16
a, w, g = torch.randn(sum(counts), 64), torch.randn(4, 96, 64), torch.randn(sum(counts), 96)
starts = [sum(counts[:i]) for i in range(4)]
a64, w64 = a.double().requires_grad_(), w.double().requires_grad_()
ref = torch.cat([a64[st:st + c] @ w64[i].T for i, (st, c) in enumerate(zip(starts, counts))])
ref.backward(g.double())
A, W = a.cuda().bfloat16().requires_grad_(), w.cuda().bfloat16().requires_grad_()
offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).cuda()
out = fp8.grouped_mm(A, W, offs, s)
out.backward(g.cuda().bfloat16())
grouped = [rel(out.cpu(), ref), rel(A.grad.cpu(), a64.grad), rel(W.grad.cpu(), w64.grad)]
x, wl, gl = torch.randn(32, 64), torch.randn(96, 64), torch.randn(32, 96)
x64, wl64 = x.double().requires_grad_(), wl.double().requires_grad_()
r = x64 @ wl64.T
r.backward(gl.double())
X, WL = x.cuda().bfloat16().requires_grad_(), wl.cuda().bfloat16().requires_grad_()
o = fp8.fp8_linear(X, WL, s)
o.backward(gl.cuda().bfloat16())
linear = [rel(o.cpu(), r), rel(X.grad.cpu(), x64.grad), rel(WL.grad.cpu(), wl64.grad)]
print("RESULT " + json.dumps({"grouped": grouped, "linear": linear}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_kernels_on_cuda_in_band():
    """torchao's FP8 kernels on the GPU (sm_90: _scaled_mm, and _scaled_grouped_mm with this
    project's group padding): every GEMM's error in the FP8 band. In a child process: the tests
    interpret Triton, and torchao's casts are Triton kernels."""
    import os
    import sys
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 GEMMs need compute capability 9.0")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", CUDA_CHILD], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert in_band(*result["grouped"]) and in_band(*result["linear"]), result


# --- training (slow) ----------------------------------------------------------------------------

TRAIN = ["data.mock=true", "log.interval=1", "eval.valid_every=0", "model.seq_length=32", "train.micro_batch=2",
         "train.global_batch=4", "log.tensorboard=false", "model.kappa.freeze_fraction=0.25", "model.kappa.warmup=2"]


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_fp8_training_tracks_bf16(world1, tmp_path):
    """20 steps of the tiny model from the same weights: fp8 follows bf16, and is not bf16."""
    from megatron_kappa.train.loop import run
    from tests.support.weights import save_init_weights
    init = save_init_weights(tmp_path / "init.pt", TRAIN)
    got = {}
    for precision in ("bf16", "fp8"):
        run_dir = tmp_path / precision
        run(load_config("configs/tiny.yaml", TRAIN + ["train.steps=20", "checkpoint.interval=100",
                                                      f"precision={precision}", f"run.dir={run_dir}",
                                                      f"train.init_weights={init}"]), log=lambda *a: None)
        got[precision] = losses(run_dir)
    bf16, f8 = got["bf16"], got["fp8"]
    assert len(f8) == 20 and bf16[-1] < bf16[0] - 0.2 and f8[-1] < f8[0] - 0.2  # both learn
    gaps = [abs(a - b) for a, b in zip(bf16, f8)]
    assert max(gaps) < 0.1, gaps
    assert max(gaps) > 1e-4, gaps  # FP8 changed the numbers: it was on the path


@pytest.mark.slow
def test_fp8_tp2_and_ep2_train_and_resume_exactly(tmp_path):
    """TP2 (sequence parallel) and EP2 with fp8 under DeepSpeed: 4 steps straight, then the same
    run resumed from its step-2 checkpoint gives the same steps 3-4."""
    from tests.support.processes import deepspeed_cmd, env, free_port
    layouts = {"tp2": ["parallel.tp=2"], "ep2": ["parallel.ep=2"]}
    common = TRAIN + ["precision=fp8", "train.steps=4", "checkpoint.interval=2"]

    def launch(plan):
        (tmp_path / "plan.json").write_text(json.dumps(plan))
        done = subprocess.run(deepspeed_cmd(ROOT / "tests/support/training_worker.py", str(tmp_path / "plan.json"),
                                            port=free_port()),
                              cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    launch([{"overrides": common + sets + [f"run.dir={tmp_path / name}"]} for name, sets in layouts.items()])
    for name in layouts:
        shutil.copytree(tmp_path / name, tmp_path / f"{name}-resumed")
        shutil.rmtree(tmp_path / f"{name}-resumed/checkpoints/step_4")
    out = launch([{"overrides": common + sets + [f"run.dir={tmp_path / name}-resumed"], "log": True}
                  for name, sets in layouts.items()])
    assert "emulated on the CPU" in out
    assert all(f"resumed from {tmp_path / name}-resumed/checkpoints/step_2" in out for name in layouts)
    for name in layouts:
        straight, resumed = losses(tmp_path / name), losses(tmp_path / f"{name}-resumed")
        assert len(straight) == 4 and straight == resumed, (name, straight, resumed)


def test_mla_projections_run_in_fp8(world1):
    """MLA's projections are FP8 linears under precision fp8: the layer's output stays within the
    FP8 band of the same weights in bf16, and its backward runs; widths FP8 cannot take are refused."""
    from megatron_kappa.model.build import build_model
    mla = ["model.attention_kind=mla", "model.mla.q_lora_rank=32", "model.mla.kv_lora_rank=32",
           "model.mla.qk_head_dim=16", "model.mla.qk_pos_emb_head_dim=16", "model.mla.v_head_dim=16"]
    models = {}
    for precision in ("fp8", "bf16"):
        torch.manual_seed(0)
        models[precision] = build_model(load_config("configs/tiny.yaml", [*mla, f"precision={precision}"]), "cpu")
    attention = {p: m.decoder.layers[1].self_attention for p, m in models.items()}
    kinds = {n: type(mod).__name__ for n, mod in attention["fp8"].named_children() if n.startswith("linear_")}
    assert sorted(kinds) == ["linear_kv_down_proj", "linear_kv_up_proj", "linear_proj", "linear_q_down_proj",
                             "linear_q_up_proj"] and all(k.startswith("FP8") for k in kinds.values()), kinds
    attention["fp8"].load_state_dict(attention["bf16"].state_dict())
    h = torch.randn(32, 2, 64, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_()
    out = {p: a(h, attention_mask=None)[0] for p, a in attention.items()}
    error = ((out["fp8"] - out["bf16"]).float().abs().max() / out["bf16"].float().abs().max()).item()
    assert 0 < error < 0.1, error  # FP8, not bf16 (0 would mean no FP8 GEMM ran), within its band
    out["fp8"].float().sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        load_config("configs/tiny.yaml", [*mla, "model.mla.kv_lora_rank=24", "precision=fp8"])
