"""SDPA core attention against megatron's local DotProductAttention, from the same weights."""
import pytest
import torch

from megatron_kappa.model.attention import SDPAttention
from megatron_kappa.parallel.groups import init_distributed
from tests.support import parity
from tests.support.compare import max_gap


@pytest.mark.parametrize("groups", [None, 2], ids=["mha", "gqa"])
def test_sdpa_matches_local_attention(world1, groups):
    """Losses over 3 steps and step-0 gradients equal in float64 (parity.LOSS_GAP and GRAD_ERROR:
    in fp32 the two kernels' summation orders flip a routing decision on some CPUs)."""
    cfg = parity.make_cfg()
    if groups:
        cfg.model.num_query_groups = groups
    init_distributed(cfg.parallel, seed=5, device="cpu")
    reference = parity.build(cfg, dtype=parity.REFERENCE_DTYPE)
    parity.init_reference_weights(reference)
    state = {k: v.clone() for k, v in reference.state_dict().items() if not k.endswith("_extra_state")}

    def run(attention):
        c = parity.make_cfg()
        c.model.attention, c.model.num_query_groups = attention, groups
        init_distributed(c.parallel, seed=5, device="cpu")
        m = parity.build(c, dtype=parity.REFERENCE_DTYPE)
        m.load_state_dict(state)
        assert any(isinstance(x, SDPAttention) for x in m.modules()) == (attention == "sdpa")
        return parity.train(m, c, parity.split_for_reference(parity.global_batch(), 2))

    local_losses, local_grads = run("local")
    sdpa_losses, sdpa_grads = run("sdpa")
    assert len(local_losses) == parity.STEPS
    assert max_gap(local_losses, sdpa_losses) <= parity.LOSS_GAP, (local_losses, sdpa_losses)
    for name, ref in local_grads.items():
        err = (sdpa_grads[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
        assert err <= parity.GRAD_ERROR, (name, err.item())


def test_negative_control_non_causal_attention_differs(world1):
    """The comparison above sees the mask: attention without the causal mask changes the output."""
    from megatron.core.transformer.enums import AttnMaskType
    cfg = parity.make_cfg()
    init_distributed(cfg.parallel, seed=5, device="cpu")
    from megatron_kappa.model.build import transformer_config
    tconfig = transformer_config(cfg, "cpu")
    causal = SDPAttention(tconfig, 1, AttnMaskType.causal, "self")
    full = SDPAttention(tconfig, 1, AttnMaskType.no_mask, "self")
    q, k, v = (torch.randn(6, 2, 4, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    assert (causal(q, k, v, None) - full(q, k, v, None)).abs().max() > 1e-2
    # and the causal output equals a naive causal softmax attention
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / 4.0
    scores = scores.masked_fill(torch.triu(torch.ones(6, 6, dtype=torch.bool), 1), float("-inf"))
    naive = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(6, 2, 64)
    torch.testing.assert_close(causal(q, k, v, None), naive, rtol=1e-5, atol=1e-6)
