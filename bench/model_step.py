"""Whole-model forward + backward from `build_model`, on this machine's device, as ratios.

    python bench/model_step.py [--config configs/tiny.yaml] [--micro-batch 4] [--reps 5] [--set k=v ...]
    python bench/model_step.py --config configs/moe8.yaml --set parallel.ep=1 precision=bf16   # one GPU

Four variants of the same config in one run: plain SwiGLU and κ-SwiGLU experts, each as grouped
GEMMs and as megatron's per-expert loop (SequentialMLP). Time is the median of `reps` forward +
backward passes (no optimizer) after one warm-up; the op count is what the profiler sees in
one pass (CUDA kernels on a GPU, aten ops on the CPU), a proxy for launch overhead; peak
memory is measured on CUDA only. Ratios are against plain SwiGLU with the per-expert loop, and
κ against plain with the same experts.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_kappa.config import load_config  # noqa: E402
from megatron_kappa.model.build import build_model, moe_layer_pattern  # noqa: E402
from megatron_kappa.parallel.groups import init_distributed  # noqa: E402

VARIANTS = [("plain", "sequential"), ("kappa", "sequential"), ("plain", "grouped"), ("kappa", "grouped")]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(cfg, device, micro_batch: int, reps: int) -> dict:
    torch.manual_seed(0)
    model = build_model(cfg, device)
    seq, vocab = cfg.model.seq_length, cfg.model.vocab_size
    tokens = torch.randint(0, vocab, (micro_batch, seq), device=device)
    position = torch.arange(seq, device=device).expand(micro_batch, -1)

    def step():
        loss = model(tokens, position, None, labels=tokens).float().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up (allocator, kernels' first launch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        step()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    activity = [torch.profiler.ProfilerActivity.CUDA if device.type == "cuda" else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activity) as prof:
        step()
        sync(device)
    kind = torch.autograd.DeviceType.CUDA if device.type == "cuda" else torch.autograd.DeviceType.CPU
    ops = sum(1 for e in prof.events() if e.device_type == kind and (device.type == "cuda" or e.name.startswith("aten::")))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del model
    return {"ms": statistics.median(times), "ops": ops, "peak_gib": peak}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    base = load_config(args.config, ["data.mock=true", *args.set])
    if not any(moe_layer_pattern(base)):
        raise SystemExit("error: the config has no MoE layer")
    device = init_distributed(base.parallel, base.train.seed, base.model.moe.num_experts)
    rows = {}
    for act, experts in VARIANTS:
        cfg = load_config(args.config, ["data.mock=true", *args.set, f"model.kappa.enabled={act == 'kappa'}",
                                        f"model.moe.grouped_gemm={experts == 'grouped'}"])
        rows[(act, experts)] = measure(cfg, device, args.micro_batch, args.reps)
    ref = rows[("plain", "sequential")]["ms"]
    print(f"{args.config} {' '.join(args.set)} | device {device} | micro-batch {args.micro_batch} × "
          f"{base.model.seq_length} | {base.precision} | threads {torch.get_num_threads()}")
    print(f"{'experts':<11} {'activation':<10} {'ms':>9} {'vs loop plain':>14} {'κ/plain':>8} {'ops':>7} {'peak GiB':>9}")
    out = []
    for (act, experts), r in rows.items():
        kappa_ratio = r["ms"] / rows[("plain", experts)]["ms"]
        peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"{experts:<11} {act:<10} {r['ms']:>9.1f} {r['ms'] / ref:>14.3f} {kappa_ratio:>8.3f} {r['ops']:>7} {peak:>9}")
        out.append({"experts": experts, "activation": act, **r, "vs_loop_plain": r["ms"] / ref,
                    "kappa_over_plain": kappa_ratio, "device": str(device), "config": args.config,
                    "set": args.set, "micro_batch": args.micro_batch})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
