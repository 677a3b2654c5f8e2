"""The SoftMoE router (arXiv 2606.17952, reconstructed: docs/softmoe.md): a truncated LapSum soft
top-k whose per-layer mean number of active experts k_l is learned under a global budget.

Per token, with router logits r [E] and this layer's k_l:
    p = LapSum(r; k_l, α)                       (Σ_e p_e = k_l, megatron_kappa.model.lapsum)
    keep = {e : p_e ≥ τ}, at most `max_experts` of them (the largest p)
    weights = p · [keep]  (optionally divided by their sum, or scaled to sum to k_l) · route_scale
The routing map is `keep`, so the number of experts a token runs varies; the dispatch of such maps
is megatron_kappa.model.softmoe_dispatch. Dropped experts still get gradient, through the threshold
of the soft top-k (LapSum's VJP); k_l gets Σ_t ⟨v_t, q_t⟩ the same way.

Budget: one learned scalar θ_l per MoE layer (`budget_logit`, on that layer's router) and
    softmax:  k_l = L·k̄·softmax(θ)_l, clamped to [1e-3, E − 1e-3]
    lapsum:   k_l = E·LapSum(θ; L·k̄/E, 1)_l   (each k_l in (0, E), no clamp)
so mean_l k_l = k̄ exactly (softmax: while no clamp is active). Every router of one model reads
all the θ; `link_budgets(model)` (called by build_model) gives them the shared `Allocation`.

Balancing: the Switch loss E·Σ_e f_e·P_e with f_e the share of the kept (token, expert) pairs that
go to e (counted over the TP×CP group, as megatron counts) and P_e the mean over tokens of p_e/k_l.
"""
from __future__ import annotations

import dataclasses

import torch
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_kappa.config import MoEConfig
from megatron_kappa.model.lapsum import lapsum_topk
from megatron_kappa.model.moe import KappaRouter

CLAMP = 1e-3  # the softmax allocation keeps each k_l in [CLAMP, E − CLAMP]


@dataclasses.dataclass(frozen=True)
class SoftMoESettings:
    budget: float  # k̄: the mean over layers of k_l
    allocation: str  # "softmax" | "lapsum"
    temperature: float  # LapSum α
    threshold: float  # truncation τ (0: off)
    normalize: str  # "none" | "sum" | "budget"
    max_experts: int  # cap on experts per token
    aux_loss: float  # balancing-loss weight
    route_scale: float = 1.0


def softmoe_settings(moe: MoEConfig) -> SoftMoESettings:
    sm = moe.softmoe
    return SoftMoESettings(budget=float(moe.active_experts), allocation=sm.allocation,
                           temperature=sm.temperature, threshold=sm.threshold, normalize=sm.normalize,
                           max_experts=sm.max_experts or moe.num_experts, aux_loss=moe.aux_loss,
                           route_scale=moe.route_scale)


class Allocation:
    """k [L] for the L SoftMoE layers of one model, from their routers' θ (differentiable).

    It holds the routers, not their θ Parameters, and reads `budget_logit` at every call: code that
    replaces a module's Parameter objects (moving to a device by assignment, loading with
    assign=True) must not leave the budget computed from stale copies."""

    def __init__(self, routers: list, budget: float, num_experts: int, kind: str):
        if kind not in ("softmax", "lapsum"):
            raise ValueError(f"model.moe.softmoe.allocation: unknown {kind!r}")
        self.routers, self.budget, self.num_experts, self.kind = routers, budget, num_experts, kind

    def k(self) -> torch.Tensor:
        theta = torch.cat([r.budget_logit.reshape(1) for r in self.routers])
        theta = theta.to(torch.promote_types(theta.dtype, torch.float32))  # fp32, or float64 in the tests
        L, E = theta.numel(), self.num_experts
        if self.kind == "softmax":
            return (L * self.budget * torch.softmax(theta, 0)).clamp(CLAMP, E - CLAMP)
        return E * lapsum_topk(theta[None], L * self.budget / E, 1.0)[0]


def softmoe_routers(model) -> list:
    """(decoder layer index, router) of every SoftMoE layer, in layer order."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, SoftMoERouter):
            index = int(name.split("layers.")[1].split(".")[0]) if "layers." in name else len(out)
            out.append((index, m))
    return sorted(out, key=lambda item: item[0])


def link_budgets(model) -> Allocation | None:
    """Share one Allocation among the model's SoftMoE routers (None if it has none)."""
    routers = [r for _, r in softmoe_routers(model)]
    if not routers:
        return None
    s = routers[0].settings
    alloc = Allocation(routers, s.budget, routers[0].num_experts, s.allocation)
    for i, r in enumerate(routers):
        r._allocation, r._budget_index = alloc, i
    return alloc


