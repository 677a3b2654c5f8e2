"""κ's α optimizer (model.kappa.alpha_optimizer): adamw, κ's group (the paper's prose, 02b8de3), or
matrix, where 14c9b04 (askerlee/kappa-swiglu at the paper's date) trained it.

At 14c9b04 α (`mlp.experts.kappa_scale`, [E, F]) is 2-D and only names starting with
`mlp.experts.kappa_bias` go to κ's group (nanochat/gpt.py 2302-2303, 2311-2316), so α is one matrix
of the MoE block's Aurora groups (gpt.py 2396-2404): momentum 0.95, Nesterov, 5 Newton–Schulz steps,
2 row-equilibration rounds with exponent 0.5, lr matrix_lr × batch scale × the main multiplier
(base_train.py 886, 1811-1814), step scale 0.2·√max(E, F) capped at 1 (optim.py 181, 305-311) and
plain decoupled weight decay (optim.py 163). The reference (tests/support/optim_reference.py)
re-states that step in float64 from optim.py 78-134 and 161-164; it calls nothing of the project.
"""
import json
import math

import pytest
import torch

from megatron_kappa.config import load_config
from megatron_kappa.parallel.groups import current_device
from tests.support.optim_reference import authors_aurora_direction, authors_scale

D = torch.float64
ALPHA = "decoder.layers.*.mlp.experts.kappa_alpha"
TINY = ["data.mock=true", "model.seq_length=16", "train.micro_batch=2", "train.global_batch=4",
        "train.grad_clip=0", "train.optimizer=aurora", "train.warmup=1", "model.moe.aux_loss=1e-2",
        "model.num_query_groups=2", "log.tensorboard=false"]


def authors_step(W: torch.Tensor, grad: torch.Tensor, lr: float, wd: float, capped: bool = True):
    """aurora_step_fused (optim.py 161-164): W·(1 − lr·wd) − lr·scale·direction."""
    return W * (1 - lr * wd) - lr * authors_scale(W.shape, capped) * authors_aurora_direction(grad)


# ---- where α goes -------------------------------------------------------------------------------
def cli_rows(capsys, config, *sets):
    from megatron_kappa.optim.__main__ import main
    assert main(["--config", config, "--json", *(["--set", *sets] if sets else [])]) == 0
    out = capsys.readouterr().out
    return {r["group"]: r for r in json.loads(out[out.index("[\n"):])}


def test_optim_listing_shows_alpha_where_14c9b04_put_it(capsys):
    """configs/moe8.yaml: α in the Aurora matrix group at its lr 0.01 × √(2^18 / 2^19) and weight
    decay 0.05 × (12/8)²; `--set model.kappa.alpha_optimizer=adamw` puts it back in κ's group."""
    rows = cli_rows(capsys, "configs/moe8.yaml")
    assert ALPHA in rows["matrix"]["names"] and rows["matrix"]["optimizer"] == "aurora"
    assert ALPHA not in rows["kappa"]["names"] and rows["kappa"]["names"] == ["decoder.layers.*.mlp.experts.kappa_bias"]
    assert rows["matrix"]["lr"] == pytest.approx(0.01 * math.sqrt(0.5))
    assert rows["matrix"]["weight_decay"] == pytest.approx(0.05 * 2.25)
    prose = cli_rows(capsys, "configs/moe8.yaml", "model.kappa.alpha_optimizer=adamw")
    assert ALPHA in prose["kappa"]["names"] and ALPHA not in prose["matrix"]["names"]
    assert prose["kappa"]["lr"] == pytest.approx(0.12 * math.sqrt(0.5))  # the 0.085 of κ's AdamW
    alpha = 6 * 64 * 3072  # 6 MoE layers × [64, 3072]: nothing else moved
    assert (rows["matrix"]["params"] - prose["matrix"]["params"]
            == prose["kappa"]["params"] - rows["kappa"]["params"] == alpha)
    assert load_config("configs/tiny.yaml").model.kappa.alpha_optimizer == "adamw"  # tiny, demo unchanged


