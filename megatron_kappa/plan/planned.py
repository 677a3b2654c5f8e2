"""Settings the planner models that the trainer does not run: each is printed as "planned only".

The published frontier runs use them (docs/plan.md's table cites which run used which):
  overlap (Planned.overlap)         traffic that runs beside the compute instead of after it
                                    (plan.speed says how much of it stays exposed); the trainer's
                                    own EP overlap is a config key (plan.ep_overlap)
  DualPipe (Planned.dualpipe)       DeepSeek-V3's bidirectional schedule in place of 1F1B
                                    (plan.dualpipe)
  ring attention                    context parallelism's K and V passed round a ring
  (Planned.ring_attention)          (Transformer Engine) instead of the trainer's all-gather
                                    (plan.context)
and the memory savings of this dataclass. The trainer refuses none of them by config: they are
not config keys, only the planner's flags (`python -m plan --help`).
"""
from __future__ import annotations

import dataclasses

FP8_ACTIVATIONS = ("none", "linear", "moe", "linear+moe")
OVERLAP = ("data", "expert", "pipeline", "tensor", "context")


def check_overlap(terms) -> tuple[str, ...]:
    """`terms` as a tuple, or a ValueError naming those that are not traffic terms (OVERLAP)."""
    terms = tuple(terms)
    unknown = [t for t in terms if t not in OVERLAP]
    if unknown:
        raise ValueError(f"overlap: expected some of {', '.join(OVERLAP)}, got {', '.join(unknown)}")
    return terms


@dataclasses.dataclass(frozen=True)
class Planned:
    optimizer_states: str = "fp32"
    """"bf16": AdamW's two moments (muon's one) in bf16, the master copy still fp32 (DeepSeek-V3)."""
    fp8_activations: str = "none"
    """What backward's saved tensors keep in fp8 (1 byte) instead of bf16: "linear" every linear
    layer's input (DeepSeek-V3: q/kv projections, the output projection, fc1, fc2, the experts'),
    "moe" the routed experts' fc1 input and their SwiGLU's input (Kimi K2), "linear+moe" both
    (DeepSeek-V3 §3.3.3: every linear layer's input and the MoE SwiGLU's input)."""
    recompute_norms: bool = False
    """megatron's "layernorm" recompute module (it needs Transformer Engine in the trainer): the
    norms' outputs, the attention's and the MLP's inputs, are not kept but recomputed."""
    offload_optimizer: bool = False
    """The fp32 master copy and the moments live in CPU memory (DeepSpeed's ZeRO-Offload; Kimi K2
    at 32 nodes): none of it on the GPU."""
    offload_activations: bool = False
    """The activations kept for backward go to CPU memory as each chunk's forward ends and come
    back before its backward (Kimi K2): the GPU holds two chunks' worth, the one being computed and
    the one moving."""
    overlap: tuple[str, ...] = ()
    """The traffic terms that run beside the compute, as the trainer does not run them: "data"
    ZeRO's gradient reduce-scatter and parameter all-gather a layer at a time (megatron's
    overlap_grad_reduce / overlap_param_gather, DeepSpeed's overlap_comm), "expert" the
    dispatcher's whole all-to-all, warm-up and cool-down included (DeepSeek-V3's DualPipe, Kimi
    K2's interleaved 1F1B with extra warm-up micro-batches; the trainer's own overlap,
    parallel.overlap_moe_expert_parallel_comm, hides less and is no planned-only setting:
    plan.ep_overlap), "pipeline" the stage-to-stage sends (megatron's overlap_p2p_comm),
    "tensor" sequence parallelism's collectives (Transformer Engine's userbuffers), "context"
    context parallelism's K and V exchange (the ring attention's passing, ring_attention; the
    trainer's all-gather runs before the attention, not beside it)."""
    node_dispatch: bool = False
    """Where EP crosses nodes, a token is sent over InfiniBand once per destination node and
    forwarded to its experts there over NVLink (DeepSeek-V3 §3.2.2, DeepEP; megatron's flex
    dispatcher), instead of once per routed expert; with num_groups, at most group_topk nodes."""
    fused_swiglu: bool = False
    """megatron's fused SwiGLU (bias_activation_fusion: NVIDIA's recipes, Megatron-LM's default;
    DeepSeek's and Moonshot's own kernels) in the dense MLPs and shared experts: they keep fc1's
    output and the product fc2 reads, 3·F a token, where this trainer's unfused glu also keeps
    silu(gate) and a copy of up (+ glu_linear_offset), 5·F (megatron_kappa/model/build.py turns
    the fusion off)."""
    ring_attention: bool = False
    """Context parallelism passes each rank's K and V chunk round the CP ring (megatron's default
    cp_comm_type p2p, Transformer Engine's attention: the published runs' CP), 3 (cp − 1) hops a
    layer, each rank keeping its own K and V, instead of the trainer's all-gather, which keeps the
    gathered keys and values (plan.context)."""
    dualpipe: bool = False
    """The pipeline runs DeepSeek-V3's DualPipe instead of 1F1B where it can (even stages, no
    virtual stages, at least 2 × PP micro-batches): each rank holds two stages, a smaller bubble
    (plan.dualpipe)."""

    def __post_init__(self):
        if self.optimizer_states not in ("fp32", "bf16"):
            raise ValueError(f"optimizer_states: expected fp32 or bf16, got {self.optimizer_states!r}")
        if self.fp8_activations not in FP8_ACTIVATIONS:
            raise ValueError(f"fp8_activations: expected one of {', '.join(FP8_ACTIVATIONS)}, "
                             f"got {self.fp8_activations!r}")
        check_overlap(self.overlap)

    def labels(self, layout) -> list[str]:
        """What of this plan the trainer cannot run, for the output."""
        # context parallelism (Layout.cp) runs in the trainer (parallel.cp): not planned only; its ring is
        out = ["bf16 optimizer moments"] * (self.optimizer_states == "bf16")
        out += [f"fp8 activations ({self.fp8_activations})"] * (self.fp8_activations != "none")
        out += ["norm recompute"] * self.recompute_norms
        out += ["optimizer offload"] * self.offload_optimizer + ["activation offload"] * self.offload_activations
        out += [f"overlap ({', '.join(self.overlap)})"] * bool(self.overlap)
        out += ["node-limited dispatch"] * self.node_dispatch
        out += ["ring attention"] * (self.ring_attention and layout.cp > 1)
        out += ["DualPipe"] * (self.dualpipe and layout.pp > 1)
        out += ["fused SwiGLU"] * self.fused_swiglu
        return out
