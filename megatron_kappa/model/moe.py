"""κ-SwiGLU inside megatron-core's MoE layer, by subclassing (no forks).

The expert needs each (token, expert) pair's raw router logit s_e(x). megatron-core carries one
per-pair tensor from the router to the experts: the routing probabilities. We widen it to two
channels, [..., 2] = (prob, logit) ("two-channel probs"; docs/kappa.md):

  ZLossRouter        TopKRouter with the authors' z-loss (de-meaned, the mean penalised) and its
                     gradient into the router input scaled (model.moe.z_loss_form / _input_grad_scale),
                     and the authors' expert capacity and drop order (model.moe.capacity /
                     drop_order; megatron_kappa.model.capacity).
  KappaRouter        returns probs [T, E, 2]; loss hooks (aux, z-loss) see the usual [T, E] probs.
  Kappa*Dispatcher   permute/gather the logit column exactly like the prob column; every later op
                     (all-to-all, TP gather, sort by expert) splits only dim 0, so [N, 2] rides along.
  KappaMoELayer      MoELayer with the two-channel dispatcher swapped in (it is picked from config,
                     not from a spec slot).
The experts that consume [N, 2] live in megatron_kappa.model.experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection, permute
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_kappa.kappa import DEFAULTS, KappaSettings
from megatron_kappa.kappa.inputs import kappa_input, scale_grad
from megatron_kappa.model import capacity
from megatron_kappa.model.aux_loss import TraceableAuxLossScaler


@dataclass(frozen=True)
class CapacityRule:
    """model.moe.capacity and drop_order (megatron_kappa.model.capacity)."""
    capacity: str = "megatron"
    drop_order: str = "probs"


@dataclass(frozen=True)
class ZLoss:
    """The router z-loss as model.moe.z_loss_form / z_loss_input_grad_scale set it."""
    form: str = "megatron"  # megatron: lse(l)²; authors: lse(l − l̄)² + l̄²
    input_grad_scale: float = 1.0  # × the z-loss gradient into the router's input


def z_loss_value(logits: torch.Tensor, form: str) -> torch.Tensor:
    """The mean over tokens of the z-loss of logits [T, E] (fp32 at least): megatron-core's
    lse(l)², or the authors' lse(l − l̄)² + l̄² (askerlee/kappa-swiglu 14c9b04 nanochat/gpt.py
    compute_z_loss, 289-313: ST-MoE's loss of the de-meaned logits, plus the mean logit squared)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if form == "megatron":
        return torch.logsumexp(logits, dim=-1).square().mean()
    mean = logits.mean(dim=-1, keepdim=True)
    return (torch.logsumexp(logits - mean, dim=-1).square() + mean.squeeze(-1).square()).mean()


class ZLossRouter(TopKRouter):
    """TopKRouter whose z-loss takes `z_loss.form` and sends `z_loss.input_grad_scale` of its
    gradient into the router's input (the authors scale it by 0.1 through a second matmul that
    reuses the router weight: 14c9b04 gpt.py 520-530; the weight's gradient is whole). The routing
    and the aux loss are megatron-core's."""

    def __init__(self, *args, z_loss: ZLoss = ZLoss(), capacity_rule: CapacityRule = CapacityRule(), **kwargs):
        super().__init__(*args, **kwargs)
        self.z_loss = z_loss
        self.own_z_loss = z_loss != ZLoss()  # megatron's z-loss otherwise
        self.capacity_rule = capacity_rule

    def routing(self, logits, padding_mask=None):
        """megatron's routing; with a capacity rule other than megatron's (its capacity, dropping the
        lowest weights), megatron routes without capacity and the rule drops (model/capacity.py)."""
        factor = self.config.moe_expert_capacity_factor
        if factor is None or self.capacity_rule == CapacityRule():
            return super().routing(logits, padding_mask)
        seq, batch = logits.shape[:2]
        self.config.moe_expert_capacity_factor = None
        try:
            probs, routing_map = super().routing(logits, padding_mask)
        finally:
            self.config.moe_expert_capacity_factor = factor
        cap = capacity.capacity(seq * batch, self.topk, routing_map.shape[-1], factor, self.capacity_rule.capacity)
        return capacity.drop(probs, routing_map, self.topk, cap, self.capacity_rule.drop_order, seq, batch)

    def gating(self, input):
        if self.own_z_loss:
            self._gating_input = input  # for the z-loss's own logits, read within the same forward
        return super().gating(input)

    def apply_z_loss(self, logits, padding_mask=None):
        coeff = self.config.moe_z_loss_coeff
        if not (self.own_z_loss and coeff and self.training and torch.is_grad_enabled()):
            return super().apply_z_loss(logits, padding_mask=padding_mask)
        if padding_mask is not None or self.calculate_per_token_loss or self.is_mtp_layer:
            raise NotImplementedError("model.moe.z_loss_form authors: no padding masks, per-token loss or MTP layers")
        x = scale_grad(self._gating_input, self.z_loss.input_grad_scale)
        self._gating_input = None
        z_logits = super().gating(x).reshape(logits.shape)  # the same values; the input gradient scaled
        coeff = coeff / self.tp_cp_group.size()  # each TP/CP rank's local tokens: averaged, as megatron's
        z_loss = z_loss_value(z_logits, self.z_loss.form) * coeff
        logits = TraceableAuxLossScaler.apply(logits, z_loss)  # megatron's MoEAuxLossAutoScaler when eager
        get_moe_metrics_tracker().record("z_loss", z_loss / coeff, self.layer_number, self.config.num_layers,
                                         avg_group=self.tp_dp_cp_group)
        return logits


