"""Routed experts: κ-SwiGLU's α, b and activation, megatron's SequentialMLP with that activation,
and grouped-GEMM experts (κ or plain SwiGLU) that replace the per-expert loop."""
from __future__ import annotations

import torch
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.tensor_parallel.random import (
    CheckpointWithoutOutput,
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_kappa.kappa import DEFAULTS, KappaSettings, kappa_swiglu, kappa_values, resolve_backend
from megatron_kappa.model import fp8 as fp8_gemm
from megatron_kappa.model.deferred_wgrad import WgradQueue, deferred_gemm, grouped_gemm
from megatron_kappa.model.fp8 import FP8Settings

# megatron-core's fused paths are keyed on `activation_func == F.silu` (bias_activation_fusion,
# TE's activation, TE's op fuser, the FP8 input store) or apply the probabilities before fc1; any
# of them would silently run plain SwiGLU instead of κ, so the κ experts refuse them.
_FUSED_FLAGS = ("bias_activation_fusion", "use_te_activation_func", "use_transformer_engine_op_fuser",
                "activation_func_fp8_input_store", "moe_apply_probs_on_input")


def check_kappa_config(config: TransformerConfig):
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
        # U in effect now: settings.U, or the step's value of the authors' U ramp, which the
        # training loop sets before each step (`set_kappa_U`): a host float, so no sync, and the
        # Triton kernels take it as a runtime scalar (ln U), so no recompilation either.
        self.kappa_U = settings.U
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
        settings = (self.kappa_U, k.logit_scale, k.tanh_gain)
        if not torch.compiler.is_compiling() and resolve_backend(k.backend, gate.device) == "torch":
            # the torch op scales by p itself, and makes p's gradient from the h its backward
            # computes anyway: h neither kept nor made again
            return kappa_swiglu(gate, up, logits, alpha, bias, *settings, backend="torch",
                                tokens_per_expert=tokens_per_expert, probs=probs)
        h = kappa_swiglu(gate, up, logits, alpha, bias, *settings, backend=k.backend,
                         tokens_per_expert=tokens_per_expert)
        if torch.compiler.is_compiling():  # model.compile: the partitioner decides what is kept
            return (h * probs.unsqueeze(-1)).to(gate.dtype)

        def remake(gate, up, logits, alpha, bias):  # h again, from what κ-SwiGLU's backward keeps too
            return kappa_swiglu(gate, up, logits, alpha, bias, *settings, backend=k.backend,
                                tokens_per_expert=tokens_per_expert)
        return ScaledByProbs.apply(h, probs, gate.dtype, remake, gate, up, logits, alpha, bias)

    def kappa_of(self, logits, expert: int):
        """κ for the given logits of one expert (statistics)."""
        k = self.kappa
        alpha, bias = self._alpha_bias(expert, detach=True)
        return kappa_values(logits, alpha, bias, self.kappa_U, k.logit_scale, k.tanh_gain)


class ScaledByProbs(torch.autograd.Function):
    """The Triton path's scaling (the torch op scales by p itself: kappa.reference.KappaSwiGLU).
    (h · p).to(dtype) for rows h [N, F] and their routing probabilities p [N], keeping p but not
    h: p's gradient, Σ_f dy·h, makes h again (`remake(*inputs)`, from `inputs` saved here, the
    tensors h's own backward keeps too, so they cost nothing more), as megatron's weighted SwiGLU
    does for plain experts. Autograd's h · p would keep h beside the scaled copy fc2 keeps: rows·F
    more per MoE layer. The gradients are the same expression's, so bit for bit what autograd
    gives; `inputs` get none here (h's own node gives theirs)."""

    @staticmethod
    def forward(ctx, h, probs, dtype, remake, *inputs):
        ctx.remake = remake
        ctx.save_for_backward(probs, *inputs)
        return (h * probs.unsqueeze(-1)).to(dtype)

    @staticmethod
    def backward(ctx, dy):
        probs, *inputs = ctx.saved_tensors
        remake, ctx.remake = ctx.remake, None
        with torch.no_grad():
            h = remake(*(None if t is None else t.detach() for t in inputs))
        with torch.enable_grad():
            h, p = h.detach().requires_grad_(), probs.detach().requires_grad_()
            d_h, d_p = torch.autograd.grad((h * p.unsqueeze(-1)).to(dy.dtype), (h, p), dy)
        need_h, need_p = ctx.needs_input_grad[:2]
        return (d_h if need_h else None, d_p if need_p else None, None, None, *(None for _ in inputs))


def set_kappa_U(model, U: float):
    """Make every κ experts module of `model` use U (the authors' per-step U ramp)."""
    for m in model.modules():
        if isinstance(m, KappaExpertActivation) and m.kappa is not None:
            m.kappa_U = float(U)


class KappaSequentialMLP(SequentialMLP, KappaExpertActivation):
    """megatron's SequentialMLP (same weights and names) with a κ-SwiGLU activation."""

    def __init__(self, num_local_experts, config: TransformerConfig, submodules, pg_collection=None, name=None,
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


class GroupedExperts(MegatronModule, KappaExpertActivation):
    """All local experts in two grouped GEMMs, with the activation applied once over all rows.

    The weights are stacked: `fc1_weight` [experts, 2·F/ETP, H] (each expert's slice is what
    megatron's `linear_fc1.weight` holds: [gate; up] for this expert-TP rank) and `fc2_weight`
    [experts, H, F/ETP]. fc1 and fc2 are `torch.nn.functional.grouped_mm` over the rows grouped by
    expert, with the group offsets computed on the device, so no per-expert loop and no host
    sync here. The activation is κ-SwiGLU (`kappa` settings) or plain SwiGLU (`kappa=None`, the
    baseline), scaled by the routing probabilities.

    State dicts use megatron's per-expert names (`local_experts.<i>.linear_fc1.weight`, ...), so a
    consolidated file loads into sequential or grouped experts alike (megatron_kappa.parallel
    .sharding expands the stacks the same way).
    """

    STACKS = {"fc1_weight": "linear_fc1.weight", "fc2_weight": "linear_fc2.weight"}

    def __init__(self, num_local_experts, config: TransformerConfig, submodules=None, pg_collection=None, name=None,
                 kappa: KappaSettings | None = DEFAULTS, fp8: FP8Settings | None = None):
        super().__init__(config=config)
        self.fp8 = fp8  # FP8 rowwise grouped GEMMs (model/fp8.py) instead of bf16/fp32 ones
        if kappa is not None:
            check_kappa_config(config)
        elif not config.gated_linear_unit or config.add_bias_linear:
            raise ValueError("grouped experts need gated_linear_unit=True and no linear biases")
        etp = config.expert_tensor_parallel_size
        ffn = config.moe_ffn_hidden_size // etp
        self.num_local_experts, self.ffn_local = num_local_experts, ffn
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        def make(*shape):
            return torch.nn.Parameter(torch.empty(*shape, dtype=config.params_dtype, device=device))
        self.fc1_weight = make(num_local_experts, 2 * ffn, config.hidden_size)
        self.fc2_weight = make(num_local_experts, config.hidden_size, ffn)
        # megatron's marks: expert-TP splits fc1's rows and fc2's columns; `allreduce=False` means
        # "reduced over expert-DP" and is set, as megatron sets it, when EP > 1 or ETP != TP.
        reduced_apart = config.expert_model_parallel_size > 1 or etp != config.tensor_model_parallel_size
        for param, dim, leaf in ((self.fc1_weight, 1, "linear_fc1.weight"), (self.fc2_weight, 2, "linear_fc2.weight")):
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1
            param.allreduce = not reduced_apart
            param.expert_stack = leaf  # per-expert name of each slice (sharding, state dicts)
        if config.perform_initialization:
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                for i in range(num_local_experts):
                    config.init_method(self.fc1_weight.data[i])
                    config.output_layer_init_method(self.fc2_weight.data[i])
        if kappa is not None:
            self._init_kappa(kappa, num_local_experts, ffn, self.fc1_weight)
        else:
            self.kappa = None
        self.last_logits = None
        # parallel.delay_wgrad_compute: fc1's and fc2's weight gradients wait for backward_dw
        self.wgrad_queue = WgradQueue() if config.delay_wgrad_compute else None
        self.recompute_activation = (config.recompute_granularity == "selective"
                                     and "moe_act" in (config.recompute_modules or []))
        self._register_state_dict_hook(_per_expert_state)
        self._register_load_state_dict_pre_hook(_stack_expert_state, with_module=True)

    def forward(self, hidden_states, tokens_per_expert, permuted_probs):
        if self.config.fp8 or self.config.fp4:
            raise NotImplementedError("grouped experts: megatron's TE fp8 flag is not used here (model.fp8)")
        if self.wgrad_queue is not None and self.wgrad_queue.pending:
            raise RuntimeError("grouped experts: weight gradients of an earlier backward were never computed "
                               "(parallel.delay_wgrad_compute outside megatron's overlapped schedule)")
        # megatron's dispatchers hand the counts over on the host (they read them for the
        # all-to-all anyway); the GEMMs take their offsets on the device.
        counts = tokens_per_expert.to(hidden_states.device, torch.int32, non_blocking=True)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        fc1 = self._gemm(hidden_states, self.fc1_weight, offs)
        if self.kappa is not None:
            probs, logits = permuted_probs.unbind(-1)
            self.last_logits = (logits.detach(), tokens_per_expert)
            def act_fn(fc1, p, s):
                return self.activation(*fc1.chunk(2, dim=-1), p, s,
                                       tokens_per_expert=tokens_per_expert)
            act_args = (fc1, probs, logits)
        else:  # megatron's probability-weighted SwiGLU: one fused kernel through torch.compile on a GPU
            def act_fn(fc1, p):
                return weighted_bias_swiglu_impl(fc1, None, p.unsqueeze(-1))
            act_args = (fc1, permuted_probs)
        if not self.recompute_activation:
            return self._gemm(act_fn(*act_args), self.fc2_weight, offs), None
        return self.recomputed_fc2(act_fn, act_args, offs), None

    def recomputed_fc2(self, act_fn, act_args, offs):
        """Selective recompute ("moe_act"): fc2's input is dropped after fc2's forward and made
        again from fc1's output just before fc2's backward needs it. (model.compile leaves this
        eager: megatron's checkpoint does not trace.)"""
        checkpoint = CheckpointWithoutOutput(fp8=self.config.fp8)  # megatron reads `fp8 is not None`
        act = checkpoint.checkpoint(act_fn, *act_args)
        out = self._gemm(act, self.fc2_weight, offs)
        checkpoint.discard_output_and_register_recompute(out)
        return out

    def _gemm(self, x, weight, offs):
        """Each expert's rows times its [out, in] weight: one grouped GEMM (FP8 with model.fp8)."""
        if self.fp8 is not None:
            return fp8_gemm.grouped_mm(x, weight, offs, self.fp8)
        if self.wgrad_queue is not None and torch.is_grad_enabled() and weight.requires_grad:
            return deferred_gemm(x, weight, offs, self.wgrad_queue)
        return grouped_gemm(x, weight, offs)

    def routed_logits(self) -> list:
        """Per local expert, the router logits of the rows it got in the last forward."""
        if self.last_logits is None:
            return []
        logits, counts = self.last_logits
        return list(logits.split(counts.tolist()))  # a host read: logging steps only

    def backward_dw(self):
        """megatron's delayed weight gradients (parallel.delay_wgrad_compute): fc1's and fc2's,
        queued by the last backward; without the flag they came with the backward."""
        if self.wgrad_queue is not None:
            self.wgrad_queue.run()


def _per_expert_state(module, state, prefix, local_metadata):
    """State dict hook: each stack becomes megatron's per-expert entries (views, tagged like the
    stack, so that sharding can read their layout)."""
    for stack, leaf in GroupedExperts.STACKS.items():
        tensor = state.pop(prefix + stack, None)
        if tensor is None:
            continue
        param = getattr(module, stack)
        for i in range(tensor.shape[0]):
            view = tensor[i]
            for attr in ("tensor_model_parallel", "partition_stride", "allreduce"):
                if hasattr(param, attr):
                    setattr(view, attr, getattr(param, attr))
            view.partition_dim = param.partition_dim - 1
            state[f"{prefix}local_experts.{i}.{leaf}"] = view
    return state


def _stack_expert_state(module, state, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """Load pre-hook: megatron's per-expert entries become the stacks."""
    for stack, leaf in GroupedExperts.STACKS.items():
        keys = [f"{prefix}local_experts.{i}.{leaf}" for i in range(module.num_local_experts)]
        if all(k in state for k in keys):
            state[prefix + stack] = torch.stack([state.pop(k) for k in keys])


def routed_logits(experts) -> list:
    """Per local expert, the logits of its rows in the last forward (either experts class)."""
    if isinstance(experts, GroupedExperts):
        return experts.routed_logits()
    return list(experts.last_logits or [])


def gate_weights(experts) -> torch.Tensor:
    """[local experts, F/ETP, H]: each expert's gate projection rows (either experts class)."""
    if isinstance(experts, GroupedExperts):
        return experts.fc1_weight[:, : experts.ffn_local]
    return torch.stack([e.linear_fc1.weight[: e.linear_fc1.weight.shape[0] // 2] for e in experts.local_experts])
