"""model.compile: each transformer layer compiled on its own, as torchtitan compiles its blocks.

`apply(model, setting, device)` is called by the trainer after the model is built and before
DeepSpeed wraps it. Each TransformerLayer (the MTP layers' too) is compiled in place with
`nn.Module.compile`, so parameter names, state dicts and checkpoints are those of the eager model
and a run resumes across the switch.

One named boundary stays eager, MOE_DISPATCH: each MoE layer's forward (the dispatch: permute,
the all-to-all or all-gather with its split sizes read on the host, unpermute, and the combine)
is data-dependent host work around collectives, as the authors leave theirs eager (their own
`torch.compiler.disable` marks). Inside the boundary the router (its gating, routing, router
losses and the κ transform of the logit) is a compiled graph of its own, its losses attached
through model/aux_loss.py (megatron's scaler reads a class attribute in backward, which Dynamo
cannot); so are the experts where grouped GEMMs trace: `torch._grouped_mm`'s tracer takes only
bf16/fp16 (fp32: "Expected mat_a to be BFloat16"), so fp32 experts stay eager, and so do FP8
experts off CUDA (torchao's emulation multiplies fp32 operands).

Selective recompute's checkpoints are the other named boundary, RECOMPUTE: megatron's checkpoint
saves and restores the RNG states on the host and runs its function under no_grad, which Dynamo
does not trace (a break in every layer). Each site runs eager and what it calls is compiled on its
own (`_eager_recompute_sites`): the attention core (core_attn), the dense MLP with its norm (mlp),
MLA's attention with its projections and core (mla_up_proj), the experts' fc2 side (moe_act).
The whole MoE layer's and the shared experts' checkpoints (moe, shared_experts) are already inside
the dispatch boundary.

Under the EP overlap (parallel.overlap_moe_expert_parallel_comm) megatron's schedule calls each
layer's parts apart instead of its forward (models/gpt/fine_grained_callables.py): those are
compiled apart too (`_compile_schedule_parts`): the attention with its residual, the pre-MLP norm,
a dense layer's MLP. Experts whose weight gradients are deferred (parallel.delay_wgrad_compute)
stay eager: their GEMM queues the gradients' inputs, a side effect Dynamo does not trace.

Under tensor parallelism megatron's linears overlap their backward's all-gather and
reduce-scatter with the input-gradient GEMM (`async_op=True`, which Dynamo does not trace: 13
breaks in TP2's layers). Compiled, those two collectives are called synchronously
(`_synchronous_tp_collectives`): the same sums, and the compiler schedules the graph itself.

Graph breaks are read from Dynamo's own counters (`torch._dynamo.utils.counters`); the breaks at
the named boundaries are deliberate and counted apart, and a code object Dynamo leaves eager at its
recompile limit counts as a break (`graph_breaks`). The limit is raised with the layer count
(`raise_recompile_limit`): the routers' graphs are one per layer.
"""
from __future__ import annotations

import os
import time
import types
import warnings

import torch

from megatron_kappa.model import aux_loss

# the reasons given to torch.compiler.disable: Dynamo's graph-break counter names them
MOE_DISPATCH = "megatron_kappa MoE dispatch: data-dependent host work around collectives, left eager"
RECOMPUTE = ("megatron_kappa selective recompute: megatron's checkpoint saves the RNG state on the host and "
             "runs under no_grad, left eager")
BOUNDARIES = (MOE_DISPATCH, RECOMPUTE)


def enabled(setting: str | bool, device) -> bool:
    """model.compile resolved for `device`: auto is on for CUDA, off elsewhere."""
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return bool(setting)


def dynamo_off() -> bool:
    """Dynamo switched off for the process: TORCHDYNAMO_DISABLE=1 (torch.compile reads it itself)."""
    return torch._dynamo.config.disable or os.environ.get("TORCHDYNAMO_DISABLE", "") == "1"


