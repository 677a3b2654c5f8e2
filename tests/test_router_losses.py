"""The router losses as the authors' code computes them (model.moe.aux_loss_form, aux_loss_warmup_*,
z_loss_form, z_loss_input_grad_scale, router_dtype), against float64 re-computations written from
their formulas (askerlee/kappa-swiglu 14c9b04: nanochat/gpt.py compute_z_loss 289-313, the router's
z-loss matmul 520-530, compute_aux_loss 632-651; scripts/base_train.py get_annealed_loss_weight
947-952), with negative controls."""
import json

import pytest
import torch
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, switch_load_balancing_loss_func

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.model.build import layer_specs, transformer_config
from megatron_kappa.model.layout import model_layout
from megatron_kappa.model.moe import ZLossRouter
from megatron_kappa.train import recipe

Z = 1e-3  # a z-loss weight large enough that its gradient shows beside the logits' own


def cfg_of(*sets, kappa=True):
    return load_config("configs/tiny.yaml", ["model.first_dense=0", f"model.kappa.enabled={str(kappa).lower()}",
                                             f"model.moe.z_loss={Z}", *sets])


def router_of(cfg):
    tconfig = transformer_config(cfg)
    torch.manual_seed(0)
    layer = layer_specs(cfg.model, cfg.precision, model_layout(cfg)).layer_specs[0].submodules.mlp(config=tconfig)
    layer.set_layer_number(1)  # the metrics tracker records per layer
    return layer.router.train()


def z_reference(logits: torch.Tensor, form: str) -> torch.Tensor:
    """Mean over tokens, in float64, token by token as the formulas read."""
    values = []
    for row in logits.double():
        if form == "authors":
            mean = row.sum() / row.numel()
            values.append(torch.log(torch.exp(row - mean).sum()) ** 2 + mean ** 2)
        else:
            values.append(torch.log(torch.exp(row).sum()) ** 2)
    return torch.stack(values).mean()


def z_loss_gradients(router, x):
    """x's and the router weight's gradients of sum(logits) with the z-loss attached (scale 1), and
    the z-loss the router recorded."""
    get_moe_metrics_tracker().clear()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    x = x.clone().requires_grad_(True)
    router.weight.grad = None
    logits = router.gating(x).view(-1, router.config.num_moe_experts)
    router.apply_z_loss(logits).sum().backward()
    recorded = get_moe_metrics_tracker().metrics["z_loss"].values.sum().item()
    return x.grad, router.weight.grad, recorded


@pytest.mark.parametrize("kappa", [True, False])
@pytest.mark.parametrize("form,scale", [("authors", 0.1), ("megatron", 0.1), ("authors", 1.0)])
def test_z_loss_value_and_gradients_against_float64(world1, kappa, form, scale):
    cfg = cfg_of(f"model.moe.z_loss_form={form}", f"model.moe.z_loss_input_grad_scale={scale}", kappa=kappa)
    router = router_of(cfg)
    assert isinstance(router, ZLossRouter)
    x = torch.randn(16, 2, cfg.model.hidden_size, generator=torch.Generator().manual_seed(1)) * 3
    gx, gw, recorded = z_loss_gradients(router, x)

    xr = x.double().requires_grad_(True)
    w = router.weight.detach().double().requires_grad_(True)
    logits = (xr @ w.T).view(-1, w.shape[0])
    z = z_reference(logits, form)
    assert recorded == pytest.approx(z.item(), rel=1e-6)
    # the logits' own gradient whole; the z-loss's: whole into the weight, × scale into x
    (dx_sum, dw_sum) = torch.autograd.grad(logits.sum(), (xr, w), retain_graph=True)
    (dx_z, dw_z) = torch.autograd.grad(Z * z, (xr, w))
    torch.testing.assert_close(gx.double(), dx_sum + scale * dx_z, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw.double(), dw_sum + dw_z, rtol=1e-5, atol=1e-7)
    # negative controls: the other form's value, and the unscaled input gradient, are far off
    other = z_reference(logits.detach(), "megatron" if form == "authors" else "authors")
    assert abs(other.item() - recorded) > 0.01 * recorded
    if scale != 1.0:
        assert (gx.double() - (dx_sum + dx_z)).abs().max() > 1e-3 * dx_z.abs().max()


def test_default_router_is_megatron_own(world1):
    """Without the authors' losses the top-k router stays megatron-core's TopKRouter."""
    from megatron.core.transformer.moe.router import TopKRouter
    router = router_of(cfg_of(kappa=False))
    assert type(router) is TopKRouter


