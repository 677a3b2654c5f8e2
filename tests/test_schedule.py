"""The main learning-rate and weight-decay schedules, the groups' peak values, the gradient-clip
default and `python -m megatron_kappa.optim` (megatron_kappa.optim.schedule, optimizer, recipe).

The reference for the authors' schedules is their code, copied verbatim below from
askerlee/kappa-swiglu 02b8de3, scripts/base_train.py (get_lr_multiplier, lines 976-988;
get_weight_decay, lines 1010-1011; the scalings, lines 915-926; gpt.py setup_optimizer's
dmodel_lr_scale)."""
import json
import math

import pytest
import torch

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.optim import optimizer as optim
from megatron_kappa.optim import schedule

PAPER = ["train.optimizer=aurora", "train.router_optimizer=matrix", "train.lr_non_matrix=0.3",
         "train.lr_embedding=0.3", "train.lr_output=0.004", "train.adamw_width_scaling=true",
         "train.batch_lr_scaling=true", "train.betas=[0.8,0.95]", "train.adam_eps=1e-10",
         "train.lr_decay_style=wsd", "train.lr_wsd_decay_fraction=0.5", "train.warmup=0",
         "train.min_lr_ratio=0", "train.wd_decay_style=linear", "train.wd_depth_scaling=true"]


def paper(*extra):
    return load_config("configs/tiny.yaml", PAPER + list(extra))


# ---- the authors' code, verbatim ----------------------------------------------------------------
def get_lr_multiplier(it, num_iterations, warmup_ratio, warmdown_ratio,
                      final_lr_frac, lr_schedule_restart_at_step=0, lr_base_scale=1.0):
    it = max(0, it - lr_schedule_restart_at_step)
    num_iterations = max(1, num_iterations - lr_schedule_restart_at_step)
    warmup_iters = round(warmup_ratio * num_iterations)
    warmdown_iters = round(warmdown_ratio * num_iterations)
    if it < warmup_iters:
        return lr_base_scale * (it + 1) / warmup_iters
    elif it <= num_iterations - warmdown_iters:
        return lr_base_scale * 1.0
    else:
        progress = (num_iterations - it) / warmdown_iters
        return lr_base_scale * (progress * 1.0 + (1 - progress) * final_lr_frac)


def get_weight_decay(base_weight_decay, it, num_iterations):
    return base_weight_decay * (1 - it / num_iterations)


def authors_dmodel_lr_scale(model_dim):  # gpt.py setup_optimizer (tests/authors_14c9b04/nanochat/gpt.py:2341)
    dmodel_lr_scale = (model_dim / 768) ** -0.5
    return dmodel_lr_scale


# ---- schedules ----------------------------------------------------------------------------------
@pytest.mark.parametrize("total", [7, 100, 1001])
def test_wsd_matches_the_authors_code_at_every_step(total):
    cfg = paper()
    for step in range(total):
        assert schedule.lr_multiplier(step, total, cfg.train) == pytest.approx(
            get_lr_multiplier(step, total, 0.0, 0.5, 0.0), abs=1e-15)
        assert schedule.wd_multiplier(step, total, cfg.train) == pytest.approx(
            get_weight_decay(1.0, step, total), abs=1e-15)


def test_schedules_at_hand_computed_steps():
    cfg = paper()  # 100 steps, decay over the last 50 to 0
    def lr(step, c=cfg):
        return schedule.lr_multiplier(step, 100, c.train)
    assert (lr(0), lr(50), lr(51), lr(75), lr(99)) == pytest.approx((1.0, 1.0, 0.98, 0.5, 0.02))
    assert schedule.lr_multiplier(75, 100, paper("train.min_lr_ratio=0.1").train) == pytest.approx(0.55)
    warm = paper("train.warmup=10")
    assert (lr(0, warm), lr(4, warm), lr(9, warm), lr(10, warm)) == pytest.approx((0.1, 0.5, 1.0, 1.0))
    assert schedule.wd_multiplier(25, 100, cfg.train) == pytest.approx(0.75)
    assert schedule.wd_multiplier(25, 100, paper("train.wd_decay_style=constant").train) == 1.0
    # cosine (the default): warmup 5 in tiny.yaml, min 0.1, 106 steps: the middle of the decay is 0.55
    cos = load_config("configs/tiny.yaml", [])
    assert schedule.lr_multiplier(5, 106, cos.train) == pytest.approx(1.0)
    assert schedule.lr_multiplier(55, 106, cos.train) == pytest.approx(0.55)
    assert schedule.lr_multiplier(105, 106, cos.train) == pytest.approx(0.1)
    assert schedule.main_lr(55, 2.0, 106, 5, 0.1) == pytest.approx(1.1)


def test_negative_control_other_schedules_miss_the_authors():
    """Cosine, or a 40 % decay, or warmup, differ from the authors' multiplier somewhere."""
    for extra in (["train.lr_decay_style=cosine"], ["train.lr_wsd_decay_fraction=0.4"], ["train.warmup=3"]):
        cfg = paper(*extra)
        gaps = [abs(schedule.lr_multiplier(s, 100, cfg.train) - get_lr_multiplier(s, 100, 0.0, 0.5, 0.0))
                for s in range(100)]
        assert max(gaps) > 0.05, extra


