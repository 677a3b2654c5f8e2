"""Grouped-GEMM experts against megatron's per-expert loop, from the same weights."""
import pytest
import torch

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.parallel.groups import init_distributed
from megatron_kappa.parallel.sharding import gather_full
from tests.support import parity
from tests.support.compare import max_gap


def trained(cfg, state):
    """Three steps in float64 (parity.REFERENCE_DTYPE): the wiring of the two experts classes
    compared without the fp32 summation orders of their GEMMs (the kernel itself: below)."""
    init_distributed(cfg.parallel, seed=5, device="cpu")
    model = parity.build(cfg, seed=11, dtype=parity.REFERENCE_DTYPE)
    model.load_state_dict(state, strict=True)  # per-expert names load into either experts class
    losses, grads = parity.train(model, cfg, parity.split_for_reference(parity.global_batch(), 2))
    return losses, gather_full(model, grads)


@pytest.mark.parametrize("kappa", [True, False])
def test_grouped_experts_match_sequential_experts(world1, kappa):
    sequential = parity.make_cfg(kappa=kappa, grouped=False)
    grouped = parity.make_cfg(kappa=kappa, grouped=True)
    init_distributed(sequential.parallel, seed=5, device="cpu")
    reference = parity.build(sequential, dtype=parity.REFERENCE_DTYPE)
    parity.init_reference_weights(reference)  # α, b ≠ 0 and large router logits: κ matters
    state = {k: v.clone() for k, v in reference.state_dict().items() if not k.endswith("_extra_state")}
    seq_losses, seq_grads = trained(sequential, state)
    grp_losses, grp_grads = trained(grouped, state)
    assert len(seq_losses) == parity.STEPS >= 3
    assert max_gap(seq_losses, grp_losses) <= parity.LOSS_GAP, (seq_losses, grp_losses)
    assert seq_grads.keys() == grp_grads.keys() and any("local_experts.3.linear_fc2" in k for k in seq_grads)
    for name, ref in seq_grads.items():
        err = (grp_grads[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
        assert err <= parity.GRAD_ERROR, (name, err.item())
    # Negative control: the same comparison sees experts' weights swapped between two experts.
    swapped = dict(state)
    first = [k for k in state if ".mlp.experts.local_experts.0." in k]
    for k in first:
        other = k.replace("local_experts.0.", "local_experts.1.")
        swapped[k], swapped[other] = state[other], state[k]
    bad_losses, _ = trained(grouped, swapped)
    assert max_gap(seq_losses, bad_losses) > 1e-4


def test_grouped_gemm_is_within_its_fp32_error_bound(world1):
    """The fp32 grouped GEMM the experts run, each entry against the float64 product of its own
    expert's rows, within the rounding bound of a K-term dot product, |fl(x·w) − x·w| ≤ γ_K |x|·|w|
    with γ_K = K·u / (1 − K·u), u = 2^-24 (Higham, Accuracy and Stability, §3.1): it holds for every
    summation order, so on every CPU's kernels. Negative control: the rows cut one row off their
    expert (wrong offsets) break it."""
    from megatron_kappa.model.experts import GroupedExperts
    model = parity.build(parity.make_cfg(kappa=False))
    experts = next(m for m in model.modules() if isinstance(m, GroupedExperts))
    weight = experts.fc1_weight.detach()  # [E, out, K]
    E, _, K = weight.shape
    gen = torch.Generator().manual_seed(3)
    counts = torch.tensor([5, 0, 9, 3][:E], dtype=torch.int32)
    x = torch.randn(int(counts.sum()), K, generator=gen)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    got = experts._gemm(x, weight, offs)
    u = 2.0 ** -24
    gamma = K * u / (1 - K * u)

    def within_bound(offsets):
        exact = experts._gemm(x.double(), weight.double(), offsets)  # float64: one GEMM per expert
        scale = experts._gemm(x.double().abs(), weight.double().abs(), offsets)
        return bool(((got.double() - exact).abs() <= gamma * scale).all())

    assert got.dtype == torch.float32 and within_bound(offs)
    shifted = offs.clone()
    shifted[0] -= 1
    assert not within_bound(shifted)


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