def test_aux_loss_counts_topk_assignments_per_token():
    """aux_loss_form authors: E·Σ_e P_e·f_e with Σf = topk, which is topk × megatron-core's Switch
    loss (Σf = 1), computed by megatron's own function with the coefficient the config hands it."""
    cfg = cfg_of("model.moe.aux_loss_form=authors", "model.moe.aux_loss=1e-3")
    E, k = cfg.model.moe.num_experts, cfg.model.moe.topk
    assert transformer_config(cfg).moe_aux_loss_coeff == pytest.approx(k * 1e-3)
    assert transformer_config(cfg_of("model.moe.aux_loss=1e-3")).moe_aux_loss_coeff == pytest.approx(1e-3)
    gen = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(64, E, generator=gen, dtype=torch.float64), dim=-1)
    top = probs.topk(k, dim=-1).indices
    counts = torch.zeros(E, dtype=torch.float64).index_add_(0, top.flatten(), torch.ones(top.numel(),
                                                                                         dtype=torch.float64))
    ours = switch_load_balancing_loss_func(probs, counts, 64, k, E, transformer_config(cfg).moe_aux_loss_coeff)
    f = counts / 64  # per token: Σf = k (the authors' tokens_per_expert)
    P = probs.mean(dim=0)
    authors = 1e-3 * E * (P * f).sum()
    assert f.sum().item() == pytest.approx(k)
    assert ours.item() == pytest.approx(authors.item(), rel=1e-12)
    megatron = switch_load_balancing_loss_func(probs, counts, 64, k, E, 1e-3)  # negative control
    assert megatron.item() == pytest.approx(authors.item() / k, rel=1e-12)


def test_aux_loss_weight_anneals_from_twice():
    cfg = cfg_of("model.moe.aux_loss_warmup_scale=2.0", "model.moe.aux_loss_warmup_steps=500")
    assert [recipe.aux_loss_scale(s, cfg.model.moe) for s in (0, 100, 250, 500, 501, 10000)] == \
        pytest.approx([2.0, 1.8, 1.5, 1.0, 1.0, 1.0])
    assert recipe.aux_loss_scale(0, cfg_of().model.moe) == 1.0  # the default: constant


def test_the_anneal_reaches_every_router_and_training_uses_it(world1, tmp_path):
    """megatron's routers read the coefficient from the model's one TransformerConfig at each
    forward: the loop's per-step weight reaches every MoE layer, and the logged aux loss (weighted by
    that coefficient) follows the anneal in a short training run (negative control: no anneal)."""
    from megatron_kappa.model.build import build_model
    from megatron_kappa.train.loop import run
    cfg = cfg_of("model.moe.aux_loss_form=authors")
    model = build_model(cfg, "cpu")
    recipe.set_aux_loss_weight(model, 0.123)
    routers = [m for m in model.modules() if isinstance(m, ZLossRouter)]
    assert routers and all(r.config.moe_aux_loss_coeff == 0.123 for r in routers)
    sets = ["data.mock=true", "train.steps=4", "log.interval=1", "checkpoint.interval=100", "eval.valid_every=0",
            "model.seq_length=32", "train.micro_batch=2", "train.global_batch=2", "log.tensorboard=false",
            "model.moe.aux_loss=1e-2", "train.lr=0", "train.lr_non_matrix=0", "model.kappa.lr=0",
            "model.kappa.lr_end=0"]  # every learning rate 0: the same weights, so the same routing, each step
    aux = {}
    for name, warm in (("anneal", ["model.moe.aux_loss_warmup_scale=3.0", "model.moe.aux_loss_warmup_steps=2"]),
                       ("constant", [])):
        last = run(cfg_of(*sets, *warm, f"run.dir={tmp_path / name}"), log=lambda *a: None)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        aux[name] = [json.loads(line)["aux_loss"] for line in lines]
        assert last["step"] == 4
    ratios = [a / c for a, c in zip(aux["anneal"], aux["constant"])]
    assert ratios == pytest.approx([3.0, 2.0, 1.0, 1.0], rel=1e-5)


def test_router_dtype_params_and_the_checks():
    assert transformer_config(cfg_of()).moe_router_dtype == "fp32"
    assert transformer_config(cfg_of("model.moe.router_dtype=params")).moe_router_dtype is None
    with pytest.raises(ConfigError, match="model.moe.z_loss_form: sets the top-k routers' losses; the softmoe"):
        cfg_of("model.moe.router=softmoe", "model.moe.z_loss_form=authors")
    with pytest.raises(ConfigError, match="model.moe.z_loss_input_grad_scale: must not be negative"):
        cfg_of("model.moe.z_loss_input_grad_scale=-1")


def test_the_study_applies_kappa_set_to_the_kappa_variants_only():
    """14c9b04's κ arm trained with aux_loss 5e-4 and its baseline with 1e-3: --kappa-set."""
    from megatron_kappa.cli.study import VARIANTS, parse_args, variant_sets
    args = parse_args(["--config", "configs/tiny.yaml", "--dir", "x", "--set", "train.steps=4",
                       "--kappa-set", "model.moe.aux_loss=5e-4"])
    assert variant_sets(args, "swiglu") == ["train.steps=4"]
    for variant in set(VARIANTS) - {"swiglu"}:
        assert variant_sets(args, variant) == ["train.steps=4", "model.moe.aux_loss=5e-4"], variant
