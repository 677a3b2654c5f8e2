"""Fused Triton kernels for κ-SwiGLU, forward and backward (the "triton" backend of `kappa_swiglu`).

    z = gain · (α · scale · s + b),   κ = exp(ln U · tanh z),   h = g · σ(κ g) · u

Layout. Both passes use one grid, (row chunks, column blocks): program (c, j) owns rows
[c·R, (c+1)·R) and columns [j·BLOCK_F, (j+1)·BLOCK_F), and walks its rows in [BLOCK_N, BLOCK_F]
tiles, loads coalesced along F. With grouped experts (α, b of shape [E, F] and `tokens_per_expert`)
the chunk is cut where experts change, into segments of one expert each, so α and b are one
[BLOCK_F] vector per segment rather than a gather per row. Expert row offsets are a device-side
cumsum that the kernels read; the grid depends on the shapes N, F, E and never on the counts, so a
call launches a fixed number of kernels and never synchronises with the host. R is chosen from N
and F so that there are a few thousand programs even for E = 1 (a big GPU stays busy).

Reductions are deterministic and accumulate in fp32, without atomics:
  d_logit[n] = scale · Σ_f dz·α: each column block writes its partial row sums to an [F/BLOCK_F, N]
    buffer, which torch sums over dim 0 (a fixed order);
  d_α[e] = scale · Σ dz·s, d_b[e] = Σ dz over the rows of expert e: each (chunk c, expert e)
    segment writes one [F] partial to row c + e of a [chunks + E − 1, F] buffer (c + e is unique
    per segment, as c and e both grow along the rows), and a second kernel, one program per
    (expert, column block), sums that expert's chunks in order.

Launches per call: forward 1 (plus a cumsum and a pad for grouped offsets); backward 1, plus
the d_logit sum in torch and the d_α/d_b second stage (1 kernel) when those are asked for.

Recompute, don't save: autograd keeps g, u, s, α, b (and the offsets); κ, σ(κg) are recomputed.
Math is fp32 whatever the I/O dtype (loads are upcast at once: Triton's CPU interpreter cannot do
bf16 arithmetic), and tanh is built from exp (the interpreter has no libdevice).
Grouped rows past sum(tokens_per_expert) (when it is < N) belong to no expert: the kernels write
zeros there (h, d_gate, d_up and d_logit), found on the device, so the counts are never read on
the host. Counts summing to more than N are not checked (that would need a host read); rows
past N are never touched.

Safety on a GPU. A kernel that fails to compile or launch (no C compiler for Triton's launcher, a
ptxas error, too little shared memory, ...) stops with one line naming `model.kappa.backend`.
Tile sizes are checked before any launch (`check_tiles`). `launch_variants()` lists every kernel
variant (constexpr combination and pointer dtypes) the launch code can produce with the default
tiles; tests/test_kappa_aot.py compiles each of them for sm_80 and sm_90 without a GPU.
"""
from __future__ import annotations

import itertools
import math

import torch
import triton
import triton.language as tl

from megatron_kappa.kappa.triton_guard import (  # noqa: F401 (KappaKernelError, check_tiles: API)
    MAX_BLOCK_F,
    MAX_BLOCK_N,
    MAX_NUM_WARPS,
    MAX_TILE_PER_THREAD,
    KappaKernelError,
    check_tiles,
    failure_message,
    power_of_2,
)

# Tile defaults, not timed yet: [8, 128] with 4 warps gives 16-byte bf16 loads.
BLOCK_N, BLOCK_F, NUM_WARPS = 8, 128, 4
# Registers per thread of the main kernel (ptx .maxnreg). Left to itself, ptxas held two grouped
# backward variants in bf16 at 96-128 registers on sm_80 and spilled 24 and 36 bytes (the default
# tile; the largest allowed one); 8 warps or _BLOCK_E 32 moved spills to sm_90 variants instead
# (tests/test_kappa_aot.py). At 160 no variant spills on sm_80 or sm_90 (at 136 some still do),
# and 3 programs of 128 threads fit an SM's 64K registers; uncapped, ptxas takes up to 188 (2
# programs). Not timed on a GPU yet.
MAX_REGISTERS = 160
_TARGET_PROGRAMS = 4096  # programs per pass to aim for: a few per SM slot on an H200 (132 SMs)
_REDUCE_BLOCK_C, _REDUCE_NUM_WARPS = 16, 4
_BLOCK_E = 64  # experts' row offsets read per step when locating a chunk's experts
# Not specialised: Triton would otherwise compile another kernel whenever one of these equals 1 or
# is divisible by 16; without it the variants are the ones launch_variants() lists.
_NOT_SPECIALIZED = {"_kappa_swiglu_kernel": ("N", "E", "chunk_rows"),
                    "_reduce_param_grads_kernel": ("N", "chunk_rows")}


