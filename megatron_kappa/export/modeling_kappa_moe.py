"""A κ-SwiGLU Mixture-of-Experts language model for Hugging Face transformers, as megatron_kappa
trains it: `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` on a folder that
`python -m megatron_kappa.export` wrote. This file stands alone (torch and transformers only): it is
copied beside the weights and is the model's definition outside the training stack.

Per layer, as megatron-core runs it (pre-norm, RMSNorm, no biases, RoPE rotate-half):

    x = λ_resid·x + λ_x0·x0                                  (residual_scalars; x0 the input embedding)
    q, k, v = W_q·n(x), W_k·n(x), W_v·n(x);  q, k = rope(n_q(q)), rope(n_k(k))     (qk_norm)
    v += 2σ(W_gate·n(x)[..., :32])·ve[tokens]                (the layers in value_embedding_layers)
    x += W_o·attention(q, k, v)
    x += MLP(n(x)):  dense SwiGLU, or MoE: Σ_{e ∈ top-k} p_e · FFN_e(x) (+ a shared SwiGLU expert)

The router: softmax over the top-k logits, or sigmoid scores picked by score + the balance bias and
divided by their sum; both times route_scale; with n_group, a token picks among the experts of its
topk_group best groups (DeepSeek-V3's group-limited routing). A κ expert's activation is
h = g·σ(κ g)·u with κ = U^tanh(gain·(α_e·(scale·s) + b_e)), s the token's router logit for that
expert (kappa_input normalized: 6·s divided by a per-expert norm of the router weight). Logits
are c·tanh(logits/c) with logit_softcap. Every token runs through its experts: no capacity drops.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

VALUE_GATE_CHANNELS = 32  # a value-embedding gate reads the first 32 channels of the normed input


class KappaMoeConfig(PreTrainedConfig):
    model_type = "kappa_moe"

    def __init__(self, vocab_size=2048, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=None, head_dim=None, intermediate_size=256, moe_intermediate_size=256,
                 shared_expert_intermediate_size=None, num_experts=4, num_experts_per_tok=2, mlp_layer_types=None,
                 router_score="softmax", route_scale=1.0, n_group=None, topk_group=None, kappa=None, qk_norm=True,
                 norm_gains=True,
                 rms_norm_eps=1e-5, embedding_norm=False, residual_scalars=False, value_embedding_layers=(),
                 logit_softcap=None, rope_theta=10000.0, max_position_embeddings=2048, mla=None, **kwargs):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.intermediate_size, self.moe_intermediate_size = intermediate_size, moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.num_experts, self.num_experts_per_tok = num_experts, num_experts_per_tok
        self.mlp_layer_types = list(mlp_layer_types or ["moe"] * num_hidden_layers)  # "dense" | "moe"
        self.router_score, self.route_scale = router_score, route_scale  # "softmax" | "sigmoid"
        self.n_group, self.topk_group = n_group, topk_group  # group-limited routing (None: off)
        # None: plain SwiGLU experts; else {U, logit_scale, tanh_gain, use_alpha, use_bias, input}
        self.kappa = dict(kappa) if kappa else None
        self.qk_norm, self.norm_gains, self.rms_norm_eps = qk_norm, norm_gains, rms_norm_eps
        self.embedding_norm, self.residual_scalars = embedding_norm, residual_scalars
        self.value_embedding_layers = list(value_embedding_layers)
        self.logit_softcap, self.rope_theta = logit_softcap, rope_theta
        self.max_position_embeddings = max_position_embeddings
        # None: (grouped-query) attention; else multi-head latent attention:
        # {q_lora_rank (or None), kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim}
        self.mla = dict(mla) if mla else None
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class RMSNorm(nn.Module):
    """x / √(mean(x²) + ε), times a learned gain when `gains`; in fp32, cast back."""

    def __init__(self, size: int, eps: float, gains: bool):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size)) if gains else None

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope(x, positions, theta: float):
    """x [b, heads, s, d] rotated by its positions [b, s] (rotate-half, the whole head)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angle = positions.float()[..., None] * inv  # [b, s, d/2]
    angle = torch.cat([angle, angle], -1)[:, None]  # [b, 1, s, d]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = torch.cat([-x2, x1], -1)
    return (x.float() * angle.cos() + rotated.float() * angle.sin()).to(x.dtype)


