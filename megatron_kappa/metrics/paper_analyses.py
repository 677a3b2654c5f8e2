"""The paper's analyses (arXiv 2606.00761 §5; docs/analysis.md) as metrics, per MoE layer.

On logging steps only, from what the last forward left behind (no extra pass over the data):

  align/layerL/{mean,bottom5,top5}      cos(r_e, w_e,j): each expert's router vector against each of
                                         its gate rows (all experts, all rows)
  gate_bias/layerL/{mean,bottom5,top5}  (w_e,jᵀ r̂_e)·(r̂_eᵀ x): the confidence-induced gate bias, for
                                         routed pairs (x, e) of a token sample, every gate row j
  token_cos/layerL/{mean,bottom5,top5}  cos(x, r_e) for the same routed pairs
  kappa/layerL/{alpha_pos_mean,bias_pos_mean}  mean of the positive entries of α, of b
  kappa/layerL/{alpha_s_abs,bias_routed_abs}   mean |α·s| and |b| over the routed pairs' gate
                                         units: the two terms inside κ's tanh (s: the logit as κ
                                         uses it: the model.kappa.input variant's transform, times
                                         logit_scale)
  load/layerL/{min,max,mean,cv}         tokens per expert (after any dropping), over every rank's
                                         last micro-batch; cv = std / mean
  load/layerL/dropped_frac              dropped (token, expert) pairs / top-k · tokens, when
                                         model.moe.capacity_factor is set

bottom5 / top5 are the 5 % and 95 % quantiles (as the κ statistics in metrics.py). x is the
router's input (the normalised hidden state the experts see), r̂ = r / |r|.

How: `watch_routers` puts a forward hook on every MoE router that keeps a reference to its last
input and routing map (no copy, no work per step). On a logging step each rank samples at most
`tokens` of its own tokens (they are disjoint across ranks: DP splits the batch, sequence
parallelism the sequence), takes their routed experts, and the per-(expert, gate row) numbers
are gathered once over the expert-model × expert-tensor group, so every rank holds them for all
experts whatever the EP / ETP layout. Quantiles come from at most `values` numbers per layer,
gathered from all ranks; means and loads are exact over the sample / the batch.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_kappa.config import ModelConfig, MoEConfig
from megatron_kappa.kappa import inputs as kappa_inputs
from megatron_kappa.model.experts import gate_weights
from megatron_kappa.model.layout import layer_label
from megatron_kappa.parallel.groups import merge_stages, stage_group

TOKENS = 256        # routed tokens sampled per rank and layer
VALUES = 200_000    # numbers per layer and statistic entering a quantile, over all ranks
_QUANTILES = (0.05, 0.95)


def labelled_moe_layers(model) -> list[tuple[str, MoELayer]]:
    """(metrics label, layer) of every MoE layer this rank holds: `layer<i>` for the decoder's,
    `mtp<d>` for an MTP depth's (model.mtp)."""
    return [(layer_label(model, name + "."), m) for name, m in model.named_modules() if isinstance(m, MoELayer)]


def _remember(router, args, output):
    router.last_routing = (args[0].detach(), output[1].detach())


def watch_routers(model):
    """Hook every MoE router so that its last input and routing map stay readable."""
    for _, layer in labelled_moe_layers(model):
        if getattr(layer.router, "_analysis_hook", None) is None:
            layer.router.last_routing = None
            layer.router._analysis_hook = layer.router.register_forward_hook(_remember)


# --- per (expert, gate row): every expert, on every rank ------------------------------------

def _gather_expert_pieces(local: torch.Tensor) -> torch.Tensor:
    """[k, E_local, F_local] on each rank of the expert-model × expert-tensor group → [k, E, F]
    (experts in global order, gate rows in full-layer order: ETP rank t holds rows t·F_local...)."""
    group = ps.get_expert_tensor_and_model_parallel_group()
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        return local
    coords = torch.tensor([ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()],
                          device=local.device)
    # concatenated along dim 0 (what every backend accepts), then split by rank
    pieces = local.new_empty((size * local.shape[0], *local.shape[1:]))
    where = coords.new_empty(size * 2)
    dist.all_gather_into_tensor(pieces, local.contiguous(), group=group)
    dist.all_gather_into_tensor(where, coords, group=group)
    pieces, where = pieces.view(size, *local.shape), where.view(size, 2)
    k, el, fl = local.shape
    ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    full = local.new_empty(k, el * ep, fl * etp)
    for piece, (e, t) in zip(pieces, where.tolist()):
        full[:, e * el:(e + 1) * el, t * fl:(t + 1) * fl] = piece
    return full