def check_dynamo(setting: str | bool):
    """model.compile true with Dynamo switched off for the process (TORCHDYNAMO_DISABLE=1):
    refused in one line rather than silently eager."""
    if setting is True and dynamo_off():
        raise ValueError("model.compile: true, but Dynamo is off in this process (TORCHDYNAMO_DISABLE=1 in "
                         "the environment): unset it, or set model.compile false")


def eager_fusers() -> int:
    """megatron's jit_fuser functions (torch.compile'd when megatron imports them) back to the
    plain functions, in every megatron.core module loaded and their classes: on CPU they run eager
    unless model.compile compiles them inside the layers. Returns how many were replaced."""
    import sys

    replaced = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.core") or module is None:
            continue
        owners = [module] + [v for v in vars(module).values()
                             if isinstance(v, type) and v.__module__ == name]
        for owner in owners:
            for attr, value in list(vars(owner).items()):
                if not isinstance(value, types.FunctionType):  # (megatron's TE stand-ins are mocks: any attribute)
                    continue
                original = getattr(value, "_torchdynamo_orig_callable", None)
                if isinstance(original, types.FunctionType):
                    setattr(owner, attr, original)
                    replaced += 1
    return replaced


def transformer_layers(model) -> list[torch.nn.Module]:
    """Every TransformerLayer of `model` (decoder and MTP), outermost first, none nested."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    found = []
    for module in model.modules():
        if isinstance(module, TransformerLayer) and not any(module is not o and _contains(o, module) for o in found):
            found.append(module)
    return found


def _contains(outer, inner) -> bool:
    return any(m is inner for m in outer.modules())


def _moe_layers(layer) -> list[torch.nn.Module]:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in layer.modules() if isinstance(m, MoELayer)]


def experts_eager_reason(experts) -> str | None:
    """Why these experts stay eager when compiled (None: they compile)."""
    weight = getattr(experts, "fc1_weight", None)
    if weight is None:
        return None
    if getattr(experts, "fp8", None) is not None and weight.device.type != "cuda":
        # FP8 emulated off CUDA: the grouped GEMM runs on fp32 operands (model/fp8.py)
        return "grouped GEMMs trace in bf16 only, not as FP8 emulated off CUDA"
    if weight.dtype not in (torch.bfloat16, torch.float16):
        return "grouped GEMMs trace in bf16 only, not in fp32"
    if getattr(experts, "wgrad_queue", None) is not None:
        return "parallel.delay_wgrad_compute queues the weight gradients, a side effect Dynamo does not trace"
    return None


class _Done:
    """The handle of a collective already complete (megatron waits on it)."""

    def wait(self):
        return None


def _all_gather(output, input, group=None, async_op=False):
    torch.distributed.all_gather_into_tensor(output, input, group=group)
    return _Done()


def _reduce_scatter(output, input, group=None, async_op=False):
    torch.distributed.reduce_scatter_tensor(output, input, group=group)
    return _Done()


def _synchronous_tp_collectives():
    """megatron's tensor-parallel linears' backward collectives, synchronous (Dynamo traces
    `all_gather_into_tensor` and `reduce_scatter_tensor` only without async_op)."""
    from megatron.core.tensor_parallel import layers

    layers.dist_all_gather_func = _all_gather
    layers.dist_reduce_scatter_func = _reduce_scatter


def pin_vector_isa() -> int:
    """Inductor's CPU vector width pinned to the ISA this process picks (ATEN_CPU_CAPABILITY, else
    the best the CPU has), so that it enters the compiled-graph cache key. torch 2.14's FX graph
    cache keys on the inductor config but not on the ISA picked from ATEN_CPU_CAPABILITY: a graph
    generated for AVX-512 (16-wide loops) and reused by a process under ATEN_CPU_CAPABILITY=avx2
    is built with 8-wide vectors, and its 16-element loads overrun them (the wrong sums, then nan
    at step 1; tests/test_compile.py). A width already set (cpp.simdlen) is kept. Returns it."""
    from torch._inductor import config, cpu_vec_isa

    if config.cpp.simdlen is None:
        config.cpp.simdlen = cpu_vec_isa.pick_vec_isa().bit_width()  # 0: no vector ISA ("default")
    return config.cpp.simdlen


def raise_recompile_limit(layers: int) -> int:
    """Dynamo's recompile limit per code object raised to cover `layers` layers. The router's graph
    is specialised to its layer (megatron's loss tracker is keyed by the layer's number, an int
    Dynamo treats as static), so each MoE layer adds an entry to the same code object's cache; at
    the default limit of 8, a model of more layers ran the later routers eager without a word
    (tests/test_compile.py). Returns the limit."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 2 * layers + 8)  # (grad on and off: recompute)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 8 * config.recompile_limit)
    return config.recompile_limit


