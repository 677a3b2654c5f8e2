"""Training throughput of a paper config on one device: tokens/s, TFLOP/s, MFU, peak memory.

    python bench/throughput.py --config configs/moe8.yaml                  # one GPU (EP1, bf16)
    python bench/throughput.py --config configs/sandwich28.yaml --layers 8 # a slice that fits
    python bench/throughput.py --config configs/tiny.yaml --recompute none selective full

Plain SwiGLU and κ-SwiGLU experts of the same config in one run (and each `--recompute`
setting): full training steps (forward, backward, AdamW; the model on one device, EP1, the sorted
dispatcher (no host sync) unless --set says otherwise, no DeepSpeed). Both models are built and
warmed up, then their steps alternate (megatron_kappa/bench/interleave.py) and each one's median is taken. FLOPs
per token as megatron_kappa.metrics.throughput counts them for the model measured (so a slice is
counted as the slice); MFU against the device's bf16 peak (GPU only). Peak memory of one step: on
CUDA the peak allocated above what was allocated before that variant was built (its weights,
optimizer state and activations); on the CPU the high-water RSS above the RSS before the step.
"busy" is the share of the step the GPU spends in kernels (profiler), the rest being launch
overhead and host work. Ratios are κ against plain with the same recompute setting.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from megatron_kappa.entry import start

start()  # first: the known library notices filtered before the imports below can print (megatron_kappa/entry.py)

import torch  # noqa: E402

from megatron_kappa import routers  # noqa: E402
from megatron_kappa.bench.interleave import sync, time_interleaved  # noqa: E402
from megatron_kappa.config import load_config  # noqa: E402
from megatron_kappa.metrics import throughput  # noqa: E402
from megatron_kappa.model.build import build_model  # noqa: E402
from megatron_kappa.parallel.groups import init_distributed  # noqa: E402
from megatron_kappa.summary import count  # noqa: E402
from megatron_kappa.train.loop import lm_loss  # noqa: E402


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def build_step(cfg, device, micro_batch: int):
    """The model, its optimizer and one training step on a fixed batch."""
    torch.manual_seed(0)
    model = build_model(cfg, device)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    seq = cfg.model.seq_length
    tokens = torch.randint(0, cfg.model.vocab_size, (micro_batch, seq), device=device)
    position = torch.arange(seq, device=device).expand(micro_batch, -1)
    batch = {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones_like(tokens, dtype=torch.float32)}

    def step():
        loss = lm_loss(model, batch, position)  # the training loop's loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, step


def peak_gib(step, device, allocated_before: int) -> float:
    """One step's peak memory: on CUDA the peak allocated minus what was allocated before this
    variant was built (its weights, optimizer state and activations, not the other variant's); on
    the CPU the high-water RSS during the step above the RSS before it."""
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step()
        sync(device)
        return (torch.cuda.max_memory_allocated(device) - allocated_before) / 2**30
    base_kb = _rss_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from here
    step()
    return (_rss_kb("VmHWM") - base_kb) / 2**20


def busy_share(step, device):
    """The share of one step's wall time that the GPU spends in kernels (None on the CPU)."""
    if device.type != "cuda":
        return None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        sync(device)
        wall = time.perf_counter() - start
    kernel_us = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return kernel_us / 1e6 / wall


def measure(cfgs: dict, device, micro_batch: int, steps: int) -> dict:
    """Each named config's row; their timed steps are interleaved (megatron_kappa/bench/interleave.py)."""
    built = {}
    for name, cfg in cfgs.items():
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        model, step = build_step(cfg, device, micro_batch)
        for _ in range(2):  # warm-up: allocator, first launches, optimizer state
            step()
        built[name] = (cfg, model, step, peak_gib(step, device, before))
    ms = time_interleaved({name: b[2] for name, b in built.items()}, steps, device)
    rows = {}
    for name, (cfg, model, step, peak) in built.items():
        seconds, tokens = ms[name] / 1e3, micro_batch * cfg.model.seq_length
        flops = throughput.flops_per_token(cfg.model, count(model, cfg))
        rows[name] = {"ms": ms[name], "tokens_per_s": tokens / seconds,
                      **throughput.throughput(tokens / seconds, flops, 1, throughput.peak_tflops(cfg.log, device)),
                      "peak_gib": peak, "busy": busy_share(step, device)}
    del built
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/moe8.yaml")
    ap.add_argument("--layers", type=int, help="keep this many layers (a slice that fits one device)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--recompute", nargs="+", default=["none"], choices=["none", "selective", "full"])
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    sets = ["data.mock=true", "parallel.ep=1", "parallel.tp=1", *args.set]
    exact_topk = routers.lookup(load_config(args.config, sets).model.moe.router).topk  # what sorted needs
    if exact_topk and not any("dispatcher" in s for s in args.set):
        sets.insert(3, "model.moe.dispatcher=sorted")  # one device: the dispatcher without host syncs
    if args.layers:
        base = load_config(args.config, sets)
        sets.append(f"model.num_layers={args.layers}")
        if base.model.layout == "moe":
            sets.append(f"model.first_dense={min(base.model.first_dense, args.layers - 1)}")
    if not any(s.startswith("precision=") for s in args.set) and not torch.cuda.is_available():
        sets.append("precision=fp32")  # bf16 on a CPU measures the CPU's bf16 emulation
    base = load_config(args.config, sets)
    device = init_distributed(base.parallel, base.train.seed, base.model.moe.num_experts)
    rows = []
    for recompute in args.recompute:
        cfgs = {act: load_config(args.config, [*sets, f"model.recompute={recompute}",
                                               f"model.kappa.enabled={act == 'kappa'}"])
                for act in ("plain", "kappa")}
        for act, row in measure(cfgs, device, args.micro_batch, args.steps).items():
            rows.append({"activation": act, "recompute": recompute, **row})
    print(f"{args.config} {' '.join(sets[3:])} | device {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}) | micro-batch "
          f"{args.micro_batch} × {base.model.seq_length} | {base.precision} | layers {base.model.num_layers}")
    print(f"{'recompute':<10} {'experts':<7} {'ms/step':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} "
          f"{'busy':>5} {'peak GiB':>8} {'κ/plain':>8}")
    for row in rows:
        plain = next(r for r in rows if r["recompute"] == row["recompute"] and r["activation"] == "plain")
        row["kappa_over_plain"] = row["ms"] / plain["ms"]
        def fmt(v, f):
            return "" if v is None else format(v, f)
        print(f"{row['recompute']:<10} {row['activation']:<7} {row['ms']:>9.1f} {row['tokens_per_s']:>10.0f} "
              f"{row['tflops_per_gpu']:>8.3g} {fmt(row.get('mfu'), '.1%'):>6} {fmt(row['busy'], '.0%'):>5} "
              f"{fmt(row['peak_gib'], '.2f'):>8} {row['kappa_over_plain']:>8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps([{**r, "config": args.config, "set": sets, "device": str(device)}
                                               for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
