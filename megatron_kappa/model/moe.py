"""κ-SwiGLU inside megatron-core's MoE layer, by subclassing (no forks).

The expert needs each (token, expert) pair's raw router logit s_e(x). megatron-core carries one
per-pair tensor from the router to the experts: the routing probabilities. We widen it to two
channels, [..., 2] = (prob, logit) ("two-channel probs"; docs/kappa.md):

  KappaRouter        returns probs [T, E, 2]; loss hooks (aux, z-loss) see the usual [T, E] probs.
  Kappa*Dispatcher   permute/gather the logit column exactly like the prob column; every later op
                     (all-to-all, TP gather, sort by expert) splits only dim 0, so [N, 2] rides along.
  KappaMoELayer      MoELayer with the two-channel dispatcher swapped in (it is picked from config,
                     not from a spec slot).
The experts that consume [N, 2] live in megatron_kappa.model.experts.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection, permute
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)

from megatron_kappa.kappa import DEFAULTS, KappaSettings
from megatron_kappa.kappa.inputs import kappa_input


class KappaRouter(TopKRouter):
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
    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                 is_mtp_layer=False, name=None):
        kind = config.moe_token_dispatcher_type
        if kind not in _DISPATCHERS:
            raise ValueError(f"model.moe.dispatcher: κ-SwiGLU needs 'alltoall' or 'allgather' "
                             f"(got {kind!r}; 'flex' cannot carry the router logit)")
        super().__init__(config, submodules, layer_number, pg_collection, is_mtp_layer, name)
        self.token_dispatcher = _DISPATCHERS[kind](
            self.num_local_experts, self.local_expert_indices, config=self.config,
            pg_collection=pg_collection or get_default_pg_collection())