def expert_table(layer: MoELayer) -> dict:
    """Full [E, F] tensors of the layer, on every rank: `cos` = cos(r_e, w_e,j), `proj` = w_e,jᵀ r̂_e,
    and `alpha`, `bias` (None when the layer has none). A collective over the expert groups."""
    experts, router = layer.experts, layer.router
    gates = gate_weights(experts).detach().float()                        # [E_local, F_local, H]
    ids = torch.as_tensor(layer.local_expert_indices, device=gates.device)
    r = router.weight.detach().float()[ids]                               # [E_local, H]
    proj = torch.einsum("efh,eh->ef", gates, r / r.norm(dim=-1, keepdim=True).clamp_min(1e-30))
    cos = proj / gates.norm(dim=-1).clamp_min(1e-30)
    names = [n for n in ("kappa_alpha", "kappa_bias") if getattr(experts, n, None) is not None]
    local = torch.stack([cos, proj] + [getattr(experts, n).detach().float() for n in names])
    full = _gather_expert_pieces(local)
    table = {"cos": full[0], "proj": full[1], "alpha": None, "bias": None}
    for i, n in enumerate(names):
        table[n.removeprefix("kappa_")] = full[2 + i]
    return table


# --- routed tokens: a sample of this rank's tokens --------------------------------------------

def routed_sample(layer: MoELayer, tokens: int | None, gen: torch.Generator):
    """(x [P, H], expert ids [P]) for the routed (token, expert) pairs of at most `tokens` of this
    rank's tokens in the last forward (None: all of them); None before any forward."""
    last = getattr(layer.router, "last_routing", None)
    if last is None:
        return None
    x, routing_map = last
    x = x.reshape(-1, x.shape[-1])
    routed = routing_map.reshape(x.shape[0], -1) != 0
    if tokens is not None and x.shape[0] > tokens:
        pick = torch.randperm(x.shape[0], generator=gen)[:tokens].to(x.device)
        x, routed = x[pick], routed[pick]
    token, expert = routed.nonzero(as_tuple=True)  # a host sync: logging steps only
    return x[token].float(), expert


def _subsample(values: torch.Tensor, limit: int | None, gen: torch.Generator) -> torch.Tensor:
    values = values.reshape(-1)
    if limit is not None and values.numel() > limit:
        values = values[torch.randperm(values.numel(), generator=gen)[:limit].to(values.device)]
    return values


def _summary(prefix: str, sums: torch.Tensor, values: list[torch.Tensor]) -> dict:
    """mean (from the exact sum and count) and quantiles (from the gathered values)."""
    total, count = sums.tolist()
    if not count:
        return {}
    pooled = np.concatenate([v.numpy() for v in values]).astype(np.float64)
    low, high = np.quantile(pooled, _QUANTILES)
    return {f"{prefix}/mean": total / count, f"{prefix}/bottom5": float(low), f"{prefix}/top5": float(high)}


