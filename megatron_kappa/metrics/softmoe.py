"""SoftMoE metrics for metrics.jsonl (logging steps only; one all-reduce for all layers).

Per SoftMoE layer N (the decoder layer index, as in the κ metrics):
  softmoe/layerN/k             k_l, the layer's learned mean number of active experts
  softmoe/layerN/active_mean   experts run per training token since the last logging step
  softmoe/layerN/active_hist   [E + 1] fractions of those tokens that ran 0, 1, …, E experts
  softmoe/layerN/cap_hits      fraction of them that wanted more than model.moe.softmoe.max_experts
and softmoe/k_mean (= the budget while no clamp is active) and softmoe/active_mean over layers.
Counts are summed over all ranks: with sequence, data and expert parallelism every rank routes
its own tokens. A window with cap hits also prints a warning line (rank 0).
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from megatron_kappa.model.softmoe import softmoe_routers


def softmoe_stats(model, device: torch.device) -> dict:
    routers = softmoe_routers(model)
    if not routers:
        return {}
    counts = torch.stack([r.pop_counts(device) for _, r in routers])  # [L, E + 2]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    counts = counts.cpu().double()
    k = routers[0][1]._allocation.k().detach().cpu().double()
    E = counts.shape[1] - 2
    out, hits = {}, []
    for (index, _), row, k_l in zip(routers, counts, k):
        tokens = row[: E + 1].sum().clamp_min(1.0)
        hist = row[: E + 1] / tokens
        prefix = f"softmoe/layer{index}"
        out[f"{prefix}/k"] = k_l.item()
        out[f"{prefix}/active_mean"] = (hist * torch.arange(E + 1)).sum().item()
        out[f"{prefix}/active_hist"] = [round(v, 6) for v in hist.tolist()]
        out[f"{prefix}/cap_hits"] = (row[E + 1] / tokens).item()
        if row[E + 1] > 0:
            hits.append(f"layer {index}: {out[f'{prefix}/cap_hits']:.2%}")
    out["softmoe/k_mean"] = k.mean().item()
    out["softmoe/active_mean"] = sum(out[f"softmoe/layer{i}/active_mean"] for i, _ in routers) / len(routers)
    if hits and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"warning: SoftMoE tokens over model.moe.softmoe.max_experts ({routers[0][1].settings.max_experts}), "
              f"kept its largest weights: {', '.join(hits)}", file=sys.stderr, flush=True)
    return out