class KappaRouter(ZLossRouter):
    """TopKRouter that also hands on, for every (token, expert), what κ sees of the gating logit:
    the raw logit, or its `model.kappa.input` transform, with the κ path's gradient scaled
    (megatron_kappa.kappa.inputs; the probabilities' gradient is untouched)."""

    def __init__(self, *args, kappa: KappaSettings = DEFAULTS, **kwargs):
        super().__init__(*args, **kwargs)
        self.kappa = kappa

    def gating(self, input):
        logits = super().gating(input)
        self._raw_logits = logits  # read back by forward() within the same call
        return logits

    def forward(self, input, padding_mask=None):
        probs, routing_map = super().forward(input, padding_mask)
        logits = kappa_input(self._raw_logits, self.weight, self.kappa.input, self.kappa.router_grad_scale)
        logits = logits.reshape(probs.shape).to(probs.dtype)
        self._raw_logits = None
        return torch.stack([probs, logits], dim=-1), routing_map


class KappaAlltoAllDispatcher(MoEAlltoAllTokenDispatcher):
    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        probs, logits = probs.unbind(-1)
        tokens, permuted_probs = super().dispatch_preprocess(hidden_states, routing_map, probs)
        # Same map, same output order as the parent's permute: only the probs slot is used.
        rows = logits.new_empty(logits.shape[0], 1)
        _, permuted_logits, *_ = permute(rows, self.routing_map, probs=logits,
                                         num_out_tokens=self.num_out_tokens, fused=False,
                                         drop_and_pad=self.drop_and_pad)
        return tokens, torch.stack([permuted_probs, permuted_logits], dim=-1)


class KappaAllGatherDispatcher(MoEAllGatherTokenDispatcher):
    def dispatch_postprocess(self, hidden_states, probs):
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        local_logits = probs[:, first:last, 1]
        tokens, tokens_per_expert, local_probs = super().dispatch_postprocess(
            hidden_states, probs[..., 0])
        local_logits = local_logits.T.contiguous().masked_select(self.local_map.T.contiguous())
        return tokens, tokens_per_expert, torch.stack([local_probs, local_logits], dim=-1)


_DISPATCHERS = {"alltoall": KappaAlltoAllDispatcher, "allgather": KappaAllGatherDispatcher}


class KappaMoELayer(MoELayer):
    def __init__(self, config: TransformerConfig, submodules=None, layer_number=None, pg_collection=None,
                 is_mtp_layer=False, name=None):
        kind = config.moe_token_dispatcher_type
        if kind not in _DISPATCHERS:
            raise ValueError(f"model.moe.dispatcher: κ-SwiGLU needs 'alltoall' or 'allgather' "
                             f"(got {kind!r}; 'flex' cannot carry the router logit)")
        super().__init__(config, submodules, layer_number, pg_collection, is_mtp_layer, name)
        self.token_dispatcher = _DISPATCHERS[kind](
            self.num_local_experts, self.local_expert_indices, config=self.config,
            pg_collection=pg_collection or get_default_pg_collection())
