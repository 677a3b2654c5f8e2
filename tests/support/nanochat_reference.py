"""The authors' nanochat block written from its formulas (askerlee/kappa-swiglu 14c9b04
nanochat/gpt.py; docs/authors_model.md §0-§4), in float64 and without the project's modules, for
tests/test_nanochat_block.py. Weights come from a one-process model's state dict.

    x = norm(wte[ids]);  x0 = x
    per layer i:  x = λr_i·x + λx0_i·x0
                  h = norm(x);  q, k, v = h·W_q, h·W_k, h·W_v
                  v += 2σ(h[..., :32]·W_gateᵀ)·ve_i[ids]         (value-embedding layers)
                  q, k = norm(rope(q)), norm(rope(k));  x += W_o·softmax(q·kᵀ/√d + causal)·v
                  x += MLP(norm(x))   (dense SwiGLU, or the routed (κ-)SwiGLU experts)
    logits = c·tanh(W_out·norm(x) / c)

RoPE is megatron's rotate-half sign (the authors rotate by −θ, which only matters when converting
weights; docs/recipe.md). The knobs (`gain`, `gate`, `softcap`) exist for the negative controls.
"""
import math

import torch

from tests.support.moe_reference import naive_moe


def rms(x, eps, gain=None):
    y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if gain is None else y * gain


def rope(x, base):
    """x [b, s, heads, d]: megatron's rotate-half RoPE (not interleaved, the whole head)."""
    d, s = x.shape[-1], x.shape[1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = torch.cat([-x2, x1], -1)
    return x * cos[None, :, None] + rotated * sin[None, :, None]


def forward(state: dict, ids: torch.Tensor, *, layers: int, heads: int, eps: float, base: float, softcap,
            moe_layers: set, kappa: dict | None, topk: int, gain: float | None = None, gate: bool = True):
    """Logits [b, s, V] of the nanochat block (float64). `state`: the model's state dict;
    `kappa`: the κ-SwiGLU settings (U, logit_scale, tanh_gain) or None for SwiGLU experts;
    `gain` multiplies every layer's pre-MLP norm (a negative control: the block has no gains);
    gate=False adds the value embedding ungated (another)."""
    w = {k: v.double() for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()}
    b, s = ids.shape
    x = rms(w["embedding.word_embeddings.weight"][ids], eps)
    x0 = x
    for i in range(layers):
        p = f"decoder.layers.{i}."
        x = w[p + "resid_lambda"] * x + w[p + "x0_lambda"] * x0
        h = rms(x, eps)
        qkv = (h @ w[p + "self_attention.linear_qkv.weight"].T).view(b, s, heads, 3, -1)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]  # megatron: [q, k, v] per head (no GQA)
        d = q.shape[-1]
        if p + "self_attention.value_embedding" in w:
            ve = w[p + "self_attention.value_embedding"][ids].view(b, s, heads, d)
            g = 2 * torch.sigmoid(h[..., :32] @ w[p + "self_attention.value_gate"].T) if gate else torch.ones(b, s,
                                                                                                              heads)
            v = v + g[..., None] * ve
        q, k = rms(rope(q, base), eps), rms(rope(k, base), eps)  # the authors' order: RoPE, then norm
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        att = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, heads * d)
        x = x + att @ w[p + "self_attention.linear_proj.weight"].T
        h = rms(x, eps, gain)
        if i in moe_layers:
            out = naive_moe(h.reshape(b * s, -1), _experts(w, p), topk=topk, kappa=kappa is not None,
                            **(kappa or {})).view(b, s, -1)
        else:
            gate_up = h @ w[p + "mlp.linear_fc1.weight"].T
            g_, u = gate_up.chunk(2, -1)
            out = (torch.nn.functional.silu(g_) * u) @ w[p + "mlp.linear_fc2.weight"].T
        x = x + out
    logits = rms(x, eps) @ w["output_layer.weight"].T
    return softcap * torch.tanh(logits / softcap) if softcap else logits


def _experts(w, p):
    """naive_moe's weights from the state dict's per-expert names."""
    count = sum(1 for n in w if n.startswith(p + "mlp.experts.local_experts.") and n.endswith("linear_fc1.weight"))
    fc = [[w[f"{p}mlp.experts.local_experts.{e}.linear_fc{j}.weight"] for e in range(count)] for j in (1, 2)]
    return dict(router=w[p + "mlp.router.weight"], fc1=fc[0], fc2=fc[1], alpha=w.get(p + "mlp.experts.kappa_alpha"),
                bias=w.get(p + "mlp.experts.kappa_bias"), expert_bias=None)


def loss(logits, labels):
    """Per-token cross-entropy [b, s] of float64 logits."""
    return torch.logsumexp(logits, -1) - logits.gather(-1, labels[..., None]).squeeze(-1)