def names_by_group(cfg):
    from megatron_kappa.model.build import build_model
    from megatron_kappa.optim import optimizer as optim
    model = build_model(cfg, meta=True)
    names = {id(p): n for n, p in model.named_parameters()}
    return {g["name"]: {names[id(p)] for p in g["params"]} for g in optim.param_groups(model, cfg.train, cfg.model)}


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "aurora"])
def test_matrix_puts_alpha_with_the_matrices_of_every_optimizer(world1, optimizer):
    """14c9b04 sends every ≥2-D block tensor but b to the matrix group whatever trains it; under
    train.optimizer adamw that is the AdamW matrix group (train.lr, train.weight_decay). b stays
    in κ's group; adamw (the default) keeps α there too."""
    sets = [f"train.optimizer={optimizer}", "train.grad_clip=0"]
    matrix = names_by_group(load_config("configs/tiny.yaml", sets + ["model.kappa.alpha_optimizer=matrix"]))
    plain = names_by_group(load_config("configs/tiny.yaml", sets))
    alphas = {n for n in plain["kappa"] if n.endswith("kappa_alpha")}
    assert len(alphas) == 3  # tiny: 3 MoE layers
    assert alphas <= matrix["matrix"] and not alphas & matrix["kappa"]
    assert matrix["kappa"] == plain["kappa"] - alphas and all(n.endswith("kappa_bias") for n in matrix["kappa"])
    assert matrix["matrix"] - alphas == plain["matrix"]


