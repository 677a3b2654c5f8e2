"""The fused Triton κ-SwiGLU kernels against the formula in float64 (on CPU through Triton's
interpreter, TRITON_INTERPRET=1 from conftest), plus determinism, the public entry point and a
negative control. Small tiles (SMALL) make tiny shapes span many programs with ragged edges."""
import pytest
import torch
import triton
import triton.language as tl
from conftest import gpu

from megatron_kappa.kappa import kappa_swiglu
from megatron_kappa.kappa.triton_op import kappa_swiglu_triton

U = 3.0
SMALL = dict(block_n=4, block_f=8, chunk_rows=12)  # rows 37 → chunks of 12, tiles of 4: all ragged
VARIANTS = {  # name: (use α, use b, logit scale, tanh gain)
    "paper": (True, True, 1.0, 1.0),
    "authors_code": (True, True, 0.15, 2.0),
    "no_alpha": (False, True, 1.0, 1.0),
    "no_bias": (True, False, 1.0, 1.0),
    "kappa_one": (False, False, 1.0, 1.0),
}


def formula(g, u, s, a, b, scale, gain, counts=None):
    """The math written naively (autograd gives the reference gradients); per-row α, b by expert."""
    rows = (lambda p: p[None, :]) if counts is None else (
        lambda p: p[torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))])
    z = torch.zeros_like(g)
    if a is not None:
        z = z + rows(a) * (scale * s)[:, None]
    if b is not None:
        z = z + rows(b)
    kappa = U ** torch.tanh(gain * z)
    return g * torch.sigmoid(kappa * g) * u


def make(n, f, counts=None, use_a=True, use_b=True, dtype=torch.float32, seed=0, logit_mag=3.0):
    gen = torch.Generator().manual_seed(seed)
    def r(*shape, mag=1.0):
        return (torch.randn(*shape, generator=gen) * mag).to(dtype).requires_grad_()
    pshape = (f,) if counts is None else (len(counts), f)
    return [r(n, f, mag=2.0), r(n, f), r(n, mag=logit_mag),
            r(*pshape, mag=0.5) if use_a else None, r(*pshape, mag=0.5) if use_b else None]


def run(fn, leaves, w):
    """Output and the gradients of all five inputs (None where absent or unused)."""
    out = fn(*leaves)
    (out.double() * w).sum().backward()
    return out, [None if t is None else t.grad for t in leaves]


def close(got, want, tol):
    assert (got is None) == (want is None), (got, want)
    if want is not None:
        assert got.shape == want.shape
        peak = want.abs().max().item() if want.numel() else 0.0
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * max(1.0, peak))


def check(n, f, counts=None, variant="paper", dtype=torch.float32, tol=1e-5, logit_mag=3.0,
          kernel_args=None, ref_logit=None, ref_alpha=None, **blocks):
    """Triton output and gradients against float64 autograd of the formula on the same inputs.
    kernel_args, ref_logit, ref_alpha: tamper with one side (negative controls)."""
    use_a, use_b, scale, gain = VARIANTS[variant]
    leaves = make(n, f, counts, use_a, use_b, dtype, logit_mag=logit_mag)
    refs = [None if t is None else t.detach().double().requires_grad_() for t in leaves]
    if ref_logit is not None:
        refs[2] = ref_logit(refs[2].detach()).requires_grad_()
    if ref_alpha is not None:
        refs[3] = ref_alpha(refs[3].detach()).requires_grad_()
    tpe = None if counts is None else torch.tensor(counts)
    w = torch.randn(n, f, generator=torch.Generator().manual_seed(5)).to(dtype).double()
    out, grads = run(lambda *a: kappa_swiglu_triton(*a, U, scale, gain, tpe, **blocks), leaves, w)
    ref, ref_grads = run(lambda *a: formula(*a, scale, gain, counts), refs, w)
    assert out.dtype == dtype and out.shape == (n, f)
    close(out, ref, tol)
    for name, got, want, leaf in zip("g u s α b".split(), grads, ref_grads, leaves):
        if leaf is not None:
            assert got is None or got.dtype == leaf.dtype, name
        close(got, want, tol)