def test_peak_values_and_scalings():
    """tiny: d 64, 4 layers, 8 × 128 tokens per step."""
    cfg = paper()
    batch = math.sqrt(8 * 128 / 2 ** 19)  # 0.0441941...
    width = authors_dmodel_lr_scale(64)  # √12
    assert schedule.batch_scale(cfg.train, cfg.model) == pytest.approx(0.04419417382415922)
    assert schedule.width_scale(cfg.train, cfg.model) == pytest.approx(width, rel=1e-15)
    assert schedule.peak_lrs(cfg.train, cfg.model) == pytest.approx({
        "matrix": 0.01 * batch, "router": 3e-3 * batch, "embedding": 0.3 * width * batch,
        "output": 0.004 * width * batch, "non_matrix": 0.3 * width * batch,
        "resid_lambda": 0.005 * batch, "x0_lambda": 0.5 * batch})  # the λ: not width-scaled
    assert schedule.peak_weight_decays(cfg.train, cfg.model)["matrix"] == pytest.approx(0.05 * 9)  # (12/4)²
    lrs, wds = schedule.main_values(75, 100, cfg.train, cfg.model)
    assert lrs["output"] == pytest.approx(0.004 * width * batch * 0.5)
    assert wds["matrix"] == pytest.approx(0.45 * 0.25) and wds["embedding"] == 0.0
    # off: the plain values (the defaults keep today's behaviour)
    plain = load_config("configs/tiny.yaml", [])
    lambdas = {"resid_lambda": 0.005, "x0_lambda": 0.5}  # their own keys (model.residual_scalars)
    assert schedule.peak_lrs(plain.train, plain.model) == pytest.approx(
        {k: lambdas.get(k, 3e-3) for k in schedule.peak_lrs(plain.train, plain.model)})
    assert schedule.peak_weight_decays(plain.train, plain.model)["matrix"] == 0.05


@pytest.mark.parametrize("hidden", [64, 256, 768, 2048])
def test_the_width_scale_is_the_authors(hidden):
    cfg = paper(f"model.hidden_size={hidden}")
    assert schedule.width_scale(cfg.train, cfg.model) == pytest.approx(authors_dmodel_lr_scale(hidden), rel=1e-15)


def test_negative_control_the_width_scale_off_misses_the_authors():
    """train.adamw_width_scaling=false keeps the plain value, which the comparison above tells apart
    from the authors' at any width but theirs (768)."""
    for hidden in (64, 256, 2048):
        cfg = paper("train.adamw_width_scaling=false", f"model.hidden_size={hidden}")
        assert schedule.width_scale(cfg.train, cfg.model) == 1.0
        assert schedule.width_scale(cfg.train, cfg.model) != pytest.approx(authors_dmodel_lr_scale(hidden), rel=1e-3)


# ---- groups and set_learning_rates --------------------------------------------------------------
def groups_by_name(model, cfg):
    names = {id(p): n for n, p in model.named_parameters()}
    return {g["name"]: [names[id(p)] for p in g["params"]] for g in optim.param_groups(model, cfg.train, cfg.model)}


@pytest.mark.parametrize("router_optimizer", ["matrix", "adamw"])
def test_groups_and_per_step_values(world1, router_optimizer):
    from megatron_kappa.model.build import build_model
    cfg = paper(f"train.router_optimizer={router_optimizer}")
    model = build_model(cfg, torch.device("cpu"))
    groups = optim.param_groups(model, cfg.train, cfg.model)
    by_name = groups_by_name(model, cfg)
    every = sorted(n for names in by_name.values() for n in names)
    assert every == sorted(n for n, _ in model.named_parameters())  # each parameter once
    routers = [n for n, _ in model.named_parameters() if ".mlp.router." in n]
    assert routers and set(routers) <= set(by_name[{"matrix": "matrix", "adamw": "router"}[router_optimizer]])
    assert by_name["embedding"] == ["embedding.word_embeddings.weight"]
    assert by_name["output"] == ["output_layer.weight"]
    assert all(g["eps"] == 1e-10 and g["betas"] == (0.8, 0.95) for g in groups if not g["use_muon"])
    opt = torch.optim.SGD([dict(g, params=[torch.zeros(1)]) for g in groups if g["params"]], lr=0.0)
    lrs = schedule.set_learning_rates(opt, 75, 100, cfg.train, cfg.model)
    peak, wd = schedule.peak_lrs(cfg.train, cfg.model), schedule.peak_weight_decays(cfg.train, cfg.model)
    for g in opt.param_groups:
        if g["kind"] != "kappa":
            assert g["lr"] == pytest.approx(peak[g["kind"]] * 0.5) == lrs[g["kind"]]
        assert g["weight_decay"] == pytest.approx(wd[g["kind"]] * 0.25)
    assert {g["kind"] for g in opt.param_groups if g["weight_decay"] > 0} == (
        {"matrix"} if router_optimizer == "matrix" else {"matrix", "router"})


