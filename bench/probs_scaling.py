"""The κ experts' scaling by the routing probabilities: `ScaledByProbs` against autograd's h · p.

    python bench/probs_scaling.py [--tokens 8192] [--ffn 1024] [--dtype fp32] [--reps 5] [--set k=v ...]

Both run κ-SwiGLU (the torch op; the Triton kernels on CUDA) and scale its output by p, on the
same inputs in the same run. Autograd's h · p keeps h for p's gradient beside the scaled output;
ScaledByProbs keeps only p and makes h again in backward (one more κ-SwiGLU forward). Printed:
the bytes each keeps for backward (saved_tensors_hooks: each storage once, read when the forward
ends) and the median fwd+bwd time, each as a ratio over autograd's. Then a whole forward and
backward of configs/tiny.yaml (with --set), one process, both ways in turn (autograd's h · p put
back in place of ScaledByProbs for the baseline).
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
    """Median fwd+bwd ms of one micro-batch of tiny, with ScaledByProbs and with autograd's h · p,
    alternated twice (the first of each pair warms up)."""
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
    remade = ScaledByProbs.apply

    def autograd(h, probs, dtype, remake, *inputs):
        return (h * probs.unsqueeze(-1)).to(dtype)

    def once():
        model(tokens, positions, None, labels=tokens).float().mean().backward()
        model.zero_grad(set_to_none=True)
    times = {"autograd": [], "remade": []}
    try:
        for _ in range(2):
            for name, fn in (("autograd", autograd), ("remade", remade)):
                experts.ScaledByProbs.apply = fn
                once()
                for _ in range(reps):
                    start = time.perf_counter()
                    once()
                    times[name].append((time.perf_counter() - start) * 1e3)
    finally:
        experts.ScaledByProbs.apply = remade
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
    base_bytes, base_ms = kept_bytes("autograd", leaves, backend), step_ms("autograd", leaves, dy, backend,
                                                                           args.reps, device)
    mine_bytes, mine_ms = kept_bytes("remade", leaves, backend), step_ms("remade", leaves, dy, backend,
                                                                         args.reps, device)
    print(f"{'':<14}{'kept MB':>9}{'fwd+bwd ms':>12}")
    print(f"{'autograd h·p':<14}{base_bytes / 1e6:>9.1f}{base_ms:>12.1f}")
    print(f"{'ScaledByProbs':<14}{mine_bytes / 1e6:>9.1f}{mine_ms:>12.1f}")
    print(f"ScaledByProbs / autograd: kept {mine_bytes / base_bytes:.3f}, time {mine_ms / base_ms:.2f}")
    if device.type == "cpu":
        ms = model_step_ms(args.set, args.reps)
        print(f"tiny ({' '.join(args.set)}), one micro-batch fwd+bwd: autograd h·p {ms['autograd']:.0f} ms, "
              f"ScaledByProbs {ms['remade']:.0f} ms, ratio {ms['remade'] / ms['autograd']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
