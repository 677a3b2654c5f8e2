"""κ-SwiGLU inside megatron-core's MoE layer, by subclassing (no forks).

The expert needs each (token, expert) pair's raw router logit s_e(x). megatron-core carries one
per-pair tensor from the router to the experts: the routing probabilities. We widen it to two
channels, [..., 2] = (prob, logit) ("two-channel probs", notes/mcore-on-cpu.md §6):

  KappaRouter        returns probs [T, E, 2]; loss hooks (aux, z-loss) see the usual [T, E] probs.
  Kappa*Dispatcher   permute/gather the logit column exactly like the prob column; every later op
                     (all-to-all, TP gather, sort by expert) splits only dim 0, so [N, 2] rides along.
  KappaMoELayer      MoELayer with the two-channel dispatcher swapped in (it is picked from config,
                     not from a spec slot).
  KappaSequentialMLP SequentialMLP whose activation is κ-SwiGLU; α, b live here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection, permute
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)

from megatron_kappa.kappa import kappa_swiglu, kappa_values


@dataclass(frozen=True)
class KappaSettings:
    """The κ-SwiGLU knobs an expert layer needs (config: model.kappa.*)."""

    U: float = 3.0
    use_alpha: bool = True
    use_bias: bool = True
    logit_scale: float = 1.0
    tanh_gain: float = 1.0


class KappaRouter(TopKRouter):
    """TopKRouter that also hands on the raw gating logit of every (token, expert)."""

    def gating(self, input):
        logits = super().gating(input)
        self._raw_logits = logits  # read back by forward() within the same call
        return logits

    def forward(self, input, padding_mask=None):
        probs, routing_map = super().forward(input, padding_mask)
        logits = self._raw_logits.reshape(probs.shape).to(probs.dtype)
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


class KappaExpertActivation:
    """α, b and the κ-SwiGLU activation, shared by every κ experts class.

    A grouped (TE) experts class would mix this in the same way and call `activation` between
    its own fc1 and fc2, so the math tested on CPU is the math that runs on GPU.
    """

    def _init_kappa(self, settings: KappaSettings, num_local_experts: int, gate_width: int,
                    like: torch.nn.Parameter):
        self.kappa = settings
        for name, used in (("kappa_alpha", settings.use_alpha), ("kappa_bias", settings.use_bias)):
            if not used:
                setattr(self, name, None)
                continue
            param = torch.nn.Parameter(torch.zeros(num_local_experts, gate_width,
                                                   dtype=like.dtype, device=like.device))
            # Sharded like the gate half of fc1 (expert TP splits the ffn dim), and reduced like
            # fc1 too: `allreduce=False` is megatron's expert-parameter mark.
            param.tensor_model_parallel = True
            param.partition_dim = 1
            param.partition_stride = 1
            param.allreduce = getattr(like, "allreduce", True)
            param.is_kappa = True
            setattr(self, name, param)

    def activation(self, gate, up, probs, logits, expert: int):
        """κ-SwiGLU of one expert's rows, scaled by their routing probabilities."""
        k = self.kappa
        alpha = None if self.kappa_alpha is None else self.kappa_alpha[expert]
        bias = None if self.kappa_bias is None else self.kappa_bias[expert]
        h = kappa_swiglu(gate, up, logits, alpha, bias, k.U, k.logit_scale, k.tanh_gain)
        return (h * probs.unsqueeze(-1)).to(gate.dtype)

    def kappa_of(self, logits, expert: int):
        """κ for the given logits of one expert (statistics)."""
        k = self.kappa
        alpha = None if self.kappa_alpha is None else self.kappa_alpha[expert].detach()
        bias = None if self.kappa_bias is None else self.kappa_bias[expert].detach()
        return kappa_values(logits, alpha, bias, k.U, k.logit_scale, k.tanh_gain)


class KappaSequentialMLP(SequentialMLP, KappaExpertActivation):
    """megatron's SequentialMLP (same weights and names) with a κ-SwiGLU activation."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None,
                 kappa: KappaSettings = KappaSettings()):
        # The κ activation replaces megatron's activation paths; any fused path keyed on
        # activation_func would silently run plain SwiGLU instead (notes/te-and-fp8.md §5).
        for flag in ("bias_activation_fusion", "use_te_activation_func",
                     "use_transformer_engine_op_fuser", "activation_func_fp8_input_store",
                     "moe_apply_probs_on_input"):
            if getattr(config, flag, False):
                raise ValueError(f"κ-SwiGLU experts: TransformerConfig.{flag} must be off")
        if not config.gated_linear_unit or config.add_bias_linear:
            raise ValueError("κ-SwiGLU experts need gated_linear_unit=True and no linear biases")
        super().__init__(num_local_experts, config, submodules, pg_collection, name)
        fc1 = self.local_experts[0].linear_fc1.weight
        self._init_kappa(kappa, num_local_experts, fc1.shape[0] // 2, fc1)
        self.last_logits = None  # per-expert logits of the last forward, for κ statistics

    def forward(self, hidden_states, tokens_per_expert, permuted_probs):
        if self.config.fp8 or self.config.fp4:
            raise NotImplementedError("κ-SwiGLU SequentialMLP: FP8 needs the TE experts path")
        probs, logits = permuted_probs.unbind(-1)
        counts = tokens_per_expert.tolist()
        chunks = zip(hidden_states.split(counts), probs.split(counts), logits.split(counts))
        outputs = []
        for i, (expert, (x, p, s)) in enumerate(zip(self.local_experts, chunks)):
            fc1_out, _ = expert.linear_fc1(x)
            gate, up = torch.chunk(fc1_out, 2, dim=-1)
            out, _ = expert.linear_fc2(self.activation(gate, up, p, s, i))
            outputs.append(out)
        self.last_logits = [s.detach() for s in logits.split(counts)]
        return torch.cat(outputs, dim=0), None
