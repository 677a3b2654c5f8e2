"""FP8 GEMMs through torchao (`precision: fp8`, `model.fp8`).

Linears: megatron's Column/RowParallelLinear subclasses whose local matmul is torchao's float8
training matmul (`matmul_with_hp_or_float8_args`, the op inside torchao's Float8Linear). Only
`_forward_impl` changes: the weights, their TP attributes, the sequence-parallel gather and the
TP reductions stay megatron's. torchao's own module swap cannot be used: megatron's parallel
linears are not nn.Linear, and its weight wrapper drops their TP attributes.

Experts: FP8 rowwise grouped GEMMs. On CUDA, torchao's (`_to_fp8_rowwise_then_scaled_grouped_mm`:
Triton casts and torch._scaled_grouped_mm), with each expert's rows padded to a multiple of 16 as
that kernel needs. Elsewhere `EmulatedFloat8GroupedMM`: the same e4m3 casts (power-of-2 scales:
per row for the left operand, per column for the right, per expert group for the weight
gradient), then the grouped product of the dequantized values in fp32.

Everything else stays in bf16: router, norms, embedding, output layer, and κ between fc1 and fc2.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from megatron_kappa.config import ConfigError
from megatron_kappa.config.checks import fp8_capability_error
from megatron_kappa.config.schema import FP8Config

E4M3 = torch.float8_e4m3fn
GROUP_ALIGN = 16  # torch._scaled_grouped_mm: each group's rows start at a multiple of 16


@dataclasses.dataclass(frozen=True)
class FP8Settings:
    recipe: str = "rowwise"  # torchao's Float8LinearConfig recipe for the linears
    emulate: bool = True     # dequantize and multiply in fp32 (off CUDA) instead of FP8 kernels


def settings(precision: str, f: FP8Config, device: torch.device | str, part: str) -> FP8Settings | None:
    """The FP8 settings for one part of the model ("attention", "dense_mlp", "experts") under
    `precision` and model.fp8 `f`, or None where that part stays in bf16. Stops on a CUDA device
    below capability 9.0."""
    if precision != "fp8" or not getattr(f, part):
        return None
    device = torch.device(device)
    if device.type == "cuda":
        error = fp8_capability_error(torch.cuda.get_device_capability(device))
        if error:
            raise ConfigError(error)
    return FP8Settings(recipe=f.recipe, emulate=device.type != "cuda")


def describe(f: FP8Config, device: torch.device | str) -> str:
    """One log line: what runs in FP8 (model.fp8), and whether it is emulated."""
    parts = [p for p in ("attention", "dense_mlp", "experts") if getattr(f, p)]
    how = "FP8 kernels" if torch.device(device).type == "cuda" else \
        "emulated on the CPU (same casts, fp32 products: no FP8 speed-up)"
    return f"fp8: torchao {f.recipe} for {', '.join(parts) or 'nothing'}; {how}"


# --- linears ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _linear_configs(s: FP8Settings):
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(s.recipe), emulate=s.emulate)
    gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    # as torchao's Float8Linear builds it: output, grad_input, grad_weight
    mm = LinearMMConfig(*(ScaledMMConfig(s.emulate, g.use_fast_accum, False, config.pad_inner_dim) for g in gemms))
    return config, mm


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, s: FP8Settings, configs=None) -> torch.Tensor:
    """x @ weightᵀ with the FP8 casts of torchao's recipe (forward and both backward GEMMs).
    `configs`: `_linear_configs(s)`, kept by the calling module (below) as torchao's Float8Linear
    keeps its own: Dynamo cannot put torchao's config objects in a graph when they come out of
    the lru_cache call inside the traced code (a graph break in every linear), but can when it
    reads them from a module's attributes."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    config, mm = configs or _linear_configs(s)
    return matmul_with_hp_or_float8_args.apply(x, weight.t(), mm, config)


class _FP8Matmul:
    """megatron's `_forward_impl` contract (input, weight, bias, TP flags) with an FP8 matmul: the
    sequence-parallel all-gather and the TP input-gradient all-reduce that megatron's fused linear
    does are done by megatron's own mappings here."""

    def _forward_impl(self, input, weight, bias=None, *, gradient_accumulation_fusion=False,
                      allreduce_dgrad=False, sequence_parallel=False, tp_group=None, **unused):
        if gradient_accumulation_fusion:
            raise ValueError("FP8 linears: gradient_accumulation_fusion must be off")
        if sequence_parallel:  # all-gather the sequence; backward: reduce-scatter the input gradient
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
        elif allreduce_dgrad:  # identity; backward: all-reduce the input gradient over TP
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        out = fp8_linear(input, weight, self.fp8, self.fp8_configs)
        return out if bias is None else out + bias

    def set_fp8(self, s: FP8Settings):
        """The settings and torchao's configs made from them (read by `fp8_linear`)."""
        self.fp8, self.fp8_configs = s, _linear_configs(s)


class FP8ColumnParallelLinear(_FP8Matmul, ColumnParallelLinear):
    def __init__(self, *args, fp8: FP8Settings, **kwargs):
        super().__init__(*args, **kwargs)
        self.set_fp8(fp8)


class FP8RowParallelLinear(_FP8Matmul, RowParallelLinear):
    def __init__(self, *args, fp8: FP8Settings, **kwargs):
        super().__init__(*args, **kwargs)
        self.set_fp8(fp8)


