"""The router registry (megatron_kappa.routers): a router kind added at run time trains through the
unchanged training loop, and the registry stays torch-free and points at code that exists."""
import dataclasses
import json
from functools import partial
from pathlib import Path

import pytest
from megatron.core.transformer.moe.router import TopKRouter

from megatron_kappa import routers
from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.model.moe import KappaRouter
from tests.support.bare_python import run_bare

ROOT = Path(__file__).resolve().parents[1]
TEMPERATURE = 0.5
STEPS, MICRO_BATCHES, MOE_LAYERS = 2, 2, 3  # configs/tiny.yaml: 4 layers, the first dense
TRAIN = [f"train.steps={STEPS}", "log.interval=1", "data.mock=true", "model.seq_length=32",
         "train.micro_batch=2", f"train.global_batch={2 * MICRO_BATCHES}", "eval.valid_every=0",
         "checkpoint.interval=100", "log.tensorboard=false"]


class TemperedRouter(TopKRouter):
    """Softmax top-k of logits / T (megatron's TopKRouter otherwise); counts its forwards."""
    forwards = 0

    def __init__(self, *args, temperature: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.temperature = temperature

    def gating(self, input):
        return super().gating(input) / self.temperature

    def forward(self, input, padding_mask=None):
        TemperedRouter.forwards += 1
        return super().forward(input, padding_mask)


class KappaTemperedRouter(KappaRouter, TemperedRouter):
    """The same, handing on the (tempered) logit to κ experts."""


@pytest.fixture
def softmax_t():
    """`model.moe.router: softmax_t`, registered for the test: softmax's megatron settings and MoE
    layer, the tempered router, an after-step hook and a metric that count."""
    seen = {"after_step": [], "models": []}

    def router(moe, kappa):
        if kappa is None:
            return partial(TemperedRouter, temperature=TEMPERATURE)
        return partial(KappaTemperedRouter, temperature=TEMPERATURE, kappa=kappa)

    def after_step(model, moe):
        seen["after_step"].append(moe.router)
        seen["models"].append(model)

    softmax = routers.lookup("softmax")
    TemperedRouter.forwards = 0
    routers.register("softmax_t", dataclasses.replace(
        softmax, help="softmax_t: softmax top-k of logits / T", router=router, after_step=after_step,
        metrics=lambda model, device: {"softmax_t/forwards": TemperedRouter.forwards}))
    yield seen
    routers.unregister("softmax_t")


def test_a_router_registered_at_run_time_trains(world1, tmp_path, softmax_t):
    from megatron_kappa.train.loop import run
    cfg = load_config("configs/tiny.yaml", TRAIN + [f"run.dir={tmp_path}", "model.moe.router=softmax_t"])
    assert cfg.model.moe.active_experts == cfg.model.moe.topk  # the default rule
    run(cfg, log=lambda *a: None)

    # its router ran in every MoE layer of every micro-batch, and nothing else routed
    assert TemperedRouter.forwards == STEPS * MICRO_BATCHES * MOE_LAYERS
    assert softmax_t["after_step"] == ["softmax_t"] * STEPS
    model = softmax_t["models"][0]
    kinds = [type(layer.mlp.router) for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    assert kinds == [KappaTemperedRouter] * MOE_LAYERS
    assert model.config.moe_router_score_function == "softmax"  # its megatron settings: softmax's
    assert model.config.moe_aux_loss_coeff == cfg.model.moe.aux_loss
    router = model.decoder.layers[1].mlp.router
    x = router.weight.new_ones(3, router.weight.shape[1])
    assert (router.gating(x) - x @ router.weight.T / TEMPERATURE).abs().max() < 1e-6  # T is in the path

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["softmax_t/forwards"] for r in records] == [MICRO_BATCHES * MOE_LAYERS * (i + 1) for i in range(STEPS)]
    assert all(r["aux_loss"] > 0 for r in records)  # softmax's balancing loss, from megatron's settings


@pytest.mark.parametrize("hook", [True, False])
def test_the_sigmoid_routers_after_step_moves_the_expert_bias(world1, tmp_path, hook):
    """sigmoid's after-step hook, run by the loop: each router's expert bias leaves 0 (it is
    megatron_kappa.parallel.grads.update_expert_bias). Negative control: without the hook it stays."""
    sigmoid, models = routers.lookup("sigmoid"), []

    def after_step(model, moe):
        models.append(model)
        if hook:
            sigmoid.after_step(model, moe)
    routers.register("sigmoid_probe", dataclasses.replace(sigmoid, after_step=after_step))
    try:
        from megatron_kappa.train.loop import run
        run(load_config("configs/tiny.yaml", TRAIN + [f"run.dir={tmp_path}", "model.moe.router=sigmoid_probe"]),
            log=lambda *a: None)
    finally:
        routers.unregister("sigmoid_probe")
    biases = [layer.mlp.router.expert_bias for layer in models[-1].decoder.layers if hasattr(layer.mlp, "router")]
    assert len(models) == STEPS and len(biases) == MOE_LAYERS
    assert all((b.abs().sum() > 0) == hook for b in biases), biases


def test_an_unregistered_router_is_refused_naming_the_registered_ones(softmax_t):
    load_config(None, ["model.moe.router=softmax_t"])
    routers.unregister("softmax_t")
    with pytest.raises(ConfigError, match=r"model\.moe\.router: expected one of \['softmax', 'sigmoid', "
                                          r"'softmoe'\], got 'softmax_t'"):
        load_config(None, ["model.moe.router=softmax_t"])
    with pytest.raises(ValueError, match="already registered"):
        routers.register("softmoe", routers.lookup("softmax"))


def test_the_callers_queries_follow_the_registry(softmax_t):
    """A kind that is not top-k and drops no tokens is named in the sorted dispatcher's and
    eval.capacity_factor's errors, and refused by pipeline stages and the planner when it says so."""
    from megatron_kappa.plan import Layout, check
    routers.unregister("softmax_t")
    routers.register("softmax_t", dataclasses.replace(routers.lookup("softmax"), help="softmax_t", topk=False,
                                                      capacity=False, pipeline_refusal="cannot be split",
                                                      planned=False))
    for sets, message in [(["model.moe.dispatcher=sorted"], "no softmoe or softmax_t router"),
                          (["eval.capacity_factor=3.0"], "the softmoe or softmax_t router or the sorted")]:
        with pytest.raises(ConfigError, match=message):
            load_config("configs/tiny.yaml", ["model.moe.router=softmax_t", *sets])
    with pytest.raises(ConfigError, match="model.moe.router: softmax_t cannot be split; use parallel.pp 1"):
        load_config("configs/tiny.yaml", ["model.moe.router=softmax_t", "parallel.pp=2"])
    cfg = load_config("configs/tiny.yaml", ["model.moe.router=softmax_t"])
    with pytest.raises(ConfigError, match="softmax_t is not modelled by the planner"):
        check(cfg, Layout(2))


def test_every_built_in_piece_is_handed_over_by_its_module():
    """The built-in routers' entries leave their torch pieces to one module each
    (megatron_kappa/model/routers/<name>.py), which imports the registry, never the other way:
    importing that package hands every one over, each by its own router's module (a moved or
    missing piece fails here, not in a training run). Negative controls: a piece nobody handed
    over says so in one line, and a module cannot hand over what its entry does not leave to it."""
    import megatron_kappa.model.routers  # noqa: F401 (the import hands the pieces over: what is tested)
    handed = {name: routers.given(routers.lookup(name)) for name in ("softmax", "sigmoid", "softmoe")}
    assert {name: sorted(pieces) for name, pieces in handed.items()} == {
        "softmax": ["layer", "router"], "sigmoid": ["after_step", "layer", "router"],
        "softmoe": ["layer", "metrics", "router"]}
    for name, pieces in handed.items():
        for piece, fn in pieces.items():
            assert callable(fn) and fn.__module__ in ("megatron_kappa.model.routers." + name,
                                                      "megatron_kappa.model.routers.softmax"), (name, piece, fn)
    with pytest.raises(RuntimeError, match=r"^model\.moe\.router: softmax: its after_step comes from "
                                           r"model/routers/softmax\.py, which is not imported yet"):
        routers.ROUTERS.piece("softmax", "after_step")(None, None)
    with pytest.raises(ValueError, match="softmax: after_step is not a piece its entry leaves to its module"):
        routers.implement("softmax", after_step=print)


def test_the_registry_and_the_config_import_no_torch():
    code = ("import sys; import plan; from megatron_kappa import routers; from megatron_kappa.config import "
            "load_config; "
            "from megatron_kappa.config.world import check_world; "
            "cfg = load_config(None, ['model.moe.router=softmoe']); check_world(cfg.parallel, 1); "
            "print('TORCH', 'torch' in sys.modules, cfg.model.moe.active_experts)")
    done = run_bare(code)
    assert "TORCH False 2" in done.stdout, done.stdout + done.stderr


def test_a_toy_router_is_one_registration_that_trains_and_the_export_refuses(world1, tmp_path, capsys):
    """A router added by one register(...) call that gives only its own pieces validates, builds
    (its router in every MoE layer) and trains 2 steps; the export refuses the run in one line that
    names model.moe.router (its entry names no Hugging Face score function: it would otherwise be
    exported as a router it is not). Negative control: the built-in softmax's run exports."""
    from megatron_kappa.export.__main__ import main as export
    from megatron_kappa.train.loop import run
    softmax = routers.lookup("softmax")
    runs = {}
    routers.register("toy", routers.Router(
        help="toy: softmax top-k of logits / T", megatron=softmax.megatron, layer=softmax.layer,
        router=lambda cfg, kappa: partial(KappaTemperedRouter, temperature=TEMPERATURE, kappa=kappa)))
    try:
        for name in ("toy", "softmax"):
            runs[name] = tmp_path / name
            cfg = load_config("configs/tiny.yaml", TRAIN + [f"run.dir={runs[name]}", f"model.moe.router={name}",
                                                            "checkpoint.interval=2"])
            TemperedRouter.forwards = 0
            run(cfg, log=lambda *a: None)
            assert TemperedRouter.forwards == (STEPS * MICRO_BATCHES * MOE_LAYERS if name == "toy" else 0)
        capsys.readouterr()
        assert export(["--checkpoint", str(runs["toy"]), "--output", str(tmp_path / "hf"), "--no-progress"]) == 2
        assert capsys.readouterr().err == (
            "error: model.moe.router: toy: no exported model computes this router (its registry entry names no "
            "Hugging Face score function, hf_score); export a run of a built-in top-k router\n")
        assert not (tmp_path / "hf").exists()
    finally:
        routers.unregister("toy")
    assert export(["--checkpoint", str(runs["softmax"]), "--output", str(tmp_path / "hf"), "--no-progress"]) == 0
    assert "kappa_moe from step 2" in capsys.readouterr().out
