"""configs/frontier/: published shapes (total parameters against the published count, within
what each config says it approximates) with a layout the planner says fits 80 GB GPUs."""
import pytest

from megatron_kappa import plan as planner
from megatron_kappa.config import load_config

FRONTIER = {  # config: (world, published total parameters, tolerance)
    "deepseek_v3": (2048, 671e9, 0.07),   # 3 more MoE layers (64 layers for the even pipeline split)
    "qwen3_235b_a22b": (512, 235e9, 0.03),  # 96 layers instead of 94
    "kimi_k2": (2048, 1.04e12, 0.06),     # 3 more MoE layers
    "mixtral_8x22b": (256, 141e9, 0.01),  # exact shapes
}


@pytest.mark.parametrize("name", FRONTIER)
def test_frontier_config_fits_80gb_with_its_layout(name):
    world, published, tolerance = FRONTIER[name]
    cfg = load_config(f"configs/frontier/{name}.yaml")
    total = sum(planner.stage_params(cfg, planner.Layout(1), 0).values())
    assert total == pytest.approx(published, rel=tolerance), total
    result = planner.plan(cfg, planner.layout_of(cfg, world), gpu_mem_gib=80, gpus_per_node=8)
    assert result["fits"], planner.render(result)
    assert cfg.parallel.pp > 1 and cfg.zero.stage == 1  # pipeline stages need ZeRO-1
    # the layout is needed: the same model on one pipeline stage does not fit
    flat = planner.plan(cfg, planner.Layout(world, cfg.parallel.tp, 1, cfg.parallel.ep, cfg.parallel.expert_tp),
                        gpu_mem_gib=80)
    assert flat["most_loaded"]["param_count"] > 2 * result["most_loaded"]["param_count"]


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