def rope_pairs(x, positions, theta: float):
    """RoPE of the pairs (x_2i, x_2i+1), as MLA applies it: evens then odds, then rotate-half (the
    output's channel order is the same for queries and keys, so their products are the pairs')."""
    return rope(torch.cat([x[..., 0::2], x[..., 1::2]], -1), positions, theta)


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), with DeepSeek-V3's module names:
    c_q = n(q_a_proj·h), q = q_b_proj·c_q (or q_proj·h);  [c_kv; k_pe] = kv_a_proj_with_mqa·h,
    [k_nope; v] = kv_b_proj·n(c_kv) per head;  q_pe, k_pe roped (k_pe shared by the heads)."""

    def __init__(self, config: KappaMoeConfig, layer: int):
        super().__init__()
        c, a = config, config.mla
        self.layer, self.heads, self.theta = layer, c.num_attention_heads, c.rope_theta
        self.dq, self.dr, self.dv, self.kv_rank = (a["qk_head_dim"], a["qk_pos_emb_head_dim"], a["v_head_dim"],
                                                   a["kv_lora_rank"])
        q_width = self.heads * (self.dq + self.dr)
        if a.get("q_lora_rank"):
            self.q_a_proj = nn.Linear(c.hidden_size, a["q_lora_rank"], bias=False)
            self.q_a_layernorm = RMSNorm(a["q_lora_rank"], c.rms_norm_eps, c.norm_gains) if c.qk_norm else None
            self.q_b_proj = nn.Linear(a["q_lora_rank"], q_width, bias=False)
        else:
            self.q_proj = nn.Linear(c.hidden_size, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, self.kv_rank + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, c.rms_norm_eps, c.norm_gains) if c.qk_norm else None
        self.kv_b_proj = nn.Linear(self.kv_rank, self.heads * (self.dq + self.dv), bias=False)
        self.o_proj = nn.Linear(self.heads * self.dv, c.hidden_size, bias=False)

    def forward(self, h, input_ids, positions, mask, cache):
        b, s, _ = h.shape
        def norm(module, x):
            return x if module is None else module(x)
        if hasattr(self, "q_proj"):
            q = self.q_proj(h)
        else:
            q = self.q_b_proj(norm(self.q_a_layernorm, self.q_a_proj(h)))
        q_nope, q_pe = q.view(b, s, self.heads, self.dq + self.dr).transpose(1, 2).split([self.dq, self.dr], -1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(h).split([self.kv_rank, self.dr], -1)
        kv = self.kv_b_proj(norm(self.kv_a_layernorm, c_kv)).view(b, s, self.heads, self.dq + self.dv).transpose(1, 2)
        k_nope, v = kv.split([self.dq, self.dv], -1)
        q_pe = rope_pairs(q_pe, positions, self.theta)
        k_pe = rope_pairs(k_pe[:, None], positions, self.theta).expand(-1, self.heads, -1, -1)
        q, k = torch.cat([q_nope, q_pe], -1), torch.cat([k_nope, k_pe], -1)
        if cache is not None:
            k, v = cache.update(k, v, self.layer)
        scale = (self.dq + self.dr) ** -0.5
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Attention(nn.Module):
    def __init__(self, config: KappaMoeConfig, layer: int):
        super().__init__()
        c = config
        self.layer, self.heads = layer, c.num_attention_heads
        self.kv_heads, self.head_dim = c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps, c.norm_gains) if c.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps, c.norm_gains) if c.qk_norm else None
        self.value_embedding = self.value_gate = None
        if layer in c.value_embedding_layers:
            self.value_embedding = nn.Embedding(c.vocab_size, self.kv_heads * self.head_dim)
            self.value_gate = nn.Linear(VALUE_GATE_CHANNELS, self.kv_heads, bias=False)
        self.theta = c.rope_theta

    def forward(self, h, input_ids, positions, mask, cache):
        b, s, _ = h.shape
        q = self.q_proj(h).view(b, s, self.heads, self.head_dim)
        k = self.k_proj(h).view(b, s, self.kv_heads, self.head_dim)
        v = self.v_proj(h).view(b, s, self.kv_heads, self.head_dim)
        if self.value_embedding is not None:
            gate = 2 * torch.sigmoid(self.value_gate(h[..., :VALUE_GATE_CHANNELS]))  # [b, s, kv heads]
            v = v + gate[..., None] * self.value_embedding(input_ids).view_as(v)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        q, k = rope(q, positions, self.theta), rope(k, positions, self.theta)
        if cache is not None:
            k, v = cache.update(k, v, self.layer)
        if mask is None:  # no cache, no padding: plain causal attention
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def kappa_logit(logits, router_weight, kind: str):
    """What κ sees of the router logits [T, E]: the logit, or (normalized) 6·s / n_e with
    n_e = √H · m_e^½ · mean_e'(m_e'^½), m_e = √(‖r_e‖² + 1e-4)."""
    if kind != "normalized":
        return logits
    m = torch.sqrt(router_weight.float().norm(dim=-1).square() + 1e-4)
    normaliser = math.sqrt(router_weight.shape[-1]) * m.sqrt() * m.sqrt().mean()
    return 6.0 * logits / normaliser


class MoE(nn.Module):
    def __init__(self, config: KappaMoeConfig):
        super().__init__()
        c = config
        self.topk, self.score = c.num_experts_per_tok, c.router_score
        self.route_scale, self.kappa = c.route_scale, c.kappa
        self.groups, self.group_topk = c.n_group, c.topk_group
        if c.router_score not in ("softmax", "sigmoid"):  # the two `route` implements
            raise ValueError(f"router_score: expected softmax or sigmoid, got {c.router_score!r}")
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        if c.router_score == "sigmoid":  # the aux-free balance bias, under DeepSeek-V3's name
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(c.num_experts))
        self.experts = nn.ModuleList(SwiGLU(c.hidden_size, c.moe_intermediate_size) for _ in range(c.num_experts))
        k = c.kappa or {}
        shape = (c.num_experts, c.moe_intermediate_size)
        self.kappa_alpha = nn.Parameter(torch.zeros(shape)) if k.get("use_alpha") else None
        self.kappa_bias = nn.Parameter(torch.zeros(shape)) if k.get("use_bias") else None
        self.shared_experts = SwiGLU(c.hidden_size, c.shared_expert_intermediate_size) \
            if c.shared_expert_intermediate_size else None

    def limit_to_groups(self, choice):
        """choice [T, E] with the experts outside each token's topk_group best groups at -inf; a
        group scores the sum of its topk / topk_group best entries."""
        if not self.groups:
            return choice
        t, e = choice.shape
        grouped = choice.view(t, self.groups, e // self.groups)
        best = grouped.topk(self.topk // self.group_topk, dim=-1).values.sum(-1)  # [T, groups]
        keep = torch.zeros_like(best, dtype=torch.bool).scatter(1, best.topk(self.group_topk, dim=-1).indices, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(t, e)

    def route(self, x):
        """(weights [T, k], experts [T, k], router logits [T, E]) of tokens x [T, H]."""
        logits = F.linear(x.float(), self.gate.weight.float())
        if self.score == "softmax":
            _, experts = torch.topk(self.limit_to_groups(logits), self.topk, dim=-1)
            weights = torch.softmax(logits.gather(1, experts), dim=-1)
        else:  # sigmoid (__init__ refuses any other)
            scores = torch.sigmoid(logits)
            bias = self.gate.e_score_correction_bias.float()
            _, experts = torch.topk(self.limit_to_groups(scores + bias), self.topk, dim=-1)
            weights = scores.gather(1, experts)
            if self.topk > 1:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, experts, logits

    def expert(self, e: int, x, s):
        """Expert e on rows x with their router logits s (κ-SwiGLU, or SwiGLU without κ)."""
        ffn = self.experts[e]
        g, u = ffn.gate_proj(x), ffn.up_proj(x)
        if self.kappa is None:
            return ffn.down_proj(F.silu(g) * u)
        k = self.kappa
        z = g.new_zeros(g.shape[0], 1).float()
        if self.kappa_alpha is not None:
            z = z + k["logit_scale"] * s.float()[:, None] * self.kappa_alpha[e].float()
        if self.kappa_bias is not None:
            z = z + self.kappa_bias[e].float()
        kappa = k["U"] ** torch.tanh(k["tanh_gain"] * z)
        h = g.float() * torch.sigmoid(kappa * g.float()) * u.float()
        return ffn.down_proj(h.to(x.dtype))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts, logits = self.route(x)
        s = kappa_logit(logits, self.gate.weight, (self.kappa or {}).get("input", "logit"))
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in range(len(self.experts)):
            rows, slot = torch.nonzero(experts == e, as_tuple=True)
            if rows.numel():
                y = self.expert(e, x[rows], s[rows, e])
                out.index_add_(0, rows, y.float() * weights[rows, slot, None])
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).float()
        return out.to(x.dtype).view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, config: KappaMoeConfig, layer: int):
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_gains)
        self.self_attn = LatentAttention(c, layer) if c.mla else Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_gains)
        self.mlp = MoE(c) if c.mlp_layer_types[layer] == "moe" else SwiGLU(c.hidden_size, c.intermediate_size)
        if c.residual_scalars:
            self.resid_lambda = nn.Parameter(torch.ones(1))
            self.x0_lambda = nn.Parameter(torch.zeros(1))

    def forward(self, x, x0, input_ids, positions, mask, cache):
        if x0 is not None:
            x = self.resid_lambda * x + self.x0_lambda * x0
        x = x + self.self_attn(self.input_layernorm(x), input_ids, positions, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class KappaMoePreTrainedModel(PreTrainedModel):
    config_class = KappaMoeConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):  # the weights come from the export; this only fills new models
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)


class KappaMoeModel(KappaMoePreTrainedModel):
    def __init__(self, config: KappaMoeConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_gains)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None):
        b, s = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            if attention_mask is not None:  # left padding: positions count the real tokens only
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -s:]
            else:
                position_ids = torch.arange(past, past + s, device=input_ids.device).expand(b, -1)
        mask = None
        if past or (attention_mask is not None and not bool(attention_mask.all())):
            key = torch.arange(past + s, device=input_ids.device)
            query = torch.arange(past, past + s, device=input_ids.device)
            mask = (key[None, :] <= query[:, None])[None, None]  # [1, 1, s, past + s]
            if attention_mask is not None:
                mask = mask & attention_mask.bool()[:, None, None, -(past + s):]
                mask = mask | (key[None, :] == query[:, None])[None, None]  # a pad row sees itself, not NaN
        x = self.embed_tokens(input_ids)
        if self.config.embedding_norm:
            x = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.config.rms_norm_eps)
            x = x.to(self.embed_tokens.weight.dtype)
        x0 = x if self.config.residual_scalars else None
        for layer in self.layers:
            x = layer(x, x0, input_ids, position_ids, mask, cache)
        return self.norm(x)


class KappaMoeForCausalLM(KappaMoePreTrainedModel, GenerationMixin):
    def __init__(self, config: KappaMoeConfig):
        super().__init__(config)
        self.model = KappaMoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, labels=None,
                use_cache=None, logits_to_keep=0, past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if use_cache and cache is None:
            cache = DynamicCache()
        hidden = self.model(input_ids, attention_mask, position_ids, cache)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        if self.config.logit_softcap:
            c = self.config.logit_softcap
            logits = c * torch.tanh(logits / c)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)

