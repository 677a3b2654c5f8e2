"""The rates the planner's step-time estimate assumes, measured on this device (issue 37).

    python bench/plan_rates.py [--quick] [--json FILE]

By default the estimate (plan.speed) charges every matmul and the attention at one
rate (--tflops) and nothing per layer and micro-batch beyond the traffic's latency; the planner's
--attention-tflops and --layer-ms take what this measures. Against NVIDIA's
Qwen3-235B-A22B runs on H100s (docs/plan.md, bench/plan_published_measured.py) it is within 2-7 %
where each rank's micro-batch holds 4,096 tokens, and 0.57 of the measured time where it holds
1,024. This measures what would tell the candidates apart, in one process, the shapes' passes
interleaved (megatron_kappa/bench/interleave.py):

  square     a large square GEMM: the baseline, what --tflops stands for;
  dense      Qwen3-235B's q/k/v and output projections for one micro-batch split over TP (4,096
             tokens over TP2 and TP4, 16,384 over TP4: megatron's sequence parallelism gathers the
             whole micro-batch before the column-parallel GEMM);
  experts    torch's grouped GEMM, fc1 then fc2 forward, at the rows each rank's experts get in
             those layouts: 4 experts x 4,096 rows (TP2 EP32), 16 x 512 (TP4 EP8, 4K tokens),
             16 x 2,048 (TP4 EP8, 16K);
  attention  causal SDPA at 4,096 and 16,384 tokens, TP4's 16 query heads over 1 KV group;
  layer      the cost per layer and micro-batch that does not grow with the tokens: this project's
             model (configs/moe8.yaml on a GPU, configs/tiny.yaml on the CPU), forward + backward
             at two sequence lengths, the line through them at zero tokens, per layer.

Prints each shape's TFLOP/s and its ratio to the square GEMM's (FLOPs: 2 per multiply-add; the
attention's causal half). --quick: every size / 16, for a check of the script (the CPU: fp32).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from megatron_kappa.entry import start

start()  # first: the known library notices filtered before the imports below can print (megatron_kappa/entry.py)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_kappa.bench.interleave import sync, time_interleaved  # noqa: E402

H, Q_HEADS, KV_GROUPS, HEAD_DIM, EXPERT_FFN = 4096, 64, 4, 128, 1536  # Qwen3-235B-A22B


def gemm_flops(m: int, k: int, n: int) -> float:
    return 2.0 * m * k * n


def experts_flops(experts: int, rows: int, h: int, ffn: int) -> float:
    """fc1 (h -> 2 ffn, SwiGLU's gate and up) and fc2 (ffn -> h) over every expert's rows."""
    return experts * (gemm_flops(rows, h, 2 * ffn) + gemm_flops(rows, ffn, h))


def attention_flops(seq: int, heads: int, head_dim: int) -> float:
    """QKᵀ and AV over the causal half of the s² scores, one sequence."""
    return 2 * 2.0 * heads * seq * seq * head_dim / 2


def shapes(scale: int) -> dict:
    """name -> (FLOPs, make(device, dtype) -> a zero-argument pass)."""
    h, d, ffn = H // scale, HEAD_DIM // min(scale, 8), EXPERT_FFN // scale
    out = {"square": (gemm_flops(8192 // scale, 8192 // scale, 8192 // scale),
                      lambda dev, dt, n=8192 // scale: _gemm(n, n, n, dev, dt))}
    for tokens, tp in ((4096, 2), (4096, 4), (16384, 4)):
        m, q, kv = tokens // scale, Q_HEADS * d // tp, 2 * KV_GROUPS * d // tp
        out[f"dense qkv, {tokens} tokens / TP{tp}"] = (gemm_flops(m, h, q + kv),
                                                      lambda dev, dt, m=m, n=q + kv: _gemm(m, h, n, dev, dt))
        out[f"dense out, {tokens} tokens / TP{tp}"] = (gemm_flops(m, q, h),
                                                      lambda dev, dt, m=m, k=q: _gemm(m, k, h, dev, dt))
    for experts, rows, what in ((4, 4096, "TP2 EP32"), (16, 512, "TP4 EP8, 4K"), (16, 2048, "TP4 EP8, 16K")):
        r = rows // scale
        out[f"experts {experts} x {rows} rows ({what})"] = (
            experts_flops(experts, r, h, ffn), lambda dev, dt, e=experts, r=r: _experts(e, r, h, ffn, dev, dt))
    for seq in (4096, 16384):
        s, heads = seq // scale, Q_HEADS // 4
        out[f"attention {seq} tokens, 16 heads"] = (attention_flops(s, heads, d),
                                                   lambda dev, dt, s=s: _attention(s, heads, d, dev, dt))
    return out


def _gemm(m, k, n, device, dtype):
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    return lambda: a @ b


def _experts(experts, rows, h, ffn, device, dtype):
    x = torch.randn(experts * rows, h, device=device, dtype=dtype)
    w1 = torch.randn(experts, h, 2 * ffn, device=device, dtype=dtype) / h ** 0.5
    w2 = torch.randn(experts, ffn, h, device=device, dtype=dtype) / ffn ** 0.5
    offs = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * rows

    def run():
        gate, up = F.grouped_mm(x, w1, offs=offs).chunk(2, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, w2, offs=offs)
    return run


def _attention(seq, heads, head_dim, device, dtype):
    """The one KV group repeated over the query heads (as megatron's core attention gets it), so
    that SDPA may take its fused kernels whatever they make of GQA."""
    q = torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(1, 1, seq, head_dim, device=device, dtype=dtype).repeat(1, heads, 1, 1) for _ in range(2))
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)


def layer_cost(device, quick: bool, reps: int) -> dict:
    """Milliseconds per layer and micro-batch at zero tokens: the model's forward + backward at
    sequence lengths s and 2s, extrapolated along their line."""
    from megatron_kappa.bench.model_step import build_step
    from megatron_kappa.config import load_config
    from megatron_kappa.parallel.groups import init_distributed
    config = "configs/tiny.yaml" if device.type == "cpu" else "configs/moe8.yaml"
    short = 64 if quick else 256
    sets = ["data.mock=true", "parallel.ep=1", f"precision={'fp32' if device.type == 'cpu' else 'bf16'}"]
    cfgs = {s: load_config(config, [*sets, f"model.seq_length={s}"]) for s in (short, 2 * short)}
    init_distributed(cfgs[short].parallel, 0, cfgs[short].model.moe.num_experts)
    steps = {}
    for s, cfg in cfgs.items():
        steps[s] = build_step(cfg, device, 1)[1]
        steps[s]()  # warm-up
    ms = time_interleaved(steps, reps, device)
    at_zero = 2 * ms[short] - ms[2 * short]
    layers = cfgs[short].model.num_layers
    return {"config": config, "tokens": [short, 2 * short], "ms": [ms[short], ms[2 * short]],
            "ms_at_zero_tokens": at_zero, "layers": layers, "ms_per_layer": at_zero / layers}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="every size / 16 (a check of the script)")
    ap.add_argument("--reps", type=int, default=None, help="timed passes per shape (default 20, 3 with --quick)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reps = args.reps or (3 if args.quick else 20)
    table = shapes(16 if args.quick else 1)
    passes = {name: make(device, dtype) for name, (_, make) in table.items()}
    for run in passes.values():
        run()  # warm-up
    sync(device)
    ms = time_interleaved(passes, reps, device)
    rates = {name: table[name][0] / (ms[name] / 1e3) / 1e12 for name in table}
    print(f"device {device} | {dtype} | {reps} passes each, interleaved")
    print(f"{'shape':<44}{'ms':>9}{'TFLOP/s':>10}{'/ square':>10}")
    rows = []
    for name in table:
        ratio = rates[name] / rates["square"]
        print(f"{name:<44}{ms[name]:>9.3f}{rates[name]:>10.2f}{ratio:>10.3f}")
        rows.append({"shape": name, "ms": ms[name], "tflops": rates[name], "vs_square": ratio})
    layer = layer_cost(device, args.quick, reps)
    print(f"per layer and micro-batch at zero tokens ({layer['config']}, {layer['layers']} layers, forward + "
          f"backward at {layer['tokens'][0]} and {layer['tokens'][1]} tokens: {layer['ms'][0]:.2f} and "
          f"{layer['ms'][1]:.2f} ms): {layer['ms_per_layer']:.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "dtype": str(dtype), "shapes": rows,
                                               "layer": layer}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
