"""The κ experts' scaling by the routing probabilities: three ways of (κ-SwiGLU · p).

    python bench/probs_scaling.py [--tokens 8192] [--ffn 1024] [--dtype fp32] [--reps 5] [--set k=v ...]

All run κ-SwiGLU and scale its output by p, on the same inputs in the same run:
  autograd   h · p under autograd: keeps h for p's gradient beside the scaled output (the baseline)
  remade     `ScaledByProbs` (the Triton path): keeps p only and makes h again in backward (one
             more κ-SwiGLU forward)
  fused      the torch op scaling by p itself (the CPU path, megatron_kappa/kappa/reference.py):
             p's gradient from the h its backward computes anyway (torch backend only)
Printed: the bytes each keeps for backward (saved_tensors_hooks: each storage once, read when the
forward ends) and the median fwd+bwd time, each as a ratio over autograd's. Then, on the CPU, a
whole forward and backward of configs/tiny.yaml (with --set), one process, the three ways in turn.
"""
from __future__ import annotations

import argparse
import statistics
import time

from megatron_kappa.entry import start

start()  # first: the known library notices filtered before the imports below can print (megatron_kappa/entry.py)

import torch  # noqa: E402

from megatron_kappa.kappa import kappa_swiglu  # noqa: E402
from megatron_kappa.model import experts  # noqa: E402
from megatron_kappa.model.experts import ScaledByProbs  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def scaled(method, leaves, backend):
    gate, up, logit, alpha, bias, probs = leaves
    settings = (4.0, 1.0, 1.0)
    if method == "fused":
        return kappa_swiglu(gate, up, logit, alpha, bias, *settings, backend="torch", probs=probs)
    h = kappa_swiglu(gate, up, logit, alpha, bias, *settings, backend=backend)
    if method == "autograd":
        return (h * probs.unsqueeze(-1)).to(gate.dtype)
    def remake(*inputs):
        return kappa_swiglu(*inputs, *settings, backend=backend)
    return ScaledByProbs.apply(h, probs, gate.dtype, remake, gate, up, logit, alpha, bias)


def kept_bytes(method, leaves, backend) -> int:
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        scaled(method, leaves, backend)
    return sum(s.nbytes() for s in storages.values())


def step_ms(method, leaves, dy, backend, reps, device) -> float:
    def once():
        scaled(method, leaves, backend).backward(dy)
        for t in leaves:
            t.grad = None
    once()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        once()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def model_step_ms(overrides, reps) -> dict:
    """Median fwd+bwd ms of one micro-batch of tiny, each way in turn, twice (the first of each
    pass warms up). The experts take the fused op on the CPU; `remade` and `autograd` go the
    Triton path's way (model/experts.py's backend check answering "not torch"), with autograd's
    h · p put in place of ScaledByProbs for the latter."""
    from megatron_kappa.config import load_config
    from megatron_kappa.model.build import build_model
    from megatron_kappa.parallel.groups import init_distributed
    cfg = load_config("configs/tiny.yaml", ["data.mock=true", *overrides])
    init_distributed(cfg.parallel, seed=0, device="cpu")
    torch.manual_seed(0)
    model = build_model(cfg, torch.device("cpu"))
    model.train()
    b, s = cfg.train.micro_batch, cfg.model.seq_length
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s))
    positions = torch.arange(s).expand(b, -1)
    remade, backend_of = ScaledByProbs.apply, experts.resolve_backend

    def autograd(h, probs, dtype, remake, *inputs):
        return (h * probs.unsqueeze(-1)).to(dtype)

    def unfused(backend, device):
        return "unfused"

    def once():
        model(tokens, positions, None, labels=tokens).float().mean().backward()
        model.zero_grad(set_to_none=True)
    ways = {"autograd": (autograd, unfused), "remade": (remade, unfused), "fused": (remade, backend_of)}
    times = {name: [] for name in ways}
    try:
        for _ in range(2):
            for name, (scale, backend) in ways.items():
                experts.ScaledByProbs.apply, experts.resolve_backend = scale, backend
                once()
                for _ in range(reps):
                    start = time.perf_counter()
                    once()
                    times[name].append((time.perf_counter() - start) * 1e3)
    finally:
        experts.ScaledByProbs.apply, experts.resolve_backend = remade, backend_of
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="routed rows")
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--dtype", choices=DTYPES, default="fp32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--set", nargs="*", default=["model.seq_length=512", "model.hidden_size=256",
                                                 "model.ffn_hidden_size=1024", "train.micro_batch=2"],
                    metavar="KEY=VALUE", help="the whole-model part's overrides of configs/tiny.yaml")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "triton" if device.type == "cuda" else "torch"
    dtype, n, f = DTYPES[args.dtype], args.tokens, args.ffn
    gen = torch.Generator().manual_seed(0)
    def r(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(device, dt)
    leaves = [r(n, f), r(n, f), r(n, dt=torch.float32) * 3, r(f) * 0.1, r(f) * 0.1,
              torch.rand(n, generator=gen).to(device)]
    leaves = [t.requires_grad_() for t in leaves]
    dy = r(n, f)
    print(f"{n} rows × {f}, {args.dtype}, κ-SwiGLU backend {backend} on {device.type}")
    methods = ["autograd", "remade"] + (["fused"] if backend == "torch" else [])
    kept = {m: kept_bytes(m, leaves, backend) for m in methods}
    ms = {m: step_ms(m, leaves, dy, backend, args.reps, device) for m in methods}
    print(f"{'':<14}{'kept MB':>9}{'fwd+bwd ms':>12}{'kept/autograd':>15}{'time/autograd':>15}")
    for m in methods:
        print(f"{m:<14}{kept[m] / 1e6:>9.1f}{ms[m]:>12.1f}{kept[m] / kept['autograd']:>15.3f}"
              f"{ms[m] / ms['autograd']:>15.2f}")
    if device.type == "cpu":
        whole = model_step_ms(args.set, args.reps)
        print(f"tiny ({' '.join(args.set)}), one micro-batch fwd+bwd: "
              + ", ".join(f"{k} {v:.0f} ms ({v / whole['autograd']:.3f}×)" for k, v in whole.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