def test_adamw_groups_take_the_eps_and_width_scaling(world1):
    from megatron_kappa.model.build import build_model
    cfg = load_config("configs/tiny.yaml", ["train.adam_eps=1e-10", "train.lr_output=0.004",
                                            "train.adamw_width_scaling=true"])
    model = build_model(cfg, torch.device("cpu"))
    opt = optim.build_optimizer(optim.param_groups(model, cfg.train, cfg.model), cfg.train)
    assert all(g["eps"] == 1e-10 for g in opt.param_groups)
    schedule.set_learning_rates(opt, 5, 50, cfg.train, cfg.model)  # tiny: the peak after 5 warmup steps
    lr = {g["kind"]: g["lr"] for g in opt.param_groups}
    assert lr["output"] == pytest.approx(0.004 * 12 ** 0.5) and lr["matrix"] == pytest.approx(3e-3)
    assert lr["embedding"] == pytest.approx(3e-3 * 12 ** 0.5)


# ---- gradient clipping --------------------------------------------------------------------------
def test_grad_clip_default_by_optimizer():
    assert load_config("configs/tiny.yaml", []).train.clip == 1.0
    for method in ("muon", "aurora"):
        assert load_config("configs/tiny.yaml", [f"train.optimizer={method}"]).train.clip == 0.0
        assert load_config("configs/tiny.yaml", [f"train.optimizer={method}", "train.grad_clip=0"]).train.clip == 0
    assert load_config("configs/tiny.yaml", ["train.grad_clip=0.5"]).train.clip == 0.5
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", ["train.optimizer=aurora", "train.grad_clip=1.0"])
    assert "train.grad_clip: must be 0 or null with train.optimizer=aurora" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("setting,message", [
    (["train.lr_wsd_decay_fraction=0"], "train.lr_wsd_decay_fraction"),
    (["train.lr_decay_style=linear"], "train.lr_decay_style: expected one of"),
    (["train.lr_output=-1"], "train.lr_output"),
    (["train.adam_eps=-1"], "train.adam_eps"),
    (["train.router_optimizer=sgd"], "train.router_optimizer: expected one of")])
def test_schedule_config_errors(setting, message):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", setting)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_paper_configs_use_the_authors_recipe():
    cfg = load_config("configs/moe8.yaml", [])  # d 768 (width scale 1), 8 layers: wd × 2.25
    t = cfg.train
    assert (t.optimizer, t.router_optimizer, t.lr_decay_style, t.wd_decay_style, t.clip) == (
        "aurora", "matrix", "wsd", "linear", 0.0)
    b = math.sqrt(t.global_batch * 2048 / 2 ** 19)  # the authors' batch_lr_scale
    assert schedule.peak_lrs(cfg.train, cfg.model) == pytest.approx({"matrix": 0.01 * b, "router": 3e-4 * b,
                                                                     "embedding": 0.3 * b,
                                                    "output": 0.004 * b, "non_matrix": 0.3 * b,
                                                    "resid_lambda": 0.005 * b, "x0_lambda": 0.5 * b})
    assert schedule.peak_weight_decays(cfg.train, cfg.model)["matrix"] == pytest.approx(0.05 * 2.25)
    assert (t.betas, t.adam_eps, t.warmup, t.min_lr_ratio) == ([0.8, 0.95], 1e-10, 0, 0.0)


# ---- python -m megatron_kappa.optim ------------------------------------------------------------------------
def test_optim_cli_lists_the_optimizer_groups(capsys):
    from megatron_kappa.optim.__main__ import main
    assert main(["--config", "configs/tiny.yaml", "--json", "--set", *PAPER,
                 "train.steps=100"]) == 0
    out = capsys.readouterr().out
    rows = {r["group"]: r for r in json.loads(out[out.index("[\n"):])}
    cfg = paper("train.steps=100")
    peak = schedule.peak_lrs(cfg.train, cfg.model)
    assert set(rows) == {"matrix", "embedding", "output", "non_matrix", "kappa"}  # no router group
    assert rows["matrix"]["optimizer"] == "aurora" and "decoder.layers.*.mlp.router.weight" in rows["matrix"]["names"]
    for kind in ("matrix", "embedding", "output", "non_matrix"):
        assert rows[kind]["lr"] == pytest.approx(peak[kind])
    assert rows["matrix"]["weight_decay"] == pytest.approx(0.45)
    assert rows["output"]["names"] == ["output_layer.weight"] and rows["output"]["eps"] == 1e-10
    assert rows["kappa"]["lr"] == pytest.approx(max(schedule.kappa_lr(s, 100, cfg.train,
                                                                      cfg.model) for s in range(100)))
    from megatron_kappa.model.build import build_model  # the CLI set up the process group of one
    model = build_model(cfg, meta=True)
    assert sum(r["tensors"] for r in rows.values()) == len(list(model.parameters()))
    assert sum(r["params"] for r in rows.values()) == sum(p.numel() for p in model.parameters())
    # the table form names every group
    assert main(["--config", "configs/tiny.yaml"]) == 0
    table = capsys.readouterr().out
    assert all(f"\n{g:<11}" in table for g in ("matrix", "embedding", "output", "non_matrix"))
