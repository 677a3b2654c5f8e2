"""The reference κ-SwiGLU op in plain torch: the CPU path of `kappa_swiglu` and the tests' oracle.

    h = g · σ(κ g) · u,   κ = U ** tanh(gain · (α · (scale · s) + b))

g, u: the expert's gate and up projections [N, F]; s: the raw router logit of each row's
expert [N]; α, b: per gate unit [F] (or [E, F] for rows grouped by expert: each row takes its
expert's). scale = gain = 1 is the paper; the authors' code uses scale 0.15 and gain 2. α = None or
b = None are the paper's ablations (that term ≡ 0).

The backward is explicit so that autograd saves only g, u and s (plain SwiGLU saves g, silu(g)
and u): κ and σ(κg) are recomputed from them instead of being stored as [N, F] tensors. Both
passes walk the rows in chunks, so their temporaries are small (bench/kappa_activation.py measures
time and peak memory against plain SwiGLU). Math is done in the input dtype. The experts call it
once over all their rows, scaled by the routing probabilities in the same op (bench/
kappa_moe_layer.py: a call per expert, and h made a third time for p's gradient, were most of the
elementwise calls the κ MoE layer made beyond the authors').
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _kappa(logit, alpha, bias, log_u, scale, gain):
    """κ as a fresh [N, F] tensor ([N, 1] when both α and b are ablated). α, b: [F], or [N, F]
    (each row's own, gathered by expert: the grouped layout)."""
    if alpha is not None:
        z = torch.outer(logit * scale, alpha) if alpha.dim() == 1 else alpha.mul((logit * scale).unsqueeze(1))
        if bias is not None:
            z.add_(bias)
    elif bias is not None:
        z = bias.expand(logit.shape[0], -1).clone()
    else:
        z = logit.new_zeros(logit.shape[0], 1)
    if gain != 1.0:
        z.mul_(gain)
    return z.tanh_().mul_(log_u).exp_()


# Rows per chunk: temporaries are [rows, F] slices of about 1 MB, so κ, σ(κg) and friends never
# exist as full [N, F] tensors (forward or backward) and stay in cache while they are used.
_CHUNK_ELEMENTS = 1 << 18


def _rows_per_chunk(f: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(f, 1))


def _row_chunks(n: int, f: int, start: int = 0):
    step = _rows_per_chunk(f)
    return [slice(start + i, start + min(i + step, n)) for i in range(0, n, step)]


def _chunks(n: int, f: int, counts: list | None) -> list:
    """The row chunks a pass walks, each with its expert segments [(expert, rows)] (one segment,
    expert None, without `counts`). Grouped rows: whole segments gathered up to a chunk's size,
    and a segment larger than that cut as a call for that expert alone would cut it, so each
    expert's α, b and logit gradients are summed over the same pieces, in the same order, as when
    the op was called expert by expert (bit for bit, tests/test_kappa.py)."""
    if counts is None:
        return [(rows, [(None, rows)]) for rows in _row_chunks(n, f)]
    step = _rows_per_chunk(f)
    chunks, segments, start = [], [], 0
    def close():
        if segments:
            chunks.append((slice(segments[0][1].start, segments[-1][1].stop), list(segments)))
            segments.clear()
    for e, count in enumerate(counts):
        if count > step:
            close()
            chunks += [(piece, [(e, piece)]) for piece in _row_chunks(count, f, start)]
        elif count:
            if segments and segments[-1][1].stop - segments[0][1].start + count > step:
                close()
            segments.append((e, slice(start, start + count)))
        start += count
    close()
    return chunks


def _per_row(p, chunk_segments):
    """α or b for a chunk's rows: the one [F] vector, or each row's expert's [F] row."""
    if p is None or chunk_segments[0][0] is None:
        return p
    if len(chunk_segments) == 1:
        return p[chunk_segments[0][0]]
    # from p's own rows, no index tensor made from host ints (a host-to-device copy on a GPU)
    return torch.cat([p[e].expand(rows.stop - rows.start, -1) for e, rows in chunk_segments])


class KappaSwiGLU(torch.autograd.Function):
    """h = κ-SwiGLU(gate, up) over rows [N, F], optionally scaled by each row's routing probability:
    (h · p).to(out_dtype), as the experts use it. Rows may be grouped by expert (`counts`, host
    ints) with α, b [E, F]: one pass over all rows, each row with its expert's α and b (the
    elementwise work over chunks of several experts' rows, the sums per expert). With p,
    p's gradient Σ_f dy·h is made from the h the backward computes anyway, so h is neither kept
    nor made a second time (model/experts.py's ScaledByProbs remakes it, for the Triton path)."""

    @staticmethod
    def forward(ctx, gate, up, logit, alpha, bias, U, scale, gain, counts=None, probs=None, out_dtype=None):
        dt = gate.dtype
        def cast(t):
            return None if t is None else t.to(dt)
        s, a, b = logit.to(dt), cast(alpha), cast(bias)
        log_u = math.log(U)
        out = torch.empty_like(gate, dtype=out_dtype or dt)
        for rows, segments in _chunks(*gate.shape, counts):
            kappa = _kappa(s[rows], _per_row(a, segments), _per_row(b, segments), log_u, scale, gain)
            # g·σ(κg) written as silu(κg)/κ: at κ = 1 this is bit-for-bit torch's silu(g).
            h = F.silu(kappa * gate[rows], inplace=True).div_(kappa)
            if probs is None:
                torch.mul(h, up[rows], out=out[rows])
            else:
                out[rows] = (h.mul_(up[rows]) * probs[rows].unsqueeze(-1)).to(out.dtype)
        ctx.save_for_backward(gate, up, logit, alpha, bias, probs)
        ctx.consts = (U, scale, gain, counts)
        return out

    @staticmethod
    def backward(ctx, dy_out):
        gate, up, logit, alpha, bias, probs = ctx.saved_tensors
        U, scale, gain, counts = ctx.consts
        log_u = math.log(U)
        dt = gate.dtype
        s = logit.to(dt)
        a = None if alpha is None else alpha.to(dt)
        b = None if bias is None else bias.to(dt)
        need = ctx.needs_input_grad
        need_z = (a is not None and any(need[2:4])) or (b is not None and need[4])
        # U = 1 (the start of the authors' U ramp): κ ≡ 1, so dκ/dz = 0 and the logit, α and b
        # gradients stay 0 (the formula below would divide ln κ by ln U = 0).
        need_z = need_z and log_u != 0.0

        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        d_logit = torch.zeros_like(s) if need[2] else None
        d_alpha = torch.zeros_like(a) if a is not None and need[3] else None
        d_bias = torch.zeros_like(b) if b is not None and need[4] else None
        d_probs = torch.empty_like(probs) if probs is not None and need[9] else None
        for rows, segments in _chunks(*gate.shape, counts):
            g, u = gate[rows], up[rows]
            kappa = _kappa(s[rows], _per_row(a, segments), _per_row(b, segments), log_u, scale, gain)
            kg = kappa * g
            sig = torch.sigmoid(kg)
            act = F.silu(kg, inplace=True).div_(kappa)  # g·σ(κg), as forward
            del kg
            if probs is None:
                dy = dy_out[rows]
            else:  # the gradients autograd gives (h · p).to(out_dtype), in h · p's dtype
                dy_hp, p = dy_out[rows].to(torch.result_type(act, probs)), probs[rows].unsqueeze(-1)
                if d_probs is not None:
                    d_probs[rows] = (dy_hp * (act * u)).sum(-1)
                dy = (dy_hp * p).to(dt)
            torch.mul(act, dy, out=d_up[rows])
            # d(gσ(κg))/dg = σ(1 + κg(1-σ)) =: E;  κ · d(gσ(κg))/dκ = κg²σ(1-σ) = g(E - σ)
            e = torch.sub(1.0, sig).mul_(g).mul_(kappa).add_(1.0).mul_(sig)
            grad_act = torch.mul(dy, u)
            if need_z:
                # dz = dh·u · g(E - σ) · ln U · gain · (1 - t²), with t = ln κ / ln U
                dz = sig.sub_(e).neg_().mul_(g).mul_(grad_act)
                dz.mul_(kappa.log_().div_(log_u).square_().neg_().add_(1.0)).mul_(log_u * gain)
                # α, b and the logit's gradients: summed per expert segment of the chunk
                for expert, seg in segments:
                    dz_e, a_e = dz[seg.start - rows.start:seg.stop - rows.start], a
                    d_alpha_e, d_bias_e = d_alpha, d_bias
                    if expert is not None:
                        a_e = None if a is None else a[expert]
                        d_alpha_e = None if d_alpha is None else d_alpha[expert]
                        d_bias_e = None if d_bias is None else d_bias[expert]
                    if d_logit is not None and a_e is not None:
                        torch.mv(dz_e, a_e, out=d_logit[seg]).mul_(scale)
                    if d_alpha_e is not None:
                        d_alpha_e.addmv_(dz_e.T, s[seg], alpha=scale)
                    if d_bias_e is not None:
                        d_bias_e.add_(dz_e.sum(0))
            torch.mul(e, grad_act, out=d_gate[rows])
        def to(x, ref):
            return None if x is None or ref is None else x.to(ref.dtype)
        return (d_gate, d_up, to(d_logit, logit), to(d_alpha, alpha), to(d_bias, bias),
                None, None, None, None, d_probs, None)


def kappa_swiglu_torch(gate, up, logit, alpha, bias, U, logit_scale, tanh_gain, counts=None, probs=None,
                       out_dtype=None):
    """κ-SwiGLU of gate/up [N, F] with router logits [N] and per-unit α, b [F] (either may be None);
    or of rows grouped by expert, `counts` (host ints) rows each, with α, b [E, F]. With `probs`
    [N]: (h · p).to(out_dtype or the gate's dtype), the experts' scaling by the routing
    probabilities, fused."""
    return KappaSwiGLU.apply(gate, up, logit, alpha, bias, float(U), float(logit_scale), float(tanh_gain),
                             None if counts is None else [int(c) for c in counts], probs, out_dtype)


def kappa_swiglu_traced(gate, up, logit, alpha, bias, U, logit_scale, tanh_gain, tokens_per_expert=None):
    """The same κ-SwiGLU as plain differentiable ops, for model.compile: inductor fuses the
    elementwise work into its own kernels and derives the backward (autograd then keeps what
    inductor's partitioner chooses). KappaSwiGLU's row chunks and the grouped path's expert counts
    read on the host would break the graph and recompile at every new row count; here each row's
    α and b are gathered by its expert index instead. α, b: [F], or [E, F] with
    `tokens_per_expert` [E]; either may be None."""
    dt = gate.dtype
    n = gate.shape[0]
    if tokens_per_expert is not None and (alpha is not None or bias is not None):
        counts = tokens_per_expert.to(gate.device, non_blocking=True)  # the host counts: no sync
        expert = torch.repeat_interleave(torch.arange(counts.shape[0], device=gate.device), counts, output_size=n)
        alpha = None if alpha is None else alpha[expert]
        bias = None if bias is None else bias[expert]
    if alpha is not None:
        z = (logit.to(dt) * logit_scale).unsqueeze(-1) * alpha.to(dt)
        if bias is not None:
            z = z + bias.to(dt)
    elif bias is not None:
        z = bias.to(dt).expand(n, -1)
    else:
        z = gate.new_zeros(n, 1)
    if tanh_gain != 1.0:
        z = z * tanh_gain
    kappa = torch.exp(torch.tanh(z) * math.log(U))
    return F.silu(kappa * gate) / kappa * up


def kappa_values(logit, alpha, bias, U, logit_scale, tanh_gain):
    """κ [N, F] itself, for statistics and references."""
    return _kappa(logit, alpha, bias, math.log(U), logit_scale, tanh_gain)
