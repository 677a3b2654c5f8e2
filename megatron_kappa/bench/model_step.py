"""Whole-model forward + backward from `build_model`, on this machine's device, as ratios.

    python bench/model_step.py [--config configs/tiny.yaml] [--micro-batch 4] [--reps 5] [--set k=v ...]
    python bench/model_step.py --config configs/moe8.yaml --set parallel.ep=1 precision=bf16   # one GPU
    python bench/model_step.py --config configs/moe8.yaml --set parallel.ep=1 --precisions bf16 fp8

Four variants of the same config in one run: plain SwiGLU and κ-SwiGLU experts, each as grouped
GEMMs and as megatron's per-expert loop (SequentialMLP). With --precisions: plain and κ grouped
experts in each precision given (e.g. bf16 fp8), with time and peak-memory ratios against the first. All four models are
built and warmed up,
then their forward + backward passes (no optimizer) alternate (megatron_kappa/bench/interleave.py) and each
one's median over `reps` is taken. The op count is what the profiler sees in one pass (CUDA
kernels on a GPU, aten ops on the CPU), a proxy for launch overhead; peak memory is measured on
CUDA only (that variant's weights, gradients and activations). Ratios are against plain SwiGLU
with the per-expert loop (or the first precision), and κ against plain with the same experts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from megatron_kappa.bench.interleave import sync, time_interleaved
from megatron_kappa.config import load_config
from megatron_kappa.model import fp8
from megatron_kappa.model.build import build_model
from megatron_kappa.model.layout import model_layout
from megatron_kappa.parallel.groups import init_distributed

VARIANTS = [("plain", "sequential"), ("kappa", "sequential"), ("plain", "grouped"), ("kappa", "grouped")]


def build_step(cfg, device, micro_batch: int):
    """The model and one forward + backward pass (no optimizer) on a fixed batch."""
    torch.manual_seed(0)
    model = build_model(cfg, device)
    seq, vocab = cfg.model.seq_length, cfg.model.vocab_size
    tokens = torch.randint(0, vocab, (micro_batch, seq), device=device)
    position = torch.arange(seq, device=device).expand(micro_batch, -1)

    def step():
        loss = model(tokens, position, None, labels=tokens).float().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
    return model, step


def op_count(step, device) -> int:
    """Ops the profiler sees in one pass: CUDA kernels, or aten ops on the CPU."""
    activity = [torch.profiler.ProfilerActivity.CUDA if device.type == "cuda" else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activity) as prof:
        step()
        sync(device)
    kind = torch.autograd.DeviceType.CUDA if device.type == "cuda" else torch.autograd.DeviceType.CPU
    return sum(1 for e in prof.events()
               if e.device_type == kind and (device.type == "cuda" or e.name.startswith("aten::")))


def measure(cfgs: dict, device, micro_batch: int, reps: int) -> dict:
    """Each named config's row; their timed passes are interleaved (megatron_kappa/bench/interleave.py)."""
    built = {}
    for name, cfg in cfgs.items():
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        model, step = build_step(cfg, device, micro_batch)
        step()  # warm-up (allocator, kernels' first launch)
        peak = None
        if device.type == "cuda":  # this variant's weights, gradients and activations
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            sync(device)
            peak = (torch.cuda.max_memory_allocated(device) - before) / 2**30
        built[name] = (model, step, peak)
    ms = time_interleaved({name: b[1] for name, b in built.items()}, reps, device)
    rows = {name: {"ms": ms[name], "ops": op_count(step, device), "peak_gib": peak}
            for name, (model, step, peak) in built.items()}
    del built
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE")
    ap.add_argument("--precisions", nargs="+", choices=["fp32", "bf16", "fp8"],
                    help="compare these precisions (grouped experts, plain and κ; ratios against the "
                         "first) instead of the four expert variants")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    base = load_config(args.config, ["data.mock=true", *args.set])
    if not model_layout(base).has_moe:
        raise SystemExit("error: the config has no MoE layer")
    if args.precisions:  # (activation, experts, precision); the baseline: the first precision
        variants = [(act, "grouped", p) for p in args.precisions for act in ("plain", "kappa")]
        def baseline(act, experts, p):
            return (act, experts, args.precisions[0])
        against = f"vs {args.precisions[0]}"
    else:
        variants = [(act, experts, base.precision) for act, experts in VARIANTS]
        def baseline(act, experts, p):
            return ("plain", "sequential", p)
        against = "vs loop plain"
    cfgs = {}
    for act, experts, precision in variants:  # each config is checked (fp8 widths) before any build
        cfgs[(act, experts, precision)] = load_config(args.config, [
            "data.mock=true", *args.set, f"model.kappa.enabled={act == 'kappa'}",
            f"model.moe.grouped_gemm={experts == 'grouped'}", f"precision={precision}"])
    device = init_distributed(base.parallel, base.train.seed, base.model.moe.num_experts)
    rows = measure(cfgs, device, args.micro_batch, args.reps)
    print(f"{args.config} {' '.join(args.set)} | device {device} | micro-batch {args.micro_batch} × "
          f"{base.model.seq_length} | threads {torch.get_num_threads()}")
    if "fp8" in (args.precisions or [base.precision]):
        print(fp8.describe((cfgs[variants[-1]] if args.precisions else base).model.fp8, device))
    print(f"{'experts':<11} {'activation':<10} {'precision':<9} {'ms':>9} {against:>14} {'κ/plain':>8} "
          f"{'ops':>7} {'peak GiB':>9} {'peak ratio':>10}")
    out = []
    for (act, experts, precision), r in rows.items():
        ref = rows[baseline(act, experts, precision)]
        kappa_ratio = r["ms"] / rows[("plain", experts, precision)]["ms"]
        peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        peak_ratio = "" if r["peak_gib"] is None else f"{r['peak_gib'] / ref['peak_gib']:.3f}"
        print(f"{experts:<11} {act:<10} {precision:<9} {r['ms']:>9.1f} {r['ms'] / ref['ms']:>14.3f} "
              f"{kappa_ratio:>8.3f} {r['ops']:>7} {peak:>9} {peak_ratio:>10}")
        out.append({"experts": experts, "activation": act, "precision": precision, **r,
                    "vs_baseline": r["ms"] / ref["ms"], "baseline": list(baseline(act, experts, precision)),
                    "kappa_over_plain": kappa_ratio, "device": str(device), "config": args.config,
                    "set": args.set, "micro_batch": args.micro_batch})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