@triton.jit
def _kappa_of(z, log_u):
    """κ = U^tanh z and (dκ/dz)/κ = ln U · (1 − tanh² z). tanh from one exp of −2|z| (no libdevice,
    no overflow); 1 − tanh² = 4q/(1+q)² keeps its relative precision where tanh saturates."""
    q = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - q) / (1.0 + q)
    t = tl.where(z < 0, -t, t)
    return tl.exp(log_u * t), log_u * 4.0 * q / ((1.0 + q) * (1.0 + q))


@triton.jit(do_not_specialize=_NOT_SPECIALIZED["_kappa_swiglu_kernel"])
def _kappa_swiglu_kernel(
        g_ptr, u_ptr, s_ptr, a_ptr, b_ptr, offs_ptr, dh_ptr, h_ptr, dg_ptr, du_ptr,
        dlogit_part_ptr, da_part_ptr, db_part_ptr,
        N, F, E, stride_g, stride_u, stride_dh, chunk_rows, log_u, scale, gain,
        HAS_A: tl.constexpr, HAS_B: tl.constexpr, GROUPED: tl.constexpr, BACKWARD: tl.constexpr,
        NEED_DLOGIT: tl.constexpr, NEED_DA: tl.constexpr, NEED_DB: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_E: tl.constexpr):
    """One launch: forward (h) or backward (d_gate, d_up and the partial reductions)."""
    pid_c = tl.program_id(0)
    pid_f = tl.program_id(1)
    cols = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    cmask = cols < F
    col = cols[None, :]
    cs = pid_c * chunk_rows
    ce = tl.minimum(cs + chunk_rows, N)
    if GROUPED:
        # Experts holding the chunk's first and last rows (empty experts sit between them),
        # counted BLOCK_E offsets at a time (one variant whatever E); clamped so that counts
        # summing to less than N cannot index past α[E − 1].
        n_first = tl.full([], 0, tl.int32)
        n_last = tl.full([], 0, tl.int32)
        for e0 in range(0, E, BLOCK_E):
            eidx = e0 + tl.arange(0, BLOCK_E)
            ends = tl.load(offs_ptr + 1 + eidx, mask=eidx < E, other=2147483647)
            n_first += tl.sum((ends <= cs).to(tl.int32), axis=0)
            n_last += tl.sum((ends < ce).to(tl.int32), axis=0)
        e_first = tl.minimum(n_first, E - 1)
        e_last = tl.minimum(n_last, E - 1)
    else:
        e_first = 0
        e_last = 0
    for e in range(e_first, e_last + 1):
        if GROUPED:
            lo = tl.maximum(cs, tl.load(offs_ptr + e))
            hi = tl.minimum(ce, tl.load(offs_ptr + e + 1))
            param_row = e * F
        else:
            lo = cs
            hi = ce
            param_row = 0
        # Per-segment column vectors with scale and gain folded in: z = s·za + zb.
        if HAS_A:
            a = tl.load(a_ptr + param_row + cols, mask=cmask, other=0.0).to(tl.float32)
            za = a * (scale * gain)
        if HAS_B:
            zb = tl.load(b_ptr + param_row + cols, mask=cmask, other=0.0).to(tl.float32) * gain
        else:
            zb = tl.zeros([BLOCK_F], dtype=tl.float32)
        if not HAS_A:  # κ depends on the column only: compute it once per segment
            kappa_col, dlog_col = _kappa_of(zb, log_u)
        # Per-lane accumulators, reduced over rows once per segment (no cross-warp sum per tile).
        acc_a = tl.zeros([BLOCK_N, BLOCK_F], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_N, BLOCK_F], dtype=tl.float32)
        for r0 in range(lo, hi, BLOCK_N):
            rows = r0 + tl.arange(0, BLOCK_N)
            rmask = rows < hi
            mask = rmask[:, None] & cmask[None, :]
            rows64 = rows.to(tl.int64)[:, None]  # N·stride may exceed 2^31
            # Masked lanes load 0, so g = 0 there and every product below vanishes.
            g = tl.load(g_ptr + rows64 * stride_g + col, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(u_ptr + rows64 * stride_u + col, mask=mask, other=0.0).to(tl.float32)
            if HAS_A:
                s = tl.load(s_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
                kappa, dlog = _kappa_of(s[:, None] * za[None, :] + zb[None, :], log_u)
            else:
                kappa = kappa_col[None, :]
                dlog = dlog_col[None, :]
            sig = tl.sigmoid(kappa * g)
            gs = g * sig
            out = rows64 * F + col
            if not BACKWARD:
                tl.store(h_ptr + out, (gs * u).to(h_ptr.dtype.element_ty), mask=mask)
            else:
                dh = tl.load(dh_ptr + rows64 * stride_dh + col, mask=mask, other=0.0).to(tl.float32)
                dhu = dh * u
                kg1s = kappa * g * (1.0 - sig)
                # dh/dg = σ(1 + κg(1 − σ)); dh/dκ · dκ/dz' = u·gσ·κg(1 − σ)·ln U(1 − t²)·gain for
                # z' = α·scale·s + b (the pre-gain argument).
                tl.store(du_ptr + out, (dh * gs).to(du_ptr.dtype.element_ty), mask=mask)
                d_g = dhu * sig * (1.0 + kg1s)
                tl.store(dg_ptr + out, d_g.to(dg_ptr.dtype.element_ty), mask=mask)
                if NEED_DLOGIT or NEED_DA or NEED_DB:
                    dz = dhu * gs * kg1s * (dlog * gain)
                    if NEED_DLOGIT:
                        tl.store(dlogit_part_ptr + pid_f.to(tl.int64) * N + rows,
                                 tl.sum(dz * a[None, :], axis=1), mask=rmask)
                    if NEED_DA:
                        acc_a += dz * s[:, None]
                    if NEED_DB:
                        acc_b += dz
        slot = pid_c + e if GROUPED else pid_c
        if NEED_DA:
            tl.store(da_part_ptr + slot * F + cols, tl.sum(acc_a, axis=0), mask=cmask)
        if NEED_DB:
            tl.store(db_part_ptr + slot * F + cols, tl.sum(acc_b, axis=0), mask=cmask)
    if GROUPED:  # rows past the last expert's end (sum of the counts < N): zeros, not stale memory
        _zero_rows(tl.maximum(cs, tl.load(offs_ptr + E)), ce, cols, cmask, pid_f, N, F, h_ptr, dg_ptr,
                   du_ptr, dlogit_part_ptr, BACKWARD, NEED_DLOGIT, BLOCK_N, BLOCK_F)


@triton.jit
def _zero_rows(lo, hi, cols, cmask, pid_f, N, F, h_ptr, dg_ptr, du_ptr, dlogit_part_ptr,
               BACKWARD: tl.constexpr, NEED_DLOGIT: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_F: tl.constexpr):
    """Rows [lo, hi) of this program's columns get 0 in every per-row output of the pass."""
    zero = tl.zeros([BLOCK_N, BLOCK_F], dtype=tl.float32)
    for r0 in range(lo, hi, BLOCK_N):
        rows = r0 + tl.arange(0, BLOCK_N)
        rmask = rows < hi
        mask = rmask[:, None] & cmask[None, :]
        out = rows.to(tl.int64)[:, None] * F + cols[None, :]
        if not BACKWARD:
            tl.store(h_ptr + out, zero.to(h_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(dg_ptr + out, zero.to(dg_ptr.dtype.element_ty), mask=mask)
            tl.store(du_ptr + out, zero.to(du_ptr.dtype.element_ty), mask=mask)
            if NEED_DLOGIT:
                tl.store(dlogit_part_ptr + pid_f.to(tl.int64) * N + rows, tl.sum(zero, axis=1), mask=rmask)


@triton.jit(do_not_specialize=_NOT_SPECIALIZED["_reduce_param_grads_kernel"])
def _reduce_param_grads_kernel(da_part_ptr, db_part_ptr, offs_ptr, da_ptr, db_ptr,
                               N, F, chunk_rows, scale,
                               GROUPED: tl.constexpr, NEED_DA: tl.constexpr, NEED_DB: tl.constexpr,
                               BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr):
    """Second stage for d_α, d_b: program (e, j) sums expert e's chunk partials in chunk order."""
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    cmask = cols < F
    if GROUPED:
        lo = tl.load(offs_ptr + e)
        hi = tl.minimum(tl.load(offs_ptr + e + 1), N)
        shift = e
    else:
        lo = 0
        hi = N
        shift = 0
    c_lo = lo // chunk_rows
    # Only the chunks holding a row of e wrote a slot for it; an empty expert reads none.
    c_hi = tl.where(hi > lo, (hi - 1) // chunk_rows + 1, c_lo)
    acc_a = tl.zeros([BLOCK_F], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_F], dtype=tl.float32)
    for c0 in range(c_lo, c_hi, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        ptrs = (c + shift)[:, None] * F + cols[None, :]
        m = (c < c_hi)[:, None] & cmask[None, :]
        if NEED_DA:
            acc_a += tl.sum(tl.load(da_part_ptr + ptrs, mask=m, other=0.0), axis=0)
        if NEED_DB:
            acc_b += tl.sum(tl.load(db_part_ptr + ptrs, mask=m, other=0.0), axis=0)
    if NEED_DA:
        tl.store(da_ptr + e * F + cols, (acc_a * scale).to(da_ptr.dtype.element_ty), mask=cmask)
    if NEED_DB:
        tl.store(db_ptr + e * F + cols, acc_b.to(db_ptr.dtype.element_ty), mask=cmask)


def _rows(t):
    """t with unit column stride (a row stride is fine: gate and up may be views of one fc1 output)."""
    return t if t.stride(1) == 1 else t.contiguous()


def _ptr(t, stand_in):
    """Absent tensors are passed as some other tensor, which the kernel never dereferences."""
    return stand_in if t is None else t


def _empty(shape, dtype, device):
    """A buffer the kernels write in full (tests swap this for NaN-filled buffers to prove it)."""
    return torch.empty(shape, dtype=dtype, device=device)


_record = None  # launch_variants() sets this to collect launches instead of running them


def _run(kernel, grid, args, constexprs, num_warps, params, maxnreg=None):
    if _record is not None:
        _record(kernel, args, constexprs, num_warps, maxnreg)
        return
    limits = {"maxnreg": maxnreg} if maxnreg else {}  # (the interpreter ignores it)
    try:
        kernel[grid](*args, **constexprs, num_warps=num_warps, **limits)
    except Exception as err:  # any failure here means: this machine cannot run it
        raise KappaKernelError(failure_message(err, args[0].device, params["backend"])) from err


def _needs(needs_input_grad, has_a, has_b):
    """(d_logit, d_α, d_b) computed by a backward: asked for by autograd and the term exists."""
    return needs_input_grad[2] and has_a, needs_input_grad[3] and has_a, needs_input_grad[4] and has_b


def _launch(params, gate, up, logit, alpha, bias, offsets, h=None, dh=None, d_gate=None, d_up=None,
            dlogit_part=None, da_part=None, db_part=None):
    n, f = gate.shape
    e = 1 if offsets is None else offsets.shape[0] - 1
    backward = dh is not None
    grid = (triton.cdiv(n, params["chunk_rows"]), triton.cdiv(f, params["block_f"]))
    args = (gate, up, logit, *(_ptr(t, gate) for t in (alpha, bias, offsets, dh, h, d_gate, d_up,
                                                         dlogit_part, da_part, db_part)),
            n, f, e, gate.stride(0), up.stride(0), dh.stride(0) if backward else 0, params["chunk_rows"],
            params["log_u"], params["scale"], params["gain"])
    constexprs = dict(
        HAS_A=alpha is not None, HAS_B=bias is not None, GROUPED=offsets is not None,
        BACKWARD=backward, NEED_DLOGIT=dlogit_part is not None, NEED_DA=da_part is not None,
        NEED_DB=db_part is not None, BLOCK_N=params["block_n"], BLOCK_F=params["block_f"], BLOCK_E=_BLOCK_E)
    _run(_kappa_swiglu_kernel, grid, args, constexprs, NUM_WARPS, params, MAX_REGISTERS)


class _KappaSwiGLUTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, logit, alpha, bias, offsets, params):
        # The logit is read in fp32 whatever its dtype (one kernel variant per I/O dtype).
        ctx.logit_dtype = logit.dtype
        gate, up, logit = _rows(gate), _rows(up), logit.contiguous().float()
        alpha = None if alpha is None else alpha.contiguous()
        bias = None if bias is None else bias.contiguous()
        ctx.save_for_backward(gate, up, logit, alpha, bias, offsets)
        ctx.params = params
        h = _empty(gate.shape, gate.dtype, gate.device)
        if gate.numel():  # an empty grid is not launched
            _launch(params, gate, up, logit, alpha, bias, offsets, h=h)
        return h

    @staticmethod
    def backward(ctx, dh):
        gate, up, logit, alpha, bias, offsets = ctx.saved_tensors
        params = ctx.params
        need = ctx.needs_input_grad
        n, f = gate.shape
        e = 1 if offsets is None else offsets.shape[0] - 1
        need_dlogit, need_da, need_db = _needs(need, alpha is not None, bias is not None)
        # Outputs are contiguous whatever gate's and up's row strides.
        d_gate = _empty(gate.shape, gate.dtype, gate.device)
        d_up = _empty(up.shape, up.dtype, up.device)
        if gate.numel() == 0:  # nothing to launch: the reductions are empty sums
            def zeros(t, needed):
                return torch.zeros_like(t) if needed else None
            d_logit = zeros(logit, need_dlogit)
            return (d_gate, d_up, None if d_logit is None else d_logit.to(ctx.logit_dtype),
                    zeros(alpha, need_da), zeros(bias, need_db), None, None)
        chunk_rows, f_blocks = params["chunk_rows"], triton.cdiv(f, params["block_f"])
        slots = triton.cdiv(n, chunk_rows) + (e - 1 if offsets is not None else 0)
        fp32 = dict(dtype=torch.float32, device=gate.device)
        dlogit_part = _empty((f_blocks, n), **fp32) if need_dlogit else None
        da_part = torch.empty(slots, f, **fp32) if need_da else None
        db_part = torch.empty(slots, f, **fp32) if need_db else None
        _launch(params, gate, up, logit, alpha, bias, offsets, dh=_rows(dh), d_gate=d_gate, d_up=d_up,
                dlogit_part=dlogit_part, da_part=da_part, db_part=db_part)
        d_logit = dlogit_part.sum(0).mul_(params["scale"]).to(ctx.logit_dtype) if need_dlogit else None
        d_alpha = torch.empty_like(alpha) if need_da else None
        d_bias = torch.empty_like(bias) if need_db else None
        if need_da or need_db:
            args = (*(_ptr(t, gate) for t in (da_part, db_part, offsets, d_alpha, d_bias)),
                    n, f, chunk_rows, params["scale"])
            constexprs = dict(GROUPED=offsets is not None, NEED_DA=need_da, NEED_DB=need_db,
                              BLOCK_C=_REDUCE_BLOCK_C, BLOCK_F=params["block_f"])
            _run(_reduce_param_grads_kernel, (e, f_blocks), args, constexprs, _REDUCE_NUM_WARPS, params)
        return (d_gate if need[0] else None, d_up if need[1] else None, d_logit, d_alpha, d_bias,
                None, None)


def default_chunk_rows(n: int, f: int, block_n: int = BLOCK_N, block_f: int = BLOCK_F) -> int:
    """Rows per program: about _TARGET_PROGRAMS programs per pass, a power of 2 ≥ block_n."""
    want_chunks = max(1, _TARGET_PROGRAMS // triton.cdiv(max(f, 1), block_f))
    return max(block_n, triton.next_power_of_2(max(1, triton.cdiv(n, want_chunks))))


check_tiles(BLOCK_N, BLOCK_F, NUM_WARPS)  # the module's own constants, at import
power_of_2("_REDUCE_BLOCK_C", _REDUCE_BLOCK_C, 64)
power_of_2("_REDUCE_NUM_WARPS", _REDUCE_NUM_WARPS, MAX_NUM_WARPS)
power_of_2("_BLOCK_E", _BLOCK_E, 1024)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # I/O dtypes the kernels take


def kappa_swiglu_triton(gate, up, logit, alpha, bias, U, logit_scale, tanh_gain,
                        tokens_per_expert=None, *, block_n: int | None = None,
                        block_f: int | None = None, chunk_rows: int | None = None,
                        backend: str = "triton"):
    """κ-SwiGLU of gate/up [N, F] with router logits [N] through the fused kernels.

    α, b: [F], or [E, F] with `tokens_per_expert` [E] (consecutive rows per expert; rows past
    their sum get 0); either may be None; gate, up, α, b of one dtype in DTYPES. block_n,
    block_f (powers of 2, see check_tiles) and chunk_rows (rows per program) are for tests and
    tuning; the defaults suit large shapes. backend: the `model.kappa.backend` setting that
    chose this path, named in the error if a kernel cannot compile or launch.
    """
    n, f = gate.shape
    block_n = BLOCK_N if block_n is None else block_n
    block_f = BLOCK_F if block_f is None else block_f  # one tile for every F: masked past F
    check_tiles(block_n, block_f, NUM_WARPS, chunk_rows)
    dtypes = {name: t.dtype for name, t in (("gate", gate), ("up", up), ("alpha", alpha), ("bias", bias))
              if t is not None}
    if len(set(dtypes.values())) > 1 or gate.dtype not in DTYPES:
        raise ValueError(f"kappa_swiglu_triton: gate, up, alpha, bias must share one dtype of "
                         f"{[str(d) for d in DTYPES]}, got {dtypes}")
    # the kernels' launch parameters (not a megatron_kappa Config)
    params = dict(log_u=math.log(U), scale=float(logit_scale), gain=float(tanh_gain),
                  block_n=block_n, block_f=block_f, backend=backend,
                  chunk_rows=chunk_rows or default_chunk_rows(n, f, block_n, block_f))
    offsets = None
    if tokens_per_expert is not None:
        # Exclusive cumsum on the device: [0, c0, c0 + c1, ...]; never read on the host.
        ends = tokens_per_expert.to(device=gate.device).cumsum(0, dtype=torch.int32)
        offsets = torch.nn.functional.pad(ends, (1, 0))
    return _KappaSwiGLUTriton.apply(gate, up, logit, alpha, bias, offsets, params)


_TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
                 torch.int64: "i64"}


def launch_variants(dtypes=DTYPES, tiles=((BLOCK_N, BLOCK_F),), f: int = 2 * MAX_BLOCK_F):
    """Every kernel variant the launch code above produces, for ahead-of-time compile checks: a
    list of dicts (kernel, signature, constexprs, attrs, num_warps, maxnreg) as `triton.compile(ASTSource(
    ...))` takes them. Found by running this module's own forward and backward on meta tensors
    for each dtype, tile, α/b ablation, grouping and set of inputs wanting gradients, with each
    launch recorded instead of run, so the list follows the code. gate and up are the halves
    of one [N, 2F] tensor, as in the model; `attrs` marks 16-divisible ints and 16-byte aligned
    pointers the way Triton specialises them at a launch with this F (a multiple of 16 by default;
    an odd F gives the unaligned variants)."""
    global _record
    found = {}

    def record(kernel, args, constexprs, num_warps, maxnreg):
        names = kernel.arg_names
        signature = {name: "*" + _TRITON_TYPES[a.dtype] if isinstance(a, torch.Tensor) else
                     "fp32" if isinstance(a, float) else "i32" for name, a in zip(names, args)}
        aligned = [i for i, a in enumerate(args) if names[i] not in _NOT_SPECIALIZED[kernel.__name__] and (
            a.storage_offset() * a.element_size() % 16 == 0 if isinstance(a, torch.Tensor)
            else isinstance(a, int) and a % 16 == 0)]
        signature.update({k: "constexpr" for k in constexprs})
        key = (kernel.__name__, tuple(signature.items()), tuple(constexprs.items()), tuple(aligned), num_warps,
               maxnreg)
        found.setdefault(key, dict(kernel=kernel, signature=signature, constexprs=dict(constexprs),
                                   attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
                                   num_warps=num_warps, maxnreg=maxnreg))

    n, e = 64, 3
    _record = record
    try:
        for dtype, (block_n, block_f), has_a, has_b, grouped, wants in itertools.product(
                dtypes, tiles, [True, False], [True, False], [False, True],
                itertools.product([True, False], repeat=3)):
            meta = dict(device="meta", dtype=dtype)
            fc1 = torch.empty(n, 2 * f, **meta).requires_grad_()
            gate, up = fc1.chunk(2, dim=1)
            logit = torch.empty(n, device="meta").requires_grad_(wants[0])
            shape = (e, f) if grouped else (f,)
            alpha = torch.empty(shape, **meta).requires_grad_(wants[1]) if has_a else None
            bias = torch.empty(shape, **meta).requires_grad_(wants[2]) if has_b else None
            counts = torch.empty(e, dtype=torch.int64, device="meta") if grouped else None
            h = kappa_swiglu_triton(gate, up, logit, alpha, bias, 3.0, 1.0, 1.0, counts,
                                    block_n=block_n, block_f=block_f)
            h.backward(torch.empty_like(h))
    finally:
        _record = None
    return list(found.values())
