"""QK-Clip (Kimi K2's MuonClip, `train.qk_clip`): after each optimizer step, the query/key weights
of every head whose largest attention logit in the step exceeded τ scaled down, in the model's
weights and in ZeRO's fp32 master copy (docs/optimizer.md).

The rule (Kimi K2, arXiv 2507.20534 §2.1 and its Algorithm 1). For head h, S_h is the largest
pre-softmax logit scale·q_i·k_j of the step's training forwards (every micro-batch, every data-
parallel rank); γ_h = min(1, τ / S_h). The logit is bilinear in the query and key projections (RoPE
is a rotation), so scaling the head's query weights by γ^α and its key weights by γ^(1-α) scales
every logit of the head by γ, and the largest one lands on τ (α = 0.5: √γ each, as K2).
  mla  per head: its no-RoPE query q_C × γ^α and key k_C × γ^(1-α) (rows of linear_q_(up_)proj and
       linear_kv_up_proj), its RoPE query q_R × γ; the RoPE key k_R is shared by all heads and stays.
  gqa  a key head serves a group of query heads, so the group's γ is τ over the group's largest S
       (megatron-core's SelfAttention.clip_qk): every logit of the group scales by it, none stays
       above τ, and a head below τ may shrink with its group.

From megatron-core 0.19 (transformer/attention.py, multi_latent_attention.py, optimizer/qk_clip.py):
the per-head maxima in the core attention's `current_max_attn_logits` (kept by SDPAttention here,
megatron_kappa.model.attention, where megatron has TE's kernel return them), their MAX over the
data-parallel group with context parallelism, and MLASelfAttention's own `_clip_q_proj_weight` /
`_clip_kv_proj_weight` for the MLA rows. TP splits the heads (each rank clips its own), pipeline
stages clip their own layers. Three differences, each a fix:
  - ZeRO's fp32 master copy is scaled too (DeepSpeed's `_hp_mapping` fragment of each weight, as
    megatron scales `main_param`): without it the next step writes the unclipped weights back;
  - γ = 1 where S ≤ τ or S is not finite: megatron's clamp(τ / S, max=1) turns a negative S into a
    negative γ (sign-flipped weights) and a NaN into NaN weights;
  - the GQA rows are laid out here from this rank's heads: megatron's _clip_linear_qkv views the
    weight with the global query_projection_size, which mis-slices a TP shard (TP = 1 agrees:
    tests/test_qk_clip.py).
No host synchronisation: a multiply by exactly 1 changes no bit, so every step multiplies instead
of asking `torch.any(S > τ)` first.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron_kappa.model.attention import SDPAttention


def clipped_layers(model) -> list:
    """The self-attention modules whose core attention records the step's largest logits."""
    return [m for m in model.modules() if isinstance(m, (SelfAttention, MLASelfAttention))
            and isinstance(m.core_attention, SDPAttention) and m.config.qk_clip]


def gamma(S: torch.Tensor, tau: float) -> torch.Tensor:
    """min(1, τ/S) where S > τ and finite, else exactly 1."""
    return torch.where(torch.isfinite(S) & (S > tau), tau / S, torch.ones_like(S))


def gqa_multiplier(attn, S: torch.Tensor) -> dict:
    """{linear_qkv weight: per-element factor}: megatron's fused rows per query group [q of its
    r heads, k, v] (r·d, d, d rows); the group's query rows × γ^α, its key rows × γ^(1-α)."""
    c, weight = attn.config, attn.linear_qkv.weight
    groups = attn.num_query_groups_per_partition
    d = c.kv_channels
    r = S.numel() // groups  # query heads per group on this rank
    g = gamma(S.view(groups, r).amax(dim=1), c.qk_clip_threshold)
    rows = torch.ones(groups, (r + 2) * d, dtype=torch.float32, device=S.device)
    rows[:, :r * d] = g.pow(c.qk_clip_alpha)[:, None]
    rows[:, r * d:(r + 1) * d] = g.pow(1 - c.qk_clip_alpha)[:, None]
    return {weight: rows.reshape(-1, 1).expand(weight.shape)}


def mla_multiplier(attn, S: torch.Tensor) -> dict:
    """{weight: factor} of megatron's MLA clip (q_C × γ^α, q_R × γ; k_C × γ^(1-α), values not),
    from its own row layout: its _clip_*_weight applied to ones."""
    c = attn.config
    attn.qk_clip_balancing_eta = gamma(S, c.qk_clip_threshold).view(-1, 1, 1)  # what megatron's helpers read
    q = attn.linear_q_up_proj.weight if c.q_lora_rank is not None else attn.linear_q_proj.weight
    kv = attn.linear_kv_up_proj.weight
    def ones(w):
        return torch.ones(w.shape, dtype=torch.float32, device=S.device)
    return {q: attn._clip_q_proj_weight(ones(q)), kv: attn._clip_kv_proj_weight(ones(kv))}


def scale_master(param, factor: torch.Tensor):
    """ZeRO's fp32 master copy of `param`: this rank's fragment of it (DeepSpeed's _hp_mapping; none
    where this rank's partition does not overlap the parameter, or without DeepSpeed)."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return
    lp = mapping.lp_fragment_address
    hp = mapping.hp_fragment.data
    hp.mul_(factor.reshape(-1).narrow(0, lp.start, lp.numel).to(hp.device))


def scale(param, factor: torch.Tensor):
    """The weight (every rank holds its whole TP shard) and its master copy, by the same factor."""
    param.data.mul_(factor)
    scale_master(param, factor)


@torch.no_grad()
def clip(model, group=None) -> torch.Tensor | None:
    """Clip every layer from its step's maxima (call after the optimizer step, every rank of the
    data-parallel group), then forget them. Returns this rank's largest logit of the step (after the
    data-parallel MAX; a device scalar, -inf without one), or None when nothing is clipped."""
    layers = clipped_layers(model)
    if not layers:
        return None
    maxima = []
    for attn in layers:
        core = attn.core_attention
        seen = core.current_max_attn_logits
        maxima.append(seen if seen is not None else torch.full((core.heads,), float("-inf"),
                                                              device=attn.linear_proj.weight.device))
    flat = torch.cat(maxima)  # one collective for the stage, not one per layer
    if group is None and dist.is_initialized() and ps.model_parallel_is_initialized():
        group = ps.get_data_parallel_group(with_context_parallel=True)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    at = 0
    for attn, seen in zip(layers, maxima):
        S = flat[at:at + seen.numel()]
        at += seen.numel()
        factors = mla_multiplier(attn, S) if isinstance(attn, MLASelfAttention) else gqa_multiplier(attn, S)
        for param, factor in factors.items():
            scale(param, factor)
        attn.core_attention.current_max_attn_logits = None
    return flat.max()


def world_max(step_max: torch.Tensor | None, device) -> float:
    """The largest logit of the step over every rank (collective: every rank calls it; a rank
    without clipped layers adds -inf), for the metrics."""
    value = torch.full((), float("-inf"), device=device) if step_max is None else step_max.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()
