"""Throughput accounting: model FLOPs per token, achieved TFLOP/s per GPU, and MFU.

Model FLOPs per trained token, as Megatron and nanochat count them:
    6 × (active parameters − the input embedding)      forward 2, backward 4 per weight
  + 12 × layers × (heads · head_dim) × sequence length  attention scores and values, fwd + bwd
Active parameters are the summary's (all weights but the routed experts, plus top-k/E of them);
the input embedding is a lookup, not a matmul, so it is left out. MFU divides the achieved
TFLOP/s per GPU by the device's dense bf16 peak: from `log.peak_tflops`, else from the table
below by device name; on the CPU there is no peak and no MFU.
"""
from __future__ import annotations

import torch

from megatron_kappa.config import LogConfig, ModelConfig

# Dense bf16 peak, TFLOP/s per GPU (vendor data sheets, without sparsity).
PEAK_BF16_TFLOPS = {"GH200": 989.0, "H200": 989.0, "H100": 989.0, "H800": 989.0, "B200": 2250.0,
                    "A100": 312.0, "A800": 312.0, "L40S": 362.0}


def flops_per_token(m: ModelConfig, counts: dict) -> float:
    """`counts` is megatron_kappa.summary.count of the model (the full model's numbers)."""
    input_embedding = counts["by_category"]["embedding"] / 2  # untied: input and output are equal in size
    heads_dim = m.num_attention_heads * (m.head_dim or m.hidden_size // m.num_attention_heads)
    return 6.0 * (counts["active_params_per_token"] - input_embedding) + \
        12.0 * m.num_layers * heads_dim * m.seq_length


def peak_tflops(log: LogConfig, device: torch.device) -> float | None:
    if log.peak_tflops is not None:
        return log.peak_tflops
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def throughput(tokens_per_s: float, flops_token: float, world: int, peak: float | None) -> dict:
    """tokens/s of the whole job → TFLOP/s per GPU and (with a peak) MFU."""
    tflops = tokens_per_s * flops_token / world / 1e12
    out = {"tflops_per_gpu": tflops}
    if peak:
        out["mfu"] = tflops / peak
    return out