# --- grouped GEMMs (experts) --------------------------------------------------------------------

def _scale(amax: torch.Tensor) -> torch.Tensor:
    """torchao's scale for an amax: e4m3 max / amax in float64, to float32, down to a power of 2."""
    from torchao.float8.float8_utils import amax_to_scale
    return amax_to_scale(amax, E4M3, round_scales_to_power_of_2=True)


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from torchao.float8.float8_utils import to_fp8_saturated
    return to_fp8_saturated(x.to(torch.float32) * scale, E4M3)


def dequantize(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 value an FP8 operand stands for (exact: the scales are powers of 2)."""
    return x8.to(torch.float32) / scale


def cast_along(x: torch.Tensor, dim: int):
    """e4m3 data and scales, one scale per slice along `dim` (its amax over `dim`)."""
    scale = _scale(x.abs().amax(dim=dim, keepdim=True))
    return _cast(x, scale), scale


def group_of_rows(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's group index for group end offsets `offs`; rows past the last offset get
    len(offs) (they belong to no group). Computed on the device: no host sync."""
    return torch.searchsorted(offs, torch.arange(rows, device=offs.device, dtype=offs.dtype), right=True)


def cast_per_group_columns(x: torch.Tensor, offs: torch.Tensor):
    """e4m3 data and per-row scales where each group's rows share one scale per column (the
    operands of the weight-gradient GEMM, which reduces over each group's rows). Empty groups
    are fine: they have no rows to cast."""
    groups = group_of_rows(offs, x.shape[0])
    amax = torch.zeros(offs.numel() + 1, x.shape[1], dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(0, groups[:, None].expand(x.shape), x.abs().to(torch.float32), "amax")
    scale = _scale(amax)[groups]
    return _cast(x, scale), scale


class EmulatedFloat8GroupedMM(torch.autograd.Function):
    """out[rows of group e] = a[rows] @ b_t[e], with torchao's rowwise FP8 recipe emulated: the
    forward casts a per row and b_t per (expert, column); the input gradient casts the output
    gradient per row and b_t per (expert, row); the weight gradient casts both operands per
    expert group and column. Products of the dequantized values run in fp32."""

    @staticmethod
    def forward(ctx, a, b_t, offs):
        ctx.save_for_backward(a, b_t, offs)
        a8, sa = cast_along(a, -1)
        b8, sb = cast_along(b_t, -2)
        return F.grouped_mm(dequantize(a8, sa), dequantize(b8, sb), offs=offs).to(a.dtype)

    @staticmethod
    def backward(ctx, grad):
        a, b_t, offs = ctx.saved_tensors
        g8, sg = cast_along(grad, -1)
        b8, sb = cast_along(b_t, -1)
        grad_a = F.grouped_mm(dequantize(g8, sg), dequantize(b8, sb).transpose(-2, -1), offs=offs)
        gc8, sgc = cast_per_group_columns(grad, offs)
        ac8, sac = cast_per_group_columns(a, offs)
        grad_b = F.grouped_mm(dequantize(gc8, sgc).t(), dequantize(ac8, sac), offs=offs)  # [E, N, K]
        return grad_a.to(a.dtype), grad_b.transpose(-2, -1).to(b_t.dtype), None


def _padded_rows(offs: torch.Tensor, rows: int, align: int = GROUP_ALIGN):
    """Where each row goes when every group is padded to a multiple of `align` rows, and the
    padded groups' end offsets (on the device: no host sync)."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    padded_ends = torch.cumsum((counts + align - 1) // align * align, 0, dtype=offs.dtype)
    shift = (padded_ends - padded_ends.diff(prepend=offs.new_zeros(1))) - (offs - counts)
    # rows past the last group (fewer counted rows than rows) go past the last padded group
    shift = torch.cat([shift, padded_ends[-1:] - offs[-1:]])
    return torch.arange(rows, device=offs.device) + shift[group_of_rows(offs, rows)], padded_ends


def padded_grouped_mm(gemm, a, b_t, offs):
    """`gemm(a, b_t, offs)` with every group's rows padded to a multiple of 16 (zero rows, which
    change neither the rowwise scales nor the products), as torch._scaled_grouped_mm needs."""
    rows, groups = a.shape[0], offs.numel()
    dest, padded_offs = _padded_rows(offs, rows)
    # a static upper bound on the padded rows (no host sync); rows past the last group are zero
    padded = a.new_zeros(rows + (GROUP_ALIGN - 1) * groups, a.shape[1]).index_copy(0, dest, a)
    return gemm(padded, b_t, padded_offs).index_select(0, dest)


def _torchao_grouped_mm(a, b_t, offs):
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm
    return _to_fp8_rowwise_then_scaled_grouped_mm(a, b_t, offs, out_dtype=a.dtype,
                                                  pad_token_groups_for_grouped_mm=False)


def grouped_mm(a: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, s: FP8Settings) -> torch.Tensor:
    """FP8 rowwise `F.grouped_mm(a, weight.transpose(1, 2), offs=offs)`; weight is [E, N, K]
    (megatron's per-expert [out, in] stacked), so each expert's transpose is column-major as the
    FP8 kernel wants."""
    b_t = weight.transpose(1, 2)
    if s.emulate:
        return EmulatedFloat8GroupedMM.apply(a, b_t, offs)
    return padded_grouped_mm(_torchao_grouped_mm, a, b_t, offs)
