"""Metrics: one JSON line per log interval in <run.dir>/metrics.jsonl, the same to TensorBoard,
and a progress line on stdout. κ statistics per MoE layer come from the last forward's logits.

Everything here runs on logging steps only: its collectives take tensors on the model's device
(NCCL refuses CPU tensors), and the numbers are read on the host once, at the end."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

from megatron_kappa.model.experts import KappaExpertActivation, routed_logits
from megatron_kappa.model.layout import global_layer_index
from megatron_kappa.parallel.groups import dp_mean, merge_stages, pipeline_sum, stage_group

_SAMPLE = 20000  # κ values per rank and layer used for the quantiles


def kappa_layers(model):
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, KappaExpertActivation) and m.kappa is not None]


def kappa_stats(model, device: torch.device) -> dict:
    """Per κ layer: mean κ, 5% / 95% quantiles of κ, mean |α|, mean |b| (collective: over the
    ranks of each pipeline stage for its layers, then merged over the stages)."""
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
        prefix = f"kappa/layer{global_layer_index(model, name)}"
        if kappa.numel():
            q = torch.quantile(kappa.double(), torch.tensor([0.05, 0.95], dtype=torch.float64))
            out.update({f"{prefix}/mean": kappa.mean().item(), f"{prefix}/bottom5": q[0].item(),
                        f"{prefix}/top5": q[1].item()})
        out[f"{prefix}/alpha_abs"] = (sums[0] / sums[1]).item() if sums[1] else 0.0
        out[f"{prefix}/bias_abs"] = (sums[2] / sums[3]).item() if sums[3] else 0.0
    return merge_stages(out)


def router_losses(config, micro_batches: int, device: torch.device) -> dict:
    """Weighted aux and z losses (what entered the objective), summed over layers, averaged over
    micro-batches and DP ranks; clears megatron's tracker for the next step."""
    tracker = get_moe_metrics_tracker()
    totals = torch.zeros(2, device=device)
    for key, entry in tracker.metrics.items():
        if key == "z_loss":
            totals[1] += entry.values.sum() * (config.moe_z_loss_coeff or 0.0)
        else:
            totals[0] += entry.values.sum() * (config.moe_aux_loss_coeff or 0.0)
    tracker.clear()
    aux, z = dp_mean(pipeline_sum(totals) / micro_batches).tolist()  # each stage has its layers
    return {"aux_loss": aux, "z_loss": z}


class MetricsLog:
    """Writes on global rank 0 only; other ranks hold a no-op instance."""

    def __init__(self, run_dir: str | Path, tensorboard: bool, enabled: bool):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(Path(run_dir) / "tb"))

    def truncate_after(self, step: int):
        """On resume: drop lines a killed run logged past its last checkpoint."""
        if not self.enabled or not self.path.is_file():
            return
        keep = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)

    def write(self, record: dict):
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])
            self.tb.flush()

    def close(self):
        if self.tb is not None:
            self.tb.close()
