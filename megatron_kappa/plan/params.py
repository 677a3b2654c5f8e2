"""The parameters one rank of a layout builds, by kind, counted from the shapes the way
megatron-core shards them (tests/test_plan.py checks the counts against meta-device builds of every
rank of a grid of layouts)."""
from __future__ import annotations

from megatron_kappa import attention_kinds
from megatron_kappa.config import Config, ModelConfig
from megatron_kappa.model.layout import VALUE_GATE_CHANNELS, has_value_embedding, padded_vocab_size
from megatron_kappa.plan.layout import Layout, model_shape

# norm: also model.residual_scalars' λ; attention: also the value-embedding gates
KINDS = ("embedding", "output", "value_embedding", "attention", "dense_mlp", "shared_experts", "router",
         "experts", "kappa", "norm")
EXPERT_KINDS = ("experts", "kappa")  # reduced over the expert-data-parallel group


def attention_matrices(m: ModelConfig, t: int) -> dict[str, int]:
    """The attention kind's projections on one rank of TP t (megatron_kappa.attention_kinds):
    elements by megatron's module name."""
    return attention_kinds.of(m).matrices(m, t)


def attention_params(m: ModelConfig, t: int) -> tuple[int, int]:
    """(attention matrices, q/k norm gains: MLA's latent norms) of one layer on one rank of TP t."""
    return sum(attention_matrices(m, t).values()), attention_kinds.of(m).norm_gains(m) * m.norm_gains


def layer_params(m: ModelConfig, layout: Layout, is_moe: bool, index: int = 0) -> dict[str, int]:
    """Layer `index`'s (0-based, global) parameters on one rank, by kind (megatron's sharding)."""
    moe, t = m.moe, layout.tp
    h = m.hidden_size
    head_dim = m.head_dim or h // m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    out = dict.fromkeys(KINDS, 0)
    out["attention"], qk_gains = attention_params(m, t)
    out["norm"] = 2 * h * m.norm_gains + qk_gains  # input, pre-MLP (q, k or the MLA latents) gains
    out["norm"] += 2 * m.residual_scalars  # λ_resid, λ_x0
    if m.value_embeddings and has_value_embedding(index + 1, m.num_layers):
        # the table [vocab, kv heads · head_dim] and the gate [kv heads, 32], split by kv head
        out["value_embedding"] = padded_vocab_size(m.vocab_size, t) * groups * head_dim // t
        out["attention"] += groups * VALUE_GATE_CHANNELS // t
    ffn = m.ffn_hidden_size or 4 * h
    if not is_moe:
        out["dense_mlp"] = 3 * h * ffn // t  # fc1 [gate; up] and fc2
        return out
    local_experts, expert_ffn = moe.num_experts // layout.ep, (moe.ffn_hidden_size or ffn) // layout.etp
    out["router"] = moe.num_experts * h
    out["experts"] = local_experts * 3 * h * expert_ffn
    k = m.kappa
    out["kappa"] = local_experts * expert_ffn * ((k.use_alpha + k.use_bias) if k.enabled else 0)
    if moe.shared_ffn_hidden_size:
        out["shared_experts"] = 3 * h * moe.shared_ffn_hidden_size // t
    return out


def stage_params(cfg: Config, layout: Layout, stage: int) -> dict[str, int]:
    """Every parameter one rank of pipeline stage `stage` holds, by kind."""
    shape = model_shape(cfg, layout)
    total = dict.fromkeys(KINDS, 0)
    for index, is_moe in zip(shape.stage_layer_indices(stage), shape.stage_moe_layers(stage)):
        for kind, n in layer_params(cfg.model, layout, is_moe, index).items():
            total[kind] += n
    vocab = shape.padded_vocab // layout.tp * cfg.model.hidden_size
    if stage == 0:
        total["embedding"] += vocab
    if stage == layout.pp - 1:
        total["output"] += vocab
        total["norm"] += cfg.model.hidden_size * cfg.model.norm_gains  # the final norm's gain
        last = cfg.model.num_layers - 1
        h = cfg.model.hidden_size
        if cfg.model.mtp.num_layers and layout.pp > 1:  # the MTP modules' copy of the input embedding
            total["embedding"] += vocab
        for _ in range(cfg.model.mtp.num_layers):  # model.mtp: a layer of the last layer's kind each, on this stage
            for kind, n in layer_params(cfg.model, layout, shape.moe_layers[last], last).items():
                total[kind] += n
            total["attention"] += 2 * h * h // layout.tp  # eh_proj [h, 2h], TP-split like the attention matrices
            total["norm"] += 3 * h * cfg.model.norm_gains  # enorm, hnorm, its final norm
    return total


def largest_tensors(m: ModelConfig, layout: Layout) -> dict[str, int]:
    """The largest single parameter tensor of each kind on one rank (elements)."""
    moe, t = m.moe, layout.tp
    h = m.hidden_size
    head_dim = m.head_dim or h // m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    ffn = m.ffn_hidden_size or 4 * h
    expert_ffn = (moe.ffn_hidden_size or ffn) // layout.etp
    local_experts = moe.num_experts // layout.ep if moe.num_experts else 0
    padded = padded_vocab_size(m.vocab_size, t)
    vocab = padded // t * h
    return {"embedding": vocab, "output": vocab, "value_embedding": padded * groups * head_dim // t,
            "attention": max(attention_matrices(m, t).values()),  # linear_qkv (GQA)
            "dense_mlp": 2 * h * ffn // t,  # linear_fc1 [gate; up]
            "shared_experts": 2 * h * (moe.shared_ffn_hidden_size or 0) // t,
            "router": (moe.num_experts or 0) * h,
            # grouped GEMM keeps every local expert's fc1 in one tensor; megatron's SequentialMLP one per expert
            "experts": (local_experts if moe.grouped_gemm else 1) * 2 * expert_ffn * h,
            "kappa": local_experts * expert_ffn if moe.grouped_gemm else expert_ffn,
            "norm": max(h, head_dim)}
