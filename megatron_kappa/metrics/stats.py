"""κ's spread and the router losses for metrics.jsonl: κ statistics per MoE layer from the last
forward's logits, the aux and z losses that entered the objective.

Everything here runs on logging steps only: its collectives take tensors on the model's device
(NCCL refuses CPU tensors), and the numbers are read on the host once, at the end."""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_kappa.model.experts import KappaExpertActivation, routed_logits
from megatron_kappa.model.layout import layer_label
from megatron_kappa.parallel.groups import dp_mean, merge_stages, pipeline_sum, stage_group

_SAMPLE = 20000  # κ values per rank and layer used for the quantiles


def kappa_layers(model):
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, KappaExpertActivation) and m.kappa is not None]


def kappa_stats(model, device: torch.device, histograms: dict | None = None) -> dict:
    """Per κ layer: mean κ, 5% / 95% quantiles of κ, mean |α|, mean |b| (collective: over the
    ranks of each pipeline stage for its layers, then merged over the stages). `histograms`, when
    given, receives each layer's κ sample as `kappa/<layer>` (this stage's layers)."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    group = stage_group()
    for name, layer in kappa_layers(model):
        values = []
        for e, logits in enumerate(routed_logits(layer)):
            if logits.numel():
                values.append(layer.kappa_of(logits.float(), e).reshape(-1))
        local = torch.cat(values).cpu() if values else torch.zeros(0)
        if local.numel() > _SAMPLE:
            local = local[torch.randperm(local.numel(), generator=gen)[:_SAMPLE]]
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)  # CPU tensors: pickled, whatever the backend
        kappa = torch.cat(gathered)
        sums = torch.zeros(4, dtype=torch.float64, device=device)
        for i, p in enumerate((layer.kappa_alpha, layer.kappa_bias)):
            if p is not None:
                sums[2 * i] = p.detach().abs().double().sum()
                sums[2 * i + 1] = p.numel()
        dist.all_reduce(sums, group=group)  # replicas count equally, so the mean is unchanged by them
        sums = sums.cpu()
        prefix = f"kappa/{layer_label(model, name + '.')}"
        if kappa.numel():
            if histograms is not None:
                histograms[prefix] = kappa
            q = torch.quantile(kappa.double(), torch.tensor([0.05, 0.95], dtype=torch.float64))
            out.update({f"{prefix}/mean": kappa.mean().item(), f"{prefix}/bottom5": q[0].item(),
                        f"{prefix}/top5": q[1].item()})
        out[f"{prefix}/alpha_abs"] = (sums[0] / sums[1]).item() if sums[1] else 0.0
        out[f"{prefix}/bias_abs"] = (sums[2] / sums[3]).item() if sums[3] else 0.0
    return merge_stages(out)


def router_losses(config: TransformerConfig, micro_batches: int, device: torch.device) -> dict:
    """Weighted aux and z losses (what entered the objective), summed over layers, averaged over
    micro-batches and DP ranks; clears megatron's tracker for the next step. Each entry is first
    combined over the groups its router named, as megatron's own reduction does: under sequence
    parallelism a TP rank records its tokens' share of the balance loss (summed over the TP group)
    and its tokens' mean z-loss (averaged over TP × DP). Every rank of those groups sits on the
    same stage and holds the same entries, so the collectives match."""
    tracker = get_moe_metrics_tracker()
    totals = torch.zeros(2, device=device)
    for key, entry in tracker.metrics.items():
        value = entry.values.sum()
        if entry.reduce_group is not None:
            dist.all_reduce(value, group=entry.reduce_group)
        if entry.avg_group is not None:  # gloo has no AVG
            dist.all_reduce(value, group=entry.avg_group)
            value = value / dist.get_world_size(entry.avg_group)
        if key == "z_loss":
            totals[1] += value * (config.moe_z_loss_coeff or 0.0)
        else:
            totals[0] += value * (config.moe_aux_loss_coeff or 0.0)
    tracker.clear()
    aux, z = dp_mean(pipeline_sum(totals) / micro_batches).tolist()  # each stage has its layers
    return {"aux_loss": aux, "z_loss": z}


def mtp_loss(micro_batches: int, device: torch.device) -> dict:
    """The multi-token-prediction loss (model.mtp; unweighted, mean over its depths and micro-batches,
    DP-averaged) from megatron's MTP tracker, which it then clears. Called on every rank of a run
    with MTP, also on the pipeline stages without its depths (their share is 0), so that every rank
    enters the same collectives in the same order (a stage that skipped them left the others
    waiting in the pipeline sum: a hang at the first logging step)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    values = MTPLossLoggingHelper.tracker.get("loss_values")
    total = torch.zeros((), device=device) if values is None else \
        values.to(device).sum() / (values.numel() * micro_batches)
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    return {"mtp_loss": dp_mean(pipeline_sum(total)).item()}