@pytest.mark.parametrize("grouped", [False, True], ids=["one_expert", "grouped"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_formula(variant, grouped):
    check(37, 24, [9, 0, 14, 1, 13] if grouped else None, variant, **SMALL)


@pytest.mark.parametrize("n,f,blocks", [
    (0, 24, SMALL), (1, 24, SMALL), (70, 40, SMALL), (37, 5, SMALL),  # F < block, not a power of 2
    (37, 24, dict(block_n=8, block_f=16, chunk_rows=7)),  # chunks not a multiple of the tile
    (37, 24, {}),  # the default tiles and chunking
], ids=["n0", "n1", "n70_f40", "f5", "chunk7", "defaults"])
def test_shapes(n, f, blocks):
    check(n, f, **blocks)


def test_grouped_empty_experts_and_chunk_boundaries():
    """Empty experts first, last, and exactly on chunk boundaries (12, 24); a chunk with 3 experts."""
    check(37, 24, [0, 12, 0, 12, 5, 0, 2, 6, 0], **SMALL)
    check(0, 24, [0, 0, 0], **SMALL)  # N = 0 grouped: zero α, b gradients


def test_saturated_kappa_large_logits():
    check(40, 16, logit_mag=50.0, **SMALL)
    check(40, 16, [20, 0, 20], logit_mag=50.0, variant="authors_code", **SMALL)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_half_precision_io(dtype, tol):
    check(37, 24, [20, 0, 17], dtype=dtype, tol=tol, **SMALL)


def test_gradients_are_deterministic():
    counts = torch.tensor([9, 0, 14, 1, 13])
    grads = []
    for _ in range(2):
        leaves = make(37, 24, counts.tolist())
        out = kappa_swiglu_triton(*leaves, U, 0.15, 2.0, counts, **SMALL)
        out.backward(torch.ones_like(out))
        grads.append([out] + [t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("grouped", [False, True], ids=["one_expert", "grouped"])
def test_public_entry_point_matches_torch_backend(grouped):
    counts = [9, 0, 14, 1, 13] if grouped else None
    tpe = None if counts is None else torch.tensor(counts)
    results = []
    for backend in ("triton", "torch"):
        leaves = make(37, 24, counts)
        out = kappa_swiglu(*leaves, U=U, logit_scale=0.15, tanh_gain=2.0, backend=backend,
                           tokens_per_expert=tpe)
        out.backward(torch.ones_like(out))
        results.append([out] + [t.grad for t in leaves])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_strided_inputs_and_frozen_params():
    """gate, up as the two halves of one fc1 output [N, 2F] (a row stride of 2F), or transposed;
    α, b frozen (no gradient asked for them)."""
    leaves = make(37, 24)
    fc1 = torch.cat([leaves[0], leaves[1]], 1).detach().requires_grad_()
    gate, up = fc1.chunk(2, dim=1)
    a, b = leaves[3].detach(), leaves[4].detach()
    out = kappa_swiglu_triton(gate, up, leaves[2], a, b, U, 1.0, 1.0, **SMALL)
    out.sum().backward()
    ref = formula(gate.detach().double().requires_grad_(), up.detach().double().requires_grad_(),
                  leaves[2].detach().double(), a.double(), b.double(), 1.0, 1.0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert fc1.grad.shape == (37, 48) and a.grad is None and leaves[2].grad is not None
    up_t = up.detach().t().contiguous().t()  # column stride ≠ 1: copied before the kernel
    torch.testing.assert_close(kappa_swiglu_triton(gate, up_t, leaves[2], a, b, U, 1.0, 1.0, **SMALL),
                               out, rtol=0, atol=0)


def test_negative_control_detects_wrong_rows_or_experts():
    """The comparison is sharp: an off-by-one logit row or another expert's α must fail it."""
    with pytest.raises(AssertionError):
        check(37, 24, ref_logit=lambda s: s.roll(1), **SMALL)
    with pytest.raises(AssertionError):
        check(37, 24, [9, 0, 14, 1, 13], ref_alpha=lambda a: a.roll(1, 0), **SMALL)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [False, True], ids=["one_expert", "grouped"])
def test_compiled_kernels_bf16_on_cuda(grouped):
    """The real compiled kernels, in a process without TRITON_INTERPRET (this one interprets)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # conftest keeps an explicit setting
    code = f"import test_kappa_triton as t; t.compiled_kernels_bf16_on_cuda({grouped})"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def compiled_kernels_bf16_on_cuda(grouped):
    """The real compiled kernels (default tiles) in bf16 against the float64 formula."""
    n, f = 3000, 1000
    counts = [1000, 0, 999, 1, 1000] if grouped else None
    tpe = None if counts is None else torch.tensor(counts, device="cuda")
    leaves = [None if t is None else t.detach().cuda().requires_grad_()
              for t in make(n, f, counts, dtype=torch.bfloat16)]
    refs = [None if t is None else t.detach().double().requires_grad_() for t in leaves]
    w = torch.randn(n, f, device="cuda").bfloat16().double()
    out, grads = run(lambda *a: kappa_swiglu_triton(*a, U, 0.15, 2.0, tpe), leaves, w)
    ref, ref_grads = run(lambda *a: formula(*a, 0.15, 2.0, counts), refs, w)
    close(out, ref, 1.6e-2)
    for got, want in zip(grads, ref_grads):
        close(got, want, 1.6e-2)
    again = run(lambda *a: kappa_swiglu_triton(*a, U, 0.15, 2.0, tpe),
                [None if t is None else t.detach().requires_grad_() for t in leaves], w)[1]
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


@triton.jit
def _skip_rows(lo, hi, cols, cmask, pid_f, N, F, h_ptr, dg_ptr, du_ptr, dlogit_part_ptr, BACKWARD: tl.constexpr,
               NEED_DLOGIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    """triton_op._zero_rows that writes nothing (the negative control of the rows past the counts)."""
    pass


def nan_buffers(monkeypatch):
    """Every buffer the kernels are meant to write in full starts as NaN: a row they skip shows."""
    from megatron_kappa.kappa import triton_op
    monkeypatch.setattr(triton_op, "_empty", lambda shape, dtype, device: torch.full(
        shape, float("nan"), dtype=dtype, device=device))


def check_rows_past_counts(counts, n=37, f=24):
    """sum(counts) < N: h and the gradients of g, u, s are 0 on the rows past the sum, the rest
    (and α, b's gradients) match the float64 formula on the counted rows alone."""
    m = sum(counts)
    leaves = make(n, f, counts)
    refs = [t.detach()[:m].double().requires_grad_() if i < 3 else t.detach().double().requires_grad_()
            for i, t in enumerate(leaves)]
    w = torch.randn(n, f, generator=torch.Generator().manual_seed(5)).double()
    out, grads = run(lambda *a: kappa_swiglu_triton(*a, U, 0.15, 2.0, torch.tensor(counts), **SMALL), leaves, w)
    ref, ref_grads = run(lambda *a: formula(*a, 0.15, 2.0, counts), refs, w[:m])
    def pad(t):
        return torch.cat([t, t.new_zeros(n - m, *t.shape[1:])])
    close(out, pad(ref), 1e-5)
    for i, (got, want) in enumerate(zip(grads, ref_grads)):
        close(got, pad(want) if i < 3 else want, 1e-5)


@pytest.mark.parametrize("counts", [[9, 0, 14, 1, 3], [0, 0, 5], [0, 0, 0]], ids=["tail10", "tail32", "all"])
def test_rows_past_the_counts_are_zero(monkeypatch, counts):
    nan_buffers(monkeypatch)
    check_rows_past_counts(counts)


def test_rows_past_the_counts_negative_control(monkeypatch):
    """With the kernels' tail write removed, the NaN-filled buffers show through and the check fails."""
    from megatron_kappa.kappa import triton_op

    nan_buffers(monkeypatch)
    monkeypatch.setattr(triton_op, "_zero_rows", _skip_rows)
    with pytest.raises(AssertionError):
        check_rows_past_counts([9, 0, 14, 1, 3])
    check_rows_past_counts([9, 0, 14, 1, 13])  # counts summing to N never reach the tail write


@pytest.mark.parametrize("error", ["compile", "ptxas", "launcher"])
def test_kernel_failure_is_one_line_naming_the_key(monkeypatch, error):
    """A failed compile or launch (raised as Triton raises it) stops with one line naming
    model.kappa.backend and the first line of the cause, in the forward and in the backward."""
    import ast

    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import PTXASError

    from megatron_kappa.kappa import triton_op

    raised = {"compile": CompilationError("def k():\n  x = 1\n", ast.parse("x = 1").body[0],
                                          "ValueError('unsupported tensor index')"),
              "ptxas": PTXASError("ptxas fatal   : Unknown option '-arch=sm_999'\nmore"),
              "launcher": RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")}
    first = {"compile": "ValueError('unsupported tensor index')", "ptxas": "ptxas fatal   : Unknown option",
             "launcher": "Failed to find C compiler"}

    class Failing:
        def __init__(self, kernel, after=0):
            self.kernel, self.after, self.arg_names = kernel, after, kernel.arg_names

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if self.after:
                    self.after -= 1
                    return self.kernel[grid](*args, **kwargs)
                raise raised[error]
            return launch

    leaves = make(37, 24, [20, 0, 17])
    for after in (0, 1):  # fails in the forward; fails in the backward (the forward ran)
        monkeypatch.setattr(triton_op, "_kappa_swiglu_kernel", Failing(triton_op._kappa_swiglu_kernel, after))
        with pytest.raises(triton_op.KappaKernelError) as info:
            out = kappa_swiglu(*leaves, backend="triton", tokens_per_expert=torch.tensor([20, 0, 17]))
            out.sum().backward()
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith("model.kappa.backend: triton: the κ kernel failed to compile")
        assert first[error] in msg and "for cpu" in msg and msg.endswith("set model.kappa.backend=torch")
        assert info.value.__cause__ is raised[error]
    # the torch backend never touches the kernels
    kappa_swiglu(*leaves, backend="torch", tokens_per_expert=torch.tensor([20, 0, 17])).sum().backward()


@pytest.mark.parametrize("blocks,match", [
    (dict(block_n=3), "BLOCK_N must be a power of 2"), (dict(block_f=96), "BLOCK_F must be a power of 2"),
    (dict(block_n=0), "BLOCK_N"), (dict(block_n=128), r"BLOCK_N must be a power of 2 in \[1, 64\]"),
    (dict(block_f=2048), "BLOCK_F"), (dict(block_n=64, block_f=32), "BLOCK_N·BLOCK_F must be at most 1024"),
    (dict(block_f=8.0), "BLOCK_F"), (dict(chunk_rows=0), "chunk_rows"),
], ids=["n3", "f96", "n0", "n128", "f2048", "tile2048", "float", "chunk0"])
def test_tile_sizes_are_checked(blocks, match):
    leaves = make(37, 24)
    with pytest.raises(ValueError, match=match):
        kappa_swiglu_triton(*leaves, U, 1.0, 1.0, **blocks)


def test_tile_limits_accept_every_allowed_tile():
    """The largest tiles allowed run and match the formula (the AOT test compiles them for spills)."""
    from megatron_kappa.kappa.triton_op import NUM_WARPS, check_tiles
    for bn, bf in ((64, 16), (1, 1024), (8, 128), (1, 1)):
        check_tiles(bn, bf, NUM_WARPS)
    check(37, 24, [9, 0, 14, 1, 13], block_n=64, block_f=16)
    with pytest.raises(ValueError, match="NUM_WARPS"):
        check_tiles(8, 128, 3)


def test_one_dtype_for_inputs_and_parameters():
    leaves = make(37, 24)
    leaves[3] = leaves[3].detach().bfloat16()
    with pytest.raises(ValueError, match="share one dtype"):
        kappa_swiglu_triton(*leaves, U, 1.0, 1.0)


def test_backend_setting_reaches_the_op(monkeypatch):
    """model.kappa.backend: validated by the config, carried by KappaSettings, and handed by the
    experts' activation to kappa_swiglu: triton runs the kernels (interpreted here), torch and
    auto (on CPU tensors) do not, with the same result."""
    import dataclasses

    from megatron_kappa.config import ConfigError, load_config
    from megatron_kappa.kappa import DEFAULTS, triton_op
    from megatron_kappa.model.build import kappa_settings
    from megatron_kappa.model.experts import KappaExpertActivation

    assert load_config("configs/tiny.yaml").model.kappa.backend == DEFAULTS.backend == "auto"
    with pytest.raises(ConfigError, match="model.kappa.backend"):
        load_config("configs/tiny.yaml", ["model.kappa.backend=cuda"])
    settings = kappa_settings(load_config("configs/tiny.yaml", ["model.kappa.backend=triton"]).model.kappa)
    assert settings.backend == "triton"
    calls, real = [], triton_op.kappa_swiglu_triton
    monkeypatch.setattr(triton_op, "kappa_swiglu_triton", lambda *a, **k: calls.append(k["backend"]) or real(*a, **k))
    counts = [20, 0, 17]
    g, u, s, a, b = make(37, 24, counts)
    probs = torch.rand(37)
    act = KappaExpertActivation()
    act._init_kappa(settings, 3, 24, torch.nn.Parameter(torch.zeros(1)))
    with torch.no_grad():
        act.kappa_alpha.copy_(a), act.kappa_bias.copy_(b)
    outs = {}
    for backend in ("triton", "torch", "auto"):
        act.kappa = dataclasses.replace(settings, backend=backend)
        outs[backend] = act.activation(g, u, probs, s, tokens_per_expert=torch.tensor(counts))
    assert calls == ["triton"]
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-5, atol=1e-5)
    assert torch.equal(outs["torch"], outs["auto"])
