"""configs/frontier/: the published shapes, their parameter counts beside the published ones (the
summary, from meta builds, and the planner, by its arithmetic), and a layout the planner says fits
80 GB GPUs."""
import pytest

from megatron_kappa import plan as planner
from megatron_kappa.config import load_config

FRONTIER = {  # config: (world, published total parameters, tolerance)
    "deepseek_v3": (2048, 671e9, 0.02),
    "qwen3_235b_a22b": (512, 235e9, 0.02),
    "kimi_k2": (2048, 1.04e12, 0.02),
    "mixtral_8x22b": (256, 141e9, 0.02),
}
# Published (total, active per token), main model only: DeepSeek-V3 report (arXiv 2412.19437) §1 and
# §4.2 (671 B + 14 B MTP, 37 B active); Qwen3 report (arXiv 2505.09388) Table 2 (235 B, 22 B); Kimi K2
# report (arXiv 2507.20534) §1 (1.04 T, 32 B); Mixtral 8x22B release (141 B, 39 B).
PUBLISHED = {"deepseek_v3": (671e9, 37e9), "qwen3_235b_a22b": (235e9, 22e9), "kimi_k2": (1.04e12, 32e9),
             "mixtral_8x22b": (141e9, 39e9)}
# Where the published shapes do not give the published number within 2 %: Kimi K2's shapes give 32.86 B
# active (embedding and output layer, 61 MLA layers, the dense layer, the shared and 8 routed experts
# per MoE layer), 2.7 % above the 32 B its report rounds to.
ACTIVE_TOLERANCE = {"kimi_k2": 0.03}


@pytest.mark.parametrize("name", PUBLISHED)
def test_summary_beside_the_published_numbers(world1, name):
    from megatron_kappa.summary import summarize
    s = summarize(load_config(f"configs/frontier/{name}.yaml"))
    total, active = PUBLISHED[name]
    assert s["total_params"] == pytest.approx(total, rel=0.02), s["total_params"]
    assert s["active_params_per_token"] == pytest.approx(active, rel=ACTIVE_TOLERANCE.get(name, 0.02)), \
        s["active_params_per_token"]
    if name != "deepseek_v3":
        assert s["mtp_params"] == 0
        return
    # DeepSeek-V3's MTP depth: "11.5B unique parameters, excluding the shared 0.9B Embedding and 0.9B
    # output Head" (its README_WEIGHTS.md); with those, the report's 14 B beside 671 B (685 B in all)
    assert s["mtp_params"] == pytest.approx(11.5e9, rel=0.02)
    assert s["total_params"] + s["mtp_params"] + 2 * s["input_embedding"] == pytest.approx(685e9, rel=0.005)


@pytest.mark.parametrize("name", FRONTIER)
def test_frontier_config_fits_80gb_with_its_layout(name):
    world, published, tolerance = FRONTIER[name]
    cfg = load_config(f"configs/frontier/{name}.yaml")
    total = sum(planner.stage_params(cfg, planner.Layout(1), 0).values())
    assert total == pytest.approx(published, rel=tolerance), total
    result = planner.plan(cfg, planner.layout_of(cfg.parallel, world), gpu_mem_gib=80, gpus_per_node=8)
    assert result.fits, planner.render(result)
    assert cfg.parallel.pp > 1 and cfg.zero.stage == 1  # pipeline stages need ZeRO-1
    # the layout is needed: the same model on one pipeline stage does not fit
    flat = planner.plan(cfg, planner.Layout(world, cfg.parallel.tp, 1, cfg.parallel.ep, cfg.parallel.expert_tp),
                        gpu_mem_gib=80)
    assert flat.most_loaded.param_count > 2 * result.most_loaded.param_count


def test_shared_expert_counted_where_published():
    shared = {n for n in FRONTIER if load_config(f"configs/frontier/{n}.yaml").model.moe.shared_ffn_hidden_size}
    assert shared == {"deepseek_v3", "kimi_k2"}


@pytest.mark.parametrize("kappa", [True, False])
def test_shared_expert_is_on_the_path(world1, kappa):
    """model.moe.shared_ffn_hidden_size builds megatron's shared expert beside the routed ones:
    it gets gradients, and zeroing its output projection changes the loss."""
    import torch

    from megatron_kappa.model.build import build_model
    cfg = load_config("configs/tiny.yaml", ["model.moe.shared_ffn_hidden_size=128",
                                            f"model.kappa.enabled={str(kappa).lower()}"])
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    tokens = torch.randint(0, 2048, (2, 128))
    position = torch.arange(128).expand(2, -1)
    loss = model(tokens, position, None, labels=tokens).mean()
    loss.backward()
    shared = {n: p for n, p in model.named_parameters() if ".mlp.shared_experts." in n}
    assert len(shared) == 2 * 3  # fc1 and fc2 of the 3 MoE layers
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in shared.values())
    with torch.no_grad():
        for n, p in shared.items():
            if n.endswith("linear_fc2.weight"):
                p.zero_()
        assert model(tokens, position, None, labels=tokens).mean().item() != pytest.approx(loss.item(), abs=1e-6)
