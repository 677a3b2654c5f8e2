"""Grouped-GEMM experts against megatron's per-expert loop, from the same weights."""
import pytest
import torch

import parity
from compare import max_gap
from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.model.build import build_model
from megatron_kappa.parallel.groups import init_distributed
from megatron_kappa.parallel.sharding import gather_full


def trained(cfg, state):
    init_distributed(cfg.parallel, seed=5, device="cpu")
    torch.manual_seed(11)
    model = build_model(cfg, "cpu")
    model.load_state_dict(state, strict=True)  # per-expert names load into either experts class
    losses, grads = parity.train(model, cfg, parity.split_for_reference(parity.global_batch(), 2))
    return losses, gather_full(model, grads)


@pytest.mark.parametrize("kappa", [True, False])
def test_grouped_experts_match_sequential_experts(world1, kappa):
    sequential = parity.make_cfg(kappa=kappa, grouped=False)
    grouped = parity.make_cfg(kappa=kappa, grouped=True)
    init_distributed(sequential.parallel, seed=5, device="cpu")
    reference = parity.build(sequential)
    parity.init_reference_weights(reference)  # α, b ≠ 0 and large router logits: κ matters
    state = {k: v.clone() for k, v in reference.state_dict().items() if not k.endswith("_extra_state")}
    seq_losses, seq_grads = trained(sequential, state)
    grp_losses, grp_grads = trained(grouped, state)
    assert len(seq_losses) == parity.STEPS >= 3
    assert max_gap(seq_losses, grp_losses) <= 1e-5, (seq_losses, grp_losses)
    assert seq_grads.keys() == grp_grads.keys() and any("local_experts.3.linear_fc2" in k for k in seq_grads)
    for name, ref in seq_grads.items():
        err = (grp_grads[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
        assert err <= 1e-4, (name, err.item())
    # Negative control: the same comparison sees experts' weights swapped between two experts.
    swapped = dict(state)
    first = [k for k in state if ".mlp.experts.local_experts.0." in k]
    for k in first:
        other = k.replace("local_experts.0.", "local_experts.1.")
        swapped[k], swapped[other] = state[other], state[k]
    bad_losses, _ = trained(grouped, swapped)
    assert max_gap(seq_losses, bad_losses) > 1e-4


def test_grouped_gemm_alignment_is_checked():
    with pytest.raises(ConfigError, match="model.moe.grouped_gemm.*multiples of 8"):
        load_config("configs/tiny.yaml", ["precision=bf16", "model.hidden_size=60", "model.num_attention_heads=4"])
    load_config("configs/tiny.yaml", ["precision=bf16", "model.hidden_size=60", "model.num_attention_heads=4",
                                      "model.moe.grouped_gemm=false"])


@pytest.mark.parametrize("grouped", [True, False])
def test_kappa_backend_reaches_every_expert_layer(world1, grouped):
    """model.kappa.backend is what each κ experts module hands to kappa_swiglu."""
    from megatron_kappa.model.experts import KappaExpertActivation
    for backend in ("torch", "triton"):
        model = parity.build(parity.make_cfg(grouped=grouped, overrides=[f"model.kappa.backend={backend}"]))
        experts = [m for m in model.modules() if isinstance(m, KappaExpertActivation)]
        assert experts and all(m.kappa.backend == backend for m in experts)
