"""model.compile against eager: forward + backward time per step and compile time, as ratios.

    python bench/compile.py                          # CPU: tiny and the paper block at moe8's shapes, sliced
    python bench/compile.py --cases tiny --reps 2    # the quick check (make gpu-check --cpu)
    python bench/compile.py --config configs/moe8.yaml --set parallel.ep=1 --precision bf16 \\
        --micro-batch 4 --kappa-vs-plain             # one GPU (make gpu-check): MFU, κ vs plain compiled

Each case builds the same config eager and compiled (megatron_kappa/model/compile.py: each
transformer layer compiled, the MoE dispatch eager at its named boundary). The compile time is the
first compiled variant's first forward + backward less an eager one (a later variant reuses its
dense layers' graphs); then the variants' passes (no
optimizer) alternate (bench/interleave.py) and each one's median over `reps` is taken. With
--kappa-vs-plain, plain SwiGLU experts compiled too: κ's cost over plain with both compiled. MFU
needs a GPU's peak (megatron_kappa.metrics.throughput; log.peak_tflops sets it elsewhere).
The graph breaks outside the named boundary, counted by Dynamo's counters, are printed (0 expected).

This bench compiles: Dynamo is on here whatever the environment says (TORCHDYNAMO_DISABLE is dropped).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

# moe8 (the paper block: nanochat, κ scaled) at its width, head and expert shapes, sliced to two
# layers (one dense, one MoE), 8 of its 64 experts, 256 tokens and an 8192 vocabulary to fit a CPU
PAPER_SLICED = ["model.num_layers=2", "model.first_dense=1", "model.aspect_ratio=null", "model.hidden_size=768",
                "model.num_attention_heads=6", "model.head_dim=128", "model.moe.num_experts=8",
                "model.seq_length=256", "model.vocab_size=8192", "parallel.ep=1"]
CASES = {"tiny": ("configs/tiny.yaml", []), "paper": ("configs/moe8.yaml", PAPER_SLICED)}


def summarize(ms: dict, first_ms: dict, tokens: int, flops_per_token: dict, peak_tflops: float | None) -> list[dict]:
    """The rows: each variant's median ms, compiled/eager and κ/plain ratios, compile seconds (its
    first pass less the eager median) and MFU (None without a peak). `ms`, `first_ms` and
    `flops_per_token` are keyed by (activation, mode)."""
    rows = []
    for (act, mode), t in ms.items():
        eager = ms.get((act, "eager"))
        plain = ms.get(("plain", mode))
        tflops = flops_per_token[(act, mode)] * tokens / (t / 1e3) / 1e12
        rows.append({"activation": act, "mode": mode, "ms": t,
                     "compiled_over_eager": t / eager if mode == "compiled" and eager else None,
                     "kappa_over_plain": t / plain if act == "kappa" and plain else None,
                     # the first compiled variant's: a later one reuses its dense layers' graphs
                     "compile_s": max(first_ms[(act, mode)] - (eager or t), 0.0) / 1e3
                     if (act, mode) == next(k for k in ms if k[1] == "compiled") else None,
                     "tflops": tflops, "mfu": tflops / peak_tflops if peak_tflops else None})
    return rows


def measure(config: str, sets: list, precision: str, micro_batch: int, reps: int, kappa_vs_plain: bool) -> dict:
    from megatron_kappa.bench.interleave import sync, time_interleaved
    from megatron_kappa.bench.model_step import build_step
    from megatron_kappa.config import load_config
    from megatron_kappa.metrics import throughput
    from megatron_kappa.model import compile as model_compile
    from megatron_kappa.parallel.groups import init_distributed
    from megatron_kappa.summary import count

    variants = [("kappa", "eager"), ("kappa", "compiled")] + ([("plain", "compiled")] if kappa_vs_plain else [])
    cfgs = {(act, mode): load_config(config, ["data.mock=true", *sets, f"precision={precision}",
                                              f"model.kappa.enabled={act == 'kappa'}"]) for act, mode in variants}
    base = cfgs[variants[0]]
    device = init_distributed(base.parallel, base.train.seed, base.model.moe.num_experts)
    steps, first, flops = {}, {}, {}
    breaks_before = model_compile.graph_breaks()["other"]
    for key, cfg in cfgs.items():
        model, step = build_step(cfg, device, micro_batch)
        if key[1] == "compiled":
            model_compile.compile_layers(model)
        start = time.perf_counter()
        step()  # the compiled one compiles here
        sync(device)
        first[key] = (time.perf_counter() - start) * 1e3
        step()  # warm-up
        steps[key] = step
        flops[key] = throughput.flops_per_token(cfg.model, count(model, cfg))
    ms = time_interleaved(steps, reps, device)
    tokens = micro_batch * base.model.seq_length
    return {"config": config, "set": sets, "precision": precision, "device": str(device),
            "micro_batch": micro_batch, "tokens": tokens, "threads": torch.get_num_threads(),
            "graph_breaks": model_compile.graph_breaks()["other"] - breaks_before,
            "rows": summarize(ms, first, tokens, flops, throughput.peak_tflops(base.log, device))}


def show(result: dict):
    print(f"{result['config']} {' '.join(result['set'])} | {result['precision']} | device {result['device']} | "
          f"micro-batch {result['micro_batch']} | threads {result['threads']} | "
          f"graph breaks {result['graph_breaks']}")
    print(f"{'activation':<10} {'mode':<9} {'ms':>9} {'compiled/eager':>14} {'κ/plain':>8} {'compile s':>9} {'MFU':>6}")
    def fmt(v, f):
        return "" if v is None else format(v, f)
    for r in result["rows"]:
        print(f"{r['activation']:<10} {r['mode']:<9} {r['ms']:>9.1f} {fmt(r['compiled_over_eager'], '.3f'):>14} "
              f"{fmt(r['kappa_over_plain'], '.3f'):>8} {fmt(r['compile_s'], '.1f'):>9} {fmt(r['mfu'], '.3f'):>6}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--config", help="one config instead of the cases (with --set)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kappa-vs-plain", action="store_true", help="plain SwiGLU experts compiled too")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    # this bench compiles: Dynamo on whatever the environment says (torch.compile reads the variable)
    os.environ.pop("TORCHDYNAMO_DISABLE", None)
    torch._dynamo.config.disable = False
    cases = [(args.config, args.set)] if args.config else [(CASES[c][0], CASES[c][1] + args.set) for c in args.cases]
    results = []
    for config, sets in cases:
        results.append(measure(config, sets, args.precision, args.micro_batch, args.reps, args.kappa_vs_plain))
        show(results[-1])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["graph_breaks"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