def prepare() -> None:
    """What compiling needs set for the process, before any module is compiled."""
    pin_vector_isa()
    aux_loss.install()
    # megatron 0.19.2 warns on rank 0 inside its linears' forward ("tp_group is None, using default
    # tp group", a DeprecationWarning with keyword arguments, which Dynamo can neither trace nor
    # reorder): inside compiled code the call is dropped instead of breaking every layer's graph
    torch._dynamo.config.ignore_logging_functions.add(warnings.warn)
    _synchronous_tp_collectives()


def _eager(owner, method: str, reason: str) -> None:
    """owner.method left eager at a named boundary (an instance attribute: the class is untouched)."""
    setattr(owner, method, torch.compiler.disable(getattr(owner, method), reason=reason))


def compile_moe_layer(moe) -> str | None:
    """One MoE layer: its forward (the dispatch) the eager boundary, the router and, where they
    trace, the experts graphs of their own inside it. Returns why the experts stay eager, or None."""
    _eager(moe, "forward", MOE_DISPATCH)
    moe.router.compile()
    why = experts_eager_reason(moe.experts)
    if why is not None:
        return why
    if getattr(moe.experts, "recompute_activation", False):  # moe_act: fc1 compiled, the checkpoint eager
        _eager(moe.experts, "recomputed_fc2", RECOMPUTE)
    moe.experts.compile()
    return None


def _eager_recompute_sites(layer) -> list[str]:
    """Selective recompute's checkpoints in `layer` left eager at the RECOMPUTE boundary, what they
    call compiled on its own. Returns the sites (megatron's module names) found."""
    sites = []
    attn = getattr(layer, "self_attention", None)
    core = getattr(attn, "checkpoint_core_attention", False)
    if getattr(attn, "recompute_up_proj", False):  # its checkpoint spans get_query_key_value_tensors to
        _eager(attn, "forward", RECOMPUTE)         # a hook on the core's output: MLA's forward eager
        for child in attn.children():  # its projections, norms and core (RoPE's forward is an lru_cache)
            if child is attn.core_attention or any(True for _ in child.parameters()):
                child.compile()
        sites.append("mla_up_proj")
    elif core:
        _eager(attn, "_checkpointed_attention_forward", RECOMPUTE)
        attn.core_attention.compile()
    if core:
        sites.append("core_attn")
    if getattr(layer, "recompute_mlp", False):  # a dense layer's MLP (megatron: not in MoE layers)
        _eager(layer, "_forward_mlp", RECOMPUTE)
        layer.pre_mlp_layernorm.compile()
        layer.mlp.compile()
        sites.append("mlp")
    return sites


def _compile_schedule_parts(layer, has_moe: bool) -> None:
    """The parts megatron's EP-overlap schedule calls apart instead of the layer's forward
    (models/gpt/fine_grained_callables.py): the attention with its residual, the pre-MLP norm (the
    router and experts are compiled with the MoE layer) and a dense layer's MLP."""
    layer._forward_attention = torch.compile(layer._forward_attention)
    if has_moe:
        layer.pre_mlp_layernorm.compile()
    else:
        layer._forward_mlp = torch.compile(layer._forward_mlp)