def _gather_values(local: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's values, over this pipeline stage's ranks (all ranks without stages)."""
    group = stage_group()
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, local.detach().double().cpu(), group=group)  # pickled: sizes differ per rank
    return out


def analysis_stats(model, m: ModelConfig, device: torch.device, tokens: int | None = TOKENS,
                   values: int | None = VALUES, histograms: dict | None = None) -> dict:
    """Every metric listed in the module docstring, per MoE layer of `model` (`m`: its config;
    collective: all ranks call it). tokens / values = None: no sampling (the tests compare exact
    numbers across layouts). `histograms`, when given, receives each layer's tokens per expert as
    `load/<layer>` (this stage's layers)."""
    out = {}
    group = stage_group()  # each pipeline stage reduces over its own ranks, for its layers
    world = dist.get_world_size(group)
    per_rank = None if values is None else max(1000, values // world)
    gen = torch.Generator().manual_seed(0)
    variant = kappa_inputs.resolve(m.kappa)
    scale, transform = variant.logit_scale, variant.transform  # as κ uses them (input scaled: 0.15)
    for p, layer in labelled_moe_layers(model):
        table = expert_table(layer)
        cos, alpha, bias = table["cos"], table["alpha"], table["bias"]
        # router-gate alignment: the same full table on every rank, so no further gathering
        low, high = np.quantile(cos.reshape(-1).double().cpu().numpy(), _QUANTILES)
        out.update({f"align/{p}/mean": cos.double().mean().item(), f"align/{p}/bottom5": float(low),
                    f"align/{p}/top5": float(high)})
        for name, param in (("alpha", alpha), ("bias", bias)):
            if param is not None:
                positive = param[param > 0]
                out[f"kappa/{p}/{name}_pos_mean"] = positive.double().mean().item() if positive.numel() else 0.0
        # routed tokens
        sample = routed_sample(layer, tokens, gen)
        if sample is not None:
            x, expert = sample
            r = layer.router.weight.detach().float()[expert]                       # [P, H]
            r_norm = r.norm(dim=-1).clamp_min(1e-30)
            s = (x * r).sum(-1)                                                   # raw router logit
            a = s / r_norm                                                        # r̂ᵀ x
            token_cos = a / x.norm(dim=-1).clamp_min(1e-30)
            gate_bias = table["proj"][expert] * a[:, None]                        # [P, F]
            zero = gate_bias.new_zeros((), dtype=torch.float64)
            # s as κ sees it: the input variant's transform (the one the router applies, without
            # its gradient scale) of the pair's token's logits over every expert, at the pair's expert
            w = layer.router.weight.detach()
            logits = x @ w.float().T                                              # [P, E]
            s_kappa = transform(logits, w).gather(-1, expert[:, None]).squeeze(-1)  # [P]
            alpha_s = (alpha[expert] * (scale * s_kappa)[:, None]).abs().double().sum() if alpha is not None else zero
            bias_abs = bias[expert].abs().double().sum() if bias is not None else zero
            n_tok, n_val = token_cos.numel(), gate_bias.numel()
            sums = torch.stack([token_cos.double().sum(), gate_bias.double().sum(), alpha_s, bias_abs])
            counts = torch.tensor([n_tok, n_val, n_val * (alpha is not None), n_val * (bias is not None)],
                                  dtype=torch.float64, device=sums.device)
            sums = torch.stack([sums, counts], dim=1)
            dist.all_reduce(sums, group=group)
            sums = sums.cpu()
            out.update(_summary(f"token_cos/{p}", sums[0], _gather_values(_subsample(token_cos, per_rank, gen))))
            out.update(_summary(f"gate_bias/{p}", sums[1], _gather_values(_subsample(gate_bias, per_rank, gen))))
            for row, key in ((2, "alpha_s_abs"), (3, "bias_routed_abs")):
                if sums[row, 1] > 0:
                    out[f"kappa/{p}/{key}"] = (sums[row, 0] / sums[row, 1]).item()
        out.update(load_stats(layer, m.moe, device, p, histograms))
    return merge_stages(out)


def load_stats(layer: MoELayer, moe: MoEConfig, device: torch.device, prefix: str,
               histograms: dict | None = None) -> dict:
    """Tokens per expert over every rank's last micro-batch (min, max, cv) and, with a capacity,
    the dropped fraction (collective); the per-expert counts into `histograms` when given."""
    last = getattr(layer.router, "last_routing", None)
    if last is None:
        return {}
    x, routing_map = last
    routed = routing_map.reshape(-1, routing_map.shape[-1]) != 0
    counts = torch.cat([routed.sum(0), torch.tensor([routed.shape[0]], device=routed.device)]).to(device, torch.float64)
    dist.all_reduce(counts,
                    group=stage_group())  # token sets are disjoint across ranks (DP batch split, SP sequence split)
    counts = counts.cpu()
    per_expert, tokens = counts[:-1], counts[-1].item()
    if histograms is not None:
        histograms[f"load/{prefix}"] = per_expert
    mean = per_expert.mean().item()
    out = {f"load/{prefix}/min": per_expert.min().item(), f"load/{prefix}/max": per_expert.max().item(),
           f"load/{prefix}/mean": mean,
           f"load/{prefix}/cv": per_expert.std(unbiased=False).item() / mean if mean else 0.0}
    if moe.capacity_factor is not None:
        wanted = moe.topk * tokens
        out[f"load/{prefix}/dropped_frac"] = (wanted - per_expert.sum().item()) / wanted if wanted else 0.0
    return out
