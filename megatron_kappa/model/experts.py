"""κ-SwiGLU experts: α, b and the activation, and megatron's SequentialMLP with that activation."""
from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_kappa.kappa import DEFAULTS, KappaSettings, kappa_swiglu, kappa_values

# megatron-core's fused paths are keyed on `activation_func == F.silu` (bias_activation_fusion,
# TE's activation, TE's op fuser, the FP8 input store) or apply the probabilities before fc1; any
# of them would silently run plain SwiGLU instead of κ, so the κ experts refuse them.
_FUSED_FLAGS = ("bias_activation_fusion", "use_te_activation_func", "use_transformer_engine_op_fuser",
                "activation_func_fp8_input_store", "moe_apply_probs_on_input")


def check_kappa_config(config):
    for flag in _FUSED_FLAGS:
        if getattr(config, flag, False):
            raise ValueError(f"κ-SwiGLU experts: TransformerConfig.{flag} must be off")
    if not config.gated_linear_unit or config.add_bias_linear:
        raise ValueError("κ-SwiGLU experts need gated_linear_unit=True and no linear biases")


class KappaExpertActivation:
    """α, b and the κ-SwiGLU activation, shared by every κ experts class, so the math tested on
    one experts class is the math that runs in the others."""

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
            setattr(self, name, param)

    def _alpha_bias(self, expert=None, detach=False):
        out = []
        for p in (self.kappa_alpha, self.kappa_bias):
            if p is not None:
                p = p.detach() if detach else p
                p = p if expert is None else p[expert]
            out.append(p)
        return out

    def activation(self, gate, up, probs, logits, expert: int | None = None, tokens_per_expert=None):
        """κ-SwiGLU of one expert's rows (`expert`), or of rows grouped by expert
        (`tokens_per_expert`), scaled by their routing probabilities."""
        k = self.kappa
        alpha, bias = self._alpha_bias(expert)
        h = kappa_swiglu(gate, up, logits, alpha, bias, k.U, k.logit_scale, k.tanh_gain,
                         tokens_per_expert=tokens_per_expert)
        return (h * probs.unsqueeze(-1)).to(gate.dtype)

    def kappa_of(self, logits, expert: int):
        """κ for the given logits of one expert (statistics)."""
        k = self.kappa
        alpha, bias = self._alpha_bias(expert, detach=True)
        return kappa_values(logits, alpha, bias, k.U, k.logit_scale, k.tanh_gain)


class KappaSequentialMLP(SequentialMLP, KappaExpertActivation):
    """megatron's SequentialMLP (same weights and names) with a κ-SwiGLU activation."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None,
                 kappa: KappaSettings = DEFAULTS):
        check_kappa_config(config)
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