def compile_layers(model) -> dict:
    """Compile each transformer layer of `model` in place; returns what was done, for the start
    line (`describe`): the layer count, the MoE layers, why experts stay eager ({reason: layers}),
    the recompute sites left eager and whether the EP overlap's schedule parts were compiled."""
    layers = transformer_layers(model)
    prepare()
    raise_recompile_limit(len(layers))
    eager_experts, recompute, moe_layers = {}, set(), 0
    overlap = any(layer.config.overlap_moe_expert_parallel_comm for layer in layers)
    for layer in layers:
        moes = _moe_layers(layer)
        moe_layers += len(moes)
        for moe in moes:
            why = compile_moe_layer(moe)
            if why is not None:
                eager_experts[why] = eager_experts.get(why, 0) + 1
            if getattr(moe.experts, "recompute_activation", False):
                recompute.add("moe_act")
        recompute.update(_eager_recompute_sites(layer))
        if overlap:
            _compile_schedule_parts(layer, bool(moes))
        layer.compile()
    return {"layers": len(layers), "moe_layers": moe_layers,
            "eager_experts": eager_experts, "recompute": sorted(recompute), "schedule_parts": overlap,
            "start": time.perf_counter(), "breaks_before": graph_breaks()}


def _eager_by_limit(counters) -> dict:
    """Dynamo's give-ups at a recompile limit: the code object runs eager from then on, which the
    graph-break counter does not count (it is in "unimplemented")."""
    return {reason: n for reason, n in counters["unimplemented"].items() if "recompile limit" in reason}


def graph_breaks() -> dict:
    """Dynamo's graph-break counter so far: {"deliberate": n at the named boundaries, "other": n},
    a code object left eager at the recompile limit counted as other."""
    from torch._dynamo.utils import counters

    deliberate = other = 0
    for reason, n in counters["graph_break"].items():
        if _at_boundary(reason):
            deliberate += n
        else:
            other += n
    return {"deliberate": deliberate, "other": other + sum(_eager_by_limit(counters).values())}


def break_reasons() -> list[str]:
    """The first line of every graph break that is not at a named boundary, and of each recompile
    limit reached (for tests and errors)."""
    from torch._dynamo.utils import counters

    return [reason.splitlines()[0] for reason in [*counters["graph_break"], *_eager_by_limit(counters)]
            if not _at_boundary(reason)]


def _at_boundary(reason: str) -> bool:
    return any(named in reason for named in BOUNDARIES)


def describe(done: dict) -> str:
    """The start line, after the first step (Dynamo compiles at the first call), e.g.
    `compile: 4 layers, 0 graph breaks, 41 s (the MoE dispatch of 3 layers eager at its named boundary)`:
    the breaks are those outside the named boundary, the time the compile and first step's."""
    other = graph_breaks()["other"] - done["breaks_before"]["other"]
    text = (f"compile: {done['layers']} layers, {other} graph break{'s' * (other != 1)}, "
            f"{time.perf_counter() - done['start']:.0f} s")
    if done["moe_layers"]:
        n = done["moe_layers"]
        text += f" (the MoE dispatch of {n} layer{'s' * (n != 1)} eager at its named boundary"
        for why, count in done["eager_experts"].items():
            text += f"; experts eager in {count}: {why}"
        text += ")"
    if done["schedule_parts"]:
        text += " (the EP overlap's schedule runs each layer's parts apart: attention, norm and MLP compiled apart)"
    if done.get("recompute"):
        text += f" (selective recompute's checkpoints eager: {', '.join(done['recompute'])})"
    return text


def apply(model, setting: str | bool, device) -> dict | None:
    """model.compile for a built model, before DeepSpeed wraps it: the layers compiled (returns
    compile_layers' record, for `describe` after the first step) or left eager (None; on CPU
    megatron's jit_fuser functions run eager too)."""
    check_dynamo(setting)
    if not enabled(setting, device) or dynamo_off():  # auto on CUDA under TORCHDYNAMO_DISABLE=1
        if torch.device(device).type == "cpu":
            eager_fusers()
        return None
    return compile_layers(model)
