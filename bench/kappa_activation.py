"""κ-SwiGLU vs plain SwiGLU activation: forward+backward time and peak memory, as ratios.

    python bench/kappa_activation.py [--tokens 4096] [--ffn 3072] [--dtype fp32] [--reps 5]
    python bench/kappa_activation.py --tokens 32768 65536 --ffn 3072 4096 --dtype bf16   # on a GPU

All variants are measured in the same run on the same inputs: plain `silu(g)·u` (eager), and
`kappa_swiglu` with each backend available on the device ("torch": the reference op; "triton":
the fused kernels, CUDA only). Time: median of `reps` fwd+bwd passes.
Peak memory: on CUDA, torch.cuda.max_memory_allocated; on CPU, each variant runs in a fresh
subprocess and reports its peak RSS above the RSS with the inputs already allocated (glibc serves
these large tensors with mmap, so RSS follows allocations).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from megatron_kappa.entry import start

start()  # first: the known library notices filtered before the imports below can print (megatron_kappa/entry.py)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_kappa.kappa import kappa_swiglu  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# variant → backend of kappa_swiglu (None: plain SwiGLU)
BACKENDS = {"swiglu": None, "kappa": "torch", "kappa_triton": "triton"}


def variants(device) -> list[str]:
    return ["swiglu", "kappa"] + (["kappa_triton"] if torch.device(device).type == "cuda" else [])


def activation(variant, g, u, s, a, b):
    if BACKENDS[variant] is None:
        return F.silu(g) * u
    return kappa_swiglu(g, u, s, a, b, backend=BACKENDS[variant])


def make_inputs(n, f, dtype, device):
    gen = torch.Generator(device="cpu").manual_seed(0)
    def r(*s):
        return torch.randn(*s, generator=gen).to(device=device, dtype=dtype)
    g, u, grad = (r(n, f).requires_grad_(), r(n, f).requires_grad_(), r(n, f))
    s = (r(n) * 3).requires_grad_()
    a, b = (r(f) * 0.1).requires_grad_(), (r(f) * 0.1).requires_grad_()
    return g, u, s, a, b, grad


def step(variant, g, u, s, a, b, grad):
    out = activation(variant, g, u, s, a, b)
    out.backward(grad)
    for t in (g, u, s, a, b):
        t.grad = None


def expert_step(variant, x, w1, w2, s, a, b, grad):
    """A whole expert, fc1 → activation → fc2, forward and backward."""
    gate, up = (x @ w1.T).chunk(2, dim=-1)
    act = activation(variant, gate, up, s, a, b)
    (act @ w2.T).backward(grad)
    for t in (x, w1, w2, s, a, b):
        t.grad = None


def time_expert_ms(variant, n, f, h, dtype, reps, device) -> float:
    gen = torch.Generator(device="cpu").manual_seed(0)
    def r(*sh, k=1.0):
        return (torch.randn(*sh, generator=gen) * k).to(device=device, dtype=DTYPES[dtype]).requires_grad_()
    args = (r(n, h), r(2 * f, h, k=h ** -0.5), r(h, f, k=f ** -0.5), r(n, k=3.0), r(f, k=0.1), r(f, k=0.1),
            torch.randn(n, h, generator=gen).to(device=device, dtype=DTYPES[dtype]))
    return _timed(lambda: expert_step(variant, *args), reps, device)


def peak_bytes(variant, n, f, dtype, device) -> int:
    inputs = make_inputs(n, f, DTYPES[dtype], device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(variant, *inputs)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    step(variant, *inputs)  # warm-up allocations outside the measurement
    proc = subprocess.run([sys.executable, __file__, "--_child", variant, str(n), str(f), dtype],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout.strip().splitlines()[-1])


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(variant, n, f, dtype):
    torch.set_num_threads(1)
    inputs = make_inputs(n, f, DTYPES[dtype], "cpu")
    base = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    step(variant, *inputs)
    print((_status_kb("VmHWM") - base) * 1024)


def _timed(fn, reps, device) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def time_ms(variant, inputs, reps, device) -> float:
    return _timed(lambda: step(variant, *inputs), reps, device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 2048])
    ap.add_argument("--ffn", type=int, nargs="+", default=[3072, 5120])
    ap.add_argument("--hidden", type=int, default=768, help="d_model for the whole-expert timing")
    ap.add_argument("--dtype", choices=DTYPES, default="fp32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--_child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        variant, n, f, dtype = args._child
        return child(variant, int(n), int(f), dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = variants(device)
    rows = []
    print(f"device {device}, dtype {args.dtype}, threads {torch.get_num_threads()}; ratios against swiglu")
    print("activation alone, forward + backward:")
    print(f"{'tokens':>7} {'ffn':>6} " + " ".join(f"{v + ' ms':>16} {'x':>6} {'MB':>8} {'mem x':>6}" for v in names))
    for n, f in zip(args.tokens, args.ffn):
        inputs = make_inputs(n, f, DTYPES[args.dtype], device)
        t = {v: time_ms(v, inputs, args.reps, device) for v in names}
        del inputs
        m = {v: peak_bytes(v, n, f, args.dtype, device) for v in names}
        row = dict(tokens=n, ffn=f, dtype=args.dtype, device=device)
        for v in names:
            row.update({f"{v}_ms": t[v], f"{v}_time_ratio": t[v] / t["swiglu"], f"{v}_mb": m[v] / 2**20,
                        f"{v}_memory_ratio": m[v] / m["swiglu"]})
        rows.append(row)
        print(f"{n:>7} {f:>6} " + " ".join(f"{t[v]:>16.2f} {t[v] / t['swiglu']:>6.2f} {m[v] / 2**20:>8.1f} "
                                          f"{m[v] / m['swiglu']:>6.3f}" for v in names))
    print(f"\nwhole expert (fc1 → activation → fc2), d_model {args.hidden}, forward + backward:")
    print(f"{'tokens':>7} {'ffn':>6} " + " ".join(f"{v + ' ms':>16} {'x':>6}" for v in names))
    for row in rows:
        n, f = row["tokens"], row["ffn"]
        t = {v: time_expert_ms(v, n, f, args.hidden, args.dtype, args.reps, device) for v in names}
        for v in names:
            row.update({f"expert_{v}_ms": t[v], f"expert_{v}_time_ratio": t[v] / t["swiglu"]})
        print(f"{n:>7} {f:>6} " + " ".join(f"{t[v]:>16.2f} {t[v] / t['swiglu']:>6.2f}" for v in names))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
