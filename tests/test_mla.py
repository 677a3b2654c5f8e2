"""Multi-head latent attention (model.mla; issue 36): megatron-core's MLASelfAttention in our layer
spec against a float64 re-computation from DeepSeek-V2's formulas (arXiv 2405.04434 §2.1), with
and without the query latent; the config's refusals; the parameter count. Negative controls:
RoPE applied to pairs in rotate-half order instead of MLA's interleaved pairs, and the latent norms
dropped, are both seen.

    c_q = n_q(W_dq h);  q = W_uq c_q = [q_nope; q_pe] per head     (no query latent: q = W_q h)
    [c_kv; k_pe] = W_dkv h;  c_kv = n_kv(c_kv);  [k_nope; v] = W_ukv c_kv per head
    q_pe, k_pe = rope(q_pe), rope(k_pe)   (k_pe: one per token, shared by every head)
    o = W_o · softmax([q_nope; q_pe]·[k_nope; k_pe]ᵀ / √(d_nope + d_rope) + causal) · v
"""
import pytest
import torch

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.model.build import build_model
from tests.support.settings import MLA


def rms(x, eps, gain=None):
    y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if gain is None else y * gain


def rope(x, base, interleaved_pairs=True):
    """x [s, b, heads, d]: RoPE of the pairs (x_2i, x_2i+1) (MLA's), written as megatron does
    (evens then odds, then rotate-half); interleaved_pairs=False rotates (x_i, x_i+d/2) instead."""
    d, s = x.shape[-1], x.shape[0]
    if interleaved_pairs:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], -1)
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos[:, None, None] + rotated * sin[:, None, None]


def mla_reference(w: dict, h, cfg, interleaved_pairs=True, norms=True):
    """Attention output [s, b, H] of hidden states h [s, b, H] (float64) from the attention's
    weights `w` (its state dict)."""
    a, m = cfg.model.mla, cfg.model
    n, eps = m.num_attention_heads, m.norm_eps
    s, b, _ = h.shape
    def norm(x, name):
        return rms(x, eps, w[name]) if norms else x
    if a.q_lora_rank:
        q = norm(h @ w["linear_q_down_proj.weight"].T, "q_layernorm.weight") @ w["linear_q_up_proj.weight"].T
    else:
        q = h @ w["linear_q_proj.weight"].T
    q = q.view(s, b, n, a.qk_head_dim + a.qk_pos_emb_head_dim)
    q_nope, q_pe = q.split([a.qk_head_dim, a.qk_pos_emb_head_dim], -1)
    c_kv, k_pe = (h @ w["linear_kv_down_proj.weight"].T).split([a.kv_lora_rank, a.qk_pos_emb_head_dim], -1)
    kv = (norm(c_kv, "kv_layernorm.weight") @ w["linear_kv_up_proj.weight"].T).view(
        s, b, n, a.qk_head_dim + a.v_head_dim)
    k_nope, v = kv.split([a.qk_head_dim, a.v_head_dim], -1)
    q_pe = rope(q_pe, m.rotary_base, interleaved_pairs)
    k_pe = rope(k_pe[:, :, None], m.rotary_base, interleaved_pairs).expand(-1, -1, n, -1)
    q, k = torch.cat([q_nope, q_pe], -1), torch.cat([k_nope, k_pe], -1)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / (a.qk_head_dim + a.qk_pos_emb_head_dim) ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, b, n * a.v_head_dim)
    return out @ w["linear_proj.weight"].T


@pytest.mark.parametrize("sets", [["model.mla.q_lora_rank=32"], ["model.mla.q_lora_rank=null",
                                                                 "model.qk_layernorm=false"]],
                         ids=["query-latent", "no-query-latent-no-norms"])
def test_mla_matches_a_float64_recomputation_of_its_formulas(world1, sets):
    cfg = load_config("configs/tiny.yaml", [*MLA, *sets])
    norms = cfg.model.qk_layernorm
    torch.manual_seed(0)
    attention = build_model(cfg, "cpu").decoder.layers[1].self_attention.eval()
    with torch.no_grad():  # norms' gains away from 1, so dropping them is seen
        for name, p in attention.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    h = torch.randn(12, 2, cfg.model.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, _ = attention(h, attention_mask=None)
    w = {k: v.double() for k, v in attention.state_dict().items() if torch.is_tensor(v) and v.is_floating_point()}
    want = mla_reference(w, h.double(), cfg, norms=norms)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    controls = [dict(interleaved_pairs=False, norms=norms)] + ([dict(norms=False)] if norms else [])
    for knobs in controls:  # negative controls
        assert (mla_reference(w, h.double(), cfg, **knobs) - want).abs().max() > 1e-3 * want.abs().max(), knobs


def test_mla_counts_its_parameters_and_refuses_what_it_cannot_run(world1):
    cfg = load_config("configs/tiny.yaml", [*MLA, "model.mla.q_lora_rank=32"])
    attention = build_model(cfg, "cpu", meta=True).decoder.layers[1].self_attention
    H, n, a = cfg.model.hidden_size, cfg.model.num_attention_heads, cfg.model.mla
    want = (H * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * n * (a.qk_head_dim + a.qk_pos_emb_head_dim)
            + H * (a.kv_lora_rank + a.qk_pos_emb_head_dim) + a.kv_lora_rank
            + a.kv_lora_rank * n * (a.qk_head_dim + a.v_head_dim) + n * a.v_head_dim * H)
    assert sum(p.numel() for p in attention.parameters()) == want
    for sets, key in ((["model.num_query_groups=2"], "model.num_query_groups"),
                      (["model.attention=local"], "model.attention"),
                      (["model.block=nanochat"], "model.value_embeddings"),
                      (["model.mla.q_lora_rank=33", "parallel.tp=2"], "model.mla.q_lora_rank"),
                      (["model.mla.qk_pos_emb_head_dim=7"], "model.mla.qk_pos_emb_head_dim"),
                      (["model.mla.q_lora_rank=null"], "model.mla.q_lora_rank")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config("configs/tiny.yaml", [*MLA, *sets])