# ---- one step on α against 14c9b04's formula ----------------------------------------------------
def zero_step(cfg, lr: float):
    """One DeepSpeed ZeRO-1 step of the tiny model (update_fn in float64) from α set to random
    values; every group at `lr` but the AdamW ones, which stay at 0. Returns (α before, α's
    fp32 gradient, α after) per MoE layer, as float64."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_kappa.model.build import build_model
    from megatron_kappa.optim import muon
    from megatron_kappa.optim import optimizer as optim
    from megatron_kappa.parallel import engine as ds_engine
    from megatron_kappa.train.loop import lm_loss
    torch.manual_seed(0)
    model, twin = build_model(cfg, current_device()), build_model(cfg, current_device())
    g = torch.Generator().manual_seed(2)
    alphas = [n for n, _ in model.named_parameters() if n.endswith("kappa_alpha")]
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("kappa_alpha"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    engine_settings = ds_engine.EngineSettings.of(cfg.train, cfg.zero, cfg.parallel, cfg.precision)
    engine, opt = ds_engine.initialize(model, optim.param_groups(model, cfg.train, cfg.model), engine_settings, 1,
                                       lambda groups: optim.build_optimizer(groups, cfg.train))
    muon.install(muon.update_fn(cfg.train, D))
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    for group in opt.param_groups:
        group["lr"] = lr if group["kind"] in ("matrix", "kappa") else 0.0
    pos = torch.arange(16).expand(2, -1)
    tokens = torch.randint(0, 2048, (2, 17), generator=g)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 16)}
    try:
        before = {n: p.detach().to(D).clone() for n, p in model.named_parameters() if n in alphas}
        twin.load_state_dict(model.state_dict())
        lm_loss(twin, batch, pos).backward()
        grads = {n: p.grad.to(D) for n, p in twin.named_parameters() if n in alphas}
        engine.backward(lm_loss(engine, batch, pos))
        engine.step()
        after = {n: p.detach().to(D) for n, p in model.named_parameters() if n in alphas}
    finally:
        muon.uninstall()
    wd = {g["kind"]: g["weight_decay"] for g in opt.param_groups}["matrix"]
    return [(before[n], grads[n], after[n]) for n in alphas], wd


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_one_step_on_alpha_is_14c9b04s_aurora_step(world1):
    """alpha_optimizer matrix under aurora: α (tiny: [4, 256] per MoE layer, the cap binding: 0.2·√256
    = 3.2 → 1) moves as the authors' float64 Aurora step, within 1e-5 (ZeRO's fp32 momentum).
    Negative controls: the uncapped scale, α orthogonalised in two expert blocks (EP2's shards),
    and the adamw placement each miss it."""
    lr = 0.5
    cfg = load_config("configs/tiny.yaml", TINY + ["model.kappa.alpha_optimizer=matrix",
                                                  "model.kappa.freeze_fraction=0"])
    steps, wd = zero_step(cfg, lr)
    assert wd == pytest.approx(0.05) and len(steps) == 3
    for W0, grad, W1 in steps:
        assert W0.shape == (4, 256) and grad.abs().max() > 0
        want = authors_step(W0, grad, lr, wd)
        assert rel(W1 - W0, want - W0) < 1e-5
        assert rel(W1 - W0, authors_step(W0, grad, lr, wd, capped=False) - W0) > 0.3  # × 3.2 (decay alike)
        halves = torch.cat([authors_step(W0[:2], grad[:2], lr, wd), authors_step(W0[2:], grad[2:], lr, wd)])
        assert rel(W1 - W0, halves - W0) > 0.1  # EP2's shards orthogonalised alone: not the whole [E, F]
        # docs/optimizer.md quotes this gap of the directions (≈ 0.4 here)
        whole = authors_aurora_direction(grad)
        assert rel(torch.cat([authors_aurora_direction(grad[:2]), authors_aurora_direction(grad[2:])]), whole) > 0.3
    prose = load_config("configs/tiny.yaml", TINY + ["model.kappa.freeze_fraction=0"])
    for W0, grad, W1 in zero_step(prose, lr)[0]:  # κ's AdamW at the same lr: another update
        assert rel(W1 - W0, authors_step(W0, grad, lr, wd) - W0) > 0.5


# ---- the freeze ---------------------------------------------------------------------------------
def test_freeze_holds_alpha_at_exactly_zero_in_the_matrix_group(world1):
    """While frozen, α in the matrix group has the matrices' (nonzero) learning rate and weight
    decay, yet stays exactly 0 (its zeroed gradient: zero momentum, zero update), as at 14c9b04,
    where U = 1 makes α's gradient exactly zero; after the unfreeze it moves."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_kappa.model.build import build_model
    from megatron_kappa.model.experts import set_kappa_U
    from megatron_kappa.optim import muon, schedule
    from megatron_kappa.optim import optimizer as optim
    from megatron_kappa.parallel import engine as ds_engine
    from megatron_kappa.train import recipe
    from megatron_kappa.train.loop import lm_loss
    total = 6
    cfg = load_config("configs/tiny.yaml", TINY + ["model.kappa.alpha_optimizer=matrix", f"train.steps={total}",
                                                  "model.kappa.freeze_fraction=0.5"])
    torch.manual_seed(0)
    model = build_model(cfg, current_device())
    engine_settings = ds_engine.EngineSettings.of(cfg.train, cfg.zero, cfg.parallel, cfg.precision)
    engine, opt = ds_engine.initialize(model, optim.param_groups(model, cfg.train, cfg.model), engine_settings, 1,
                                       lambda groups: optim.build_optimizer(groups, cfg.train))
    freeze = recipe.KappaFreeze(model, total, cfg.model.kappa)
    assert freeze.start == 3
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    alphas = [p for n, p in model.named_parameters() if n.endswith("kappa_alpha")]
    qkv = next(p for n, p in model.named_parameters() if n.endswith("linear_qkv.weight"))
    pos, g = torch.arange(16).expand(2, -1), torch.Generator().manual_seed(3)
    try:
        for step in range(total):
            freeze.begin_step(step, opt)
            set_kappa_U(model, recipe.kappa_U(step, total, cfg.model.kappa))
            lrs = schedule.set_learning_rates(opt, step, total, cfg.train, cfg.model)
            tokens = torch.randint(0, 2048, (2, 17), generator=g)
            batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 16)}
            before = qkv.detach().clone()
            engine.backward(lm_loss(engine, batch, pos))
            engine.step()
            moved = max(p.detach().abs().max().item() for p in alphas)
            if step < freeze.start:
                assert lrs["matrix"] > 0 and not torch.equal(qkv.detach(), before)  # the matrices train
                assert moved == 0.0, step
            else:
                assert moved > 0, step
    finally:
        muon.uninstall()


