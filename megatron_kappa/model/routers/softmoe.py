"""The SoftMoE router's pieces (megatron_kappa.routers' `softmoe` entry): its router (with the
logit channel for κ experts), the MoE layer that runs a variable number of experts per token,
and its metrics for metrics.jsonl (logging steps only; one all-reduce for all layers).

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
from functools import partial

import torch
import torch.distributed as dist

from megatron_kappa import routers
from megatron_kappa.config import MoEConfig
from megatron_kappa.kappa import KappaSettings
from megatron_kappa.model import softmoe
from megatron_kappa.model.softmoe_dispatch import SoftMoELayer


def softmoe_router(moe: MoEConfig, kappa: KappaSettings | None):
    """The SoftMoE router, with the logit channel for κ experts."""
    if kappa is None:
        return partial(softmoe.SoftMoERouter, settings=softmoe.softmoe_settings(moe))
    return partial(softmoe.KappaSoftMoERouter, settings=softmoe.softmoe_settings(moe), kappa=kappa)


def softmoe_layer(moe: MoEConfig, kappa: bool):
    """The SoftMoE layer: a variable number of experts per token (the logit carried for κ)."""
    return partial(SoftMoELayer, carry_logit=kappa)


def softmoe_stats(model, device: torch.device) -> dict:
    layers = softmoe.softmoe_routers(model)  # [(decoder layer index, SoftMoE router)]
    if not layers:
        return {}
    counts = torch.stack([r.pop_counts(device) for _, r in layers])  # [L, E + 2]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    counts = counts.cpu().double()
    k = layers[0][1]._allocation.k().detach().cpu().double()
    E = counts.shape[1] - 2
    out, hits = {}, []
    for (index, _), row, k_l in zip(layers, counts, k):
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
    out["softmoe/active_mean"] = sum(out[f"softmoe/layer{i}/active_mean"] for i, _ in layers) / len(layers)
    if hits and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"warning: SoftMoE tokens over model.moe.softmoe.max_experts ({layers[0][1].settings.max_experts}), "
              f"kept its largest weights: {', '.join(hits)}", file=sys.stderr, flush=True)
    return out


routers.implement("softmoe", router=softmoe_router, layer=softmoe_layer, metrics=softmoe_stats)