class SoftMoERouter(TopKRouter):
    """megatron's TopKRouter (gating, z-loss, loss logging) with SoftMoE's `routing`."""

    def __init__(self, config: TransformerConfig, pg_collection=None, is_mtp_layer=False,
                 settings: SoftMoESettings = None):
        if settings is None:
            raise ValueError("SoftMoERouter needs its settings (megatron_kappa.model.softmoe.softmoe_settings)")
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        self.settings = settings
        # θ_l, fp32 like the router weight. Under sequence parallelism each TP rank sees part of the
        # tokens, so its gradient is partial and summed over TP, as the router weight's is.
        self.budget_logit = torch.nn.Parameter(torch.zeros(1, dtype=torch.float32))
        self.budget_logit.sequence_parallel = config.sequence_parallel
        self._allocation, self._budget_index = None, None
        self._counts = None  # [E + 2] long: tokens by number of experts run, then tokens over the cap

    def active_experts(self) -> torch.Tensor:
        """k_l (0-d, differentiable in every layer's θ)."""
        if self._allocation is None:
            raise RuntimeError("SoftMoE router used before megatron_kappa.model.softmoe.link_budgets(model) "
                               "(build_model calls it)")
        return self._allocation.k()[self._budget_index]

    def routing(self, logits: torch.Tensor, padding_mask=None):
        if padding_mask is not None:
            raise NotImplementedError("SoftMoE router: padding masks are not supported")
        s, E = self.settings, self.config.num_moe_experts
        logits = self.apply_z_loss(logits.view(-1, E))
        k = self.active_experts()
        p = lapsum_topk(logits.to(torch.promote_types(logits.dtype, torch.float32)), k, s.temperature)
        keep = p >= s.threshold if s.threshold > 0 else torch.ones_like(p, dtype=torch.bool)
        wanted = keep.sum(-1)
        if s.max_experts < E:
            top = torch.zeros_like(keep).scatter_(-1, p.topk(s.max_experts, dim=-1).indices, True)
            keep = keep & top
        probs = p * keep
        if s.normalize != "none":
            total = probs.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)  # no expert: 0/tiny
            probs = probs / total * (k if s.normalize == "budget" else 1.0)
        if s.route_scale != 1.0:
            probs = probs * s.route_scale
        if self.training and torch.is_grad_enabled():
            if s.aux_loss > 0:
                probs = self._balance(probs, p, k, keep)
            self._record(keep, wanted)
        return probs, keep

    def _balance(self, probs, p, k, keep):
        """Attach the Switch-style loss (module doc) to `probs`, and log it, as megatron does."""
        E, tokens = p.shape[-1], p.shape[0]
        group = self.tp_cp_group
        counts = reduce_from_tensor_model_parallel_region(keep.sum(0).float(), group)
        share = counts / counts.sum().clamp_min(1.0)
        mean_p = (p / k).sum(0) / (tokens * group.size())  # this rank's part of the mean over tokens
        aux = E * (share * mean_p).sum() * self.settings.aux_loss
        return self.attach_and_log_load_balancing_loss(probs, self.settings.aux_loss, aux, "load_balancing_loss",
                                                       group, valid_token_count=tokens)

    @torch.no_grad()
    def _record(self, keep, wanted):
        """Accumulate on the device (no sync); read and reset by `pop_counts` on logging steps."""
        E = keep.shape[-1]
        if self._counts is None or self._counts.device != keep.device:
            self._counts = torch.zeros(E + 2, dtype=torch.long, device=keep.device)
        ran = keep.sum(-1)
        self._counts[: E + 1].index_add_(0, ran, torch.ones_like(ran))
        self._counts[E + 1] += (wanted > self.settings.max_experts).sum()

    def pop_counts(self, device) -> torch.Tensor:
        """[E + 2]: training tokens since the last call by experts run (0..E), then those over the cap."""
        E = self.config.num_moe_experts
        counts = torch.zeros(E + 2, dtype=torch.long,
                             device=device) if self._counts is None else self._counts.to(device)
        self._counts = None
        return counts


class KappaSoftMoERouter(KappaRouter, SoftMoERouter):
    """SoftMoE routing that also hands on each (token, expert) pair's raw logit: probs [T, E, 2]
    (KappaRouter's forward around SoftMoERouter's routing)."""