def test_alpha_gradient_is_exactly_zero_at_U_1(world1):
    """The authors' mechanism: κ = U^tanh(·) with U = 1 is 1 whatever α is, so α's gradient is
    exactly zero (their U ramp holds U at 1 through the freeze); U = 3 gives a gradient (control)."""
    from megatron_kappa.model.build import build_model
    from megatron_kappa.model.experts import set_kappa_U
    from megatron_kappa.train.loop import lm_loss
    cfg = load_config("configs/tiny.yaml", TINY)
    torch.manual_seed(0)
    model = build_model(cfg, current_device())
    tokens = torch.randint(0, 2048, (2, 17), generator=torch.Generator().manual_seed(4))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 16)}
    for U, zero in ((1.0, True), (3.0, False)):
        model.zero_grad(set_to_none=True)
        set_kappa_U(model, U)
        lm_loss(model, batch, torch.arange(16).expand(2, -1)).backward()
        grads = [p.grad for n, p in model.named_parameters() if n.endswith("kappa_alpha")]
        assert all((gr.abs().max() == 0) == zero for gr in grads), U


# ---- the planner's bytes ------------------------------------------------------------------------
@pytest.mark.parametrize("world,ep", [(1, 1), (4, 2)])
def test_planner_counts_alpha_with_one_momentum_under_matrix(world1, world, ep):
    """plan.state_bytes: with alpha_optimizer matrix under aurora, α (its elements counted from the
    built model) leaves AdamW's two fp32 moments for the matrix optimizer's momentum and the copy
    DeepSpeed stages it in (plan.state.muon_momentum_bytes: both in the gradients' dtype, fp32 for
    tiny), partitioned over the expert-data-parallel ranks; b keeps two. (Before the staged copy was
    counted, α held one momentum: 4 bytes an element less than AdamW's two; now 2 × 4, as many.)
    Under train.optimizer adamw α's matrix group is AdamW's, so nothing changes (control)."""
    from megatron_kappa import plan as planner
    from megatron_kappa.plan.state import muon_momentum_bytes

    def moments(*sets):
        cfg = load_config("configs/tiny.yaml", TINY + [f"parallel.ep={ep}", *sets])
        layout = planner.layout_of(cfg.parallel, world)
        params = planner.stage_params(cfg, layout, 0)
        muon = muon_momentum_bytes(params, cfg.model, cfg.train, cfg.precision, layout)
        return planner.state_bytes(params, cfg, layout)["moments"], muon["committed"] + muon["staged"], layout
    from megatron_kappa.model.build import build_model
    alphas = sum(p.numel() for n, p in build_model(load_config("configs/tiny.yaml", TINY), meta=True).named_parameters()
                 if n.endswith("kappa_alpha"))
    assert alphas == 3 * 4 * 256  # tiny: 3 MoE layers × [4, 256]
    (adamw_place, muon_before, layout), (matrix, muon_after,
                                         _) = moments(), moments("model.kappa.alpha_optimizer=matrix")
    assert layout.edp == world // ep
    share = (alphas / ep) / layout.edp  # α's elements on the rank
    assert muon_after - muon_before == pytest.approx(2 * 4 * share)  # the momentum and its staged copy
    assert (adamw_place - muon_before) - (matrix - muon_after) == pytest.approx(8 * share)  # AdamW's two moments
    plain = ["train.optimizer=adamw", "train.grad_clip=1"]
    assert moments(*plain)[:2] == moments(*plain, "model.kappa.alpha_optimizer=matrix")[:2]
