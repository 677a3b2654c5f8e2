"""train.grad_accum_dtype (megatron_kappa.parallel.grad_precision): with bf16 parameters the
micro-batches' gradients are summed and reduced in fp32, and every update sees fp32.

- N micro-batches' gradients, accumulated and reduced by DeepSpeed (DP2 ZeRO-1/2, EP2, PP2;
  AdamW, Aurora and Muon), against the float64 sum of the gradients autograd handed over
  (tests/support/grad_accum_worker.py): within fp32 rounding; bf16 accumulation (the negative control)
  misses it by orders of magnitude, and under ZeRO-2 beside Muon groups DeepSpeed's own
  reduce-scatter merge (grad_precision item 4 left out: the control) loses AdamW gradients whole.
- Hooks on the update (the patched muon_update and torch AdamW's step): fp32 gradients and fp32
  state in every call; the ZeRO optimizer, not BF16_Optimizer, at ZeRO-1; bf16 accumulation is
  the control (Muon/Aurora then see a bf16 gradient and momentum).
"""
import collections
import json
import subprocess

import pytest
import torch

from megatron_kappa.config import load_config
from megatron_kappa.parallel import engine as ds_engine
from megatron_kappa.parallel import grad_precision
from megatron_kappa.parallel.groups import current_device
from tests.support.processes import ROOT, deepspeed_cmd, env, free_port


def test_upstream_names_exist():
    assert grad_precision.missing_upstream() == []


def test_the_deepspeed_config_asks_for_fp32():
    def entries(*sets):
        cfg = load_config("configs/tiny.yaml", list(sets))
        d = ds_engine.ds_config(ds_engine.EngineSettings.of(cfg.train, cfg.zero, cfg.parallel, cfg.precision), 1)
        return d.get("data_types"), d.get("communication_data_type")
    assert entries("precision=bf16") == ({"grad_accum_dtype": "fp32"}, "fp32")  # the default
    assert entries("precision=fp8") == ({"grad_accum_dtype": "fp32"}, "fp32")
    assert entries("precision=bf16", "train.grad_accum_dtype=bf16") == (None, None)  # DeepSpeed's bf16 default
    assert entries("precision=fp32") == (None, None)


def update_dtypes(method, zero, accum):
    """Dtypes each update call sees over two steps of two micro-batches, bf16 parameters."""
    from megatron_kappa.model.build import build_model
    from megatron_kappa.optim import muon
    from megatron_kappa.optim import optimizer as optim
    from megatron_kappa.train.loop import lm_loss
    cfg = load_config("configs/tiny.yaml", ["data.mock=true", "model.seq_length=16", "train.micro_batch=2",
                                            "train.global_batch=4", "train.grad_clip=0", f"train.optimizer={method}",
                                            f"zero.stage={zero}", "precision=bf16", f"train.grad_accum_dtype={accum}"])
    torch.manual_seed(0)
    model = build_model(cfg, current_device())
    engine_settings = ds_engine.EngineSettings.of(cfg.train, cfg.zero, cfg.parallel, cfg.precision)
    engine, zero_opt = ds_engine.initialize(model, optim.param_groups(model, cfg.train, cfg.model), engine_settings, 2,
                                            lambda groups: optim.build_optimizer(groups, cfg.train))
    seen = collections.Counter()
    update = None
    if method != "adamw":
        from deepspeed.runtime.zero.muon import original_muon
        update = original_muon.muon_update

        def spy(grad, momentum, *a, **k):
            seen[("muon", grad.dtype, momentum.dtype)] += 1
            return update(grad, momentum, *a, **k)
        muon.install(spy)
    adam_step = torch.optim.AdamW.step

    def step(self, *a, **k):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                seen[("adamw", p.dtype, p.grad.dtype, *(state[k].dtype for k in ("exp_avg", "exp_avg_sq")
                                                        if k in state))] += 1
        return adam_step(self, *a, **k)
    torch.optim.AdamW.step = step
    try:
        pos, g = torch.arange(16).expand(2, -1), torch.Generator().manual_seed(1)
        for _ in range(4):
            tokens = torch.randint(0, 2048, (2, 17), generator=g)
            engine.backward(lm_loss(engine, {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                                             "loss_mask": torch.ones(2, 16)}, pos))
            engine.step()
    finally:
        torch.optim.AdamW.step = adam_step
        muon.uninstall()
    return type(zero_opt).__name__, seen


@pytest.mark.parametrize("method,zero", [("aurora", 1), ("aurora", 2), ("muon", 2), ("adamw", 1), ("adamw", 2)])
def test_every_update_sees_fp32(world1, method, zero):
    name, seen = update_dtypes(method, zero, "fp32")
    assert name == "DeepSpeedZeroOptimizer"  # at ZeRO-1 too: DeepSpeed would pick BF16_Optimizer
    f32 = torch.float32
    muon_calls = {k: n for k, n in seen.items() if k[0] == "muon"}
    assert (muon_calls == {}) == (method == "adamw")
    assert all(k[1:] == (f32, f32) for k in muon_calls), seen  # gradient, momentum
    adamw = {k: n for k, n in seen.items() if k[0] == "adamw"}
    assert adamw and all(set(k[1:]) == {f32} for k in adamw), seen  # master weights, gradient, moments
    if method != "adamw":  # negative control: bf16 accumulation hands Muon/Aurora bf16
        _, control = update_dtypes(method, zero, "bf16")
        assert {k for k in control if k[0] == "muon"} == {("muon", torch.bfloat16, torch.bfloat16)}


BASE = ["data.mock=true", "log.tensorboard=false", "eval.valid_every=0", "precision=bf16", "train.steps=1",
        "model.seq_length=32", "train.micro_batch=1", "train.global_batch=8", "train.grad_clip=0",
        "checkpoint.interval=100"]
CASES = {"dp2 zero1 aurora": ["zero.stage=1", "train.optimizer=aurora"],
         "dp2 zero2 adamw": ["zero.stage=2", "train.optimizer=adamw"],
         "ep2 zero1 aurora": ["zero.stage=1", "train.optimizer=aurora", "parallel.ep=2"],
         "ep2 zero2 adamw": ["zero.stage=2", "train.optimizer=adamw", "parallel.ep=2"],
         "pp2 zero1 adamw": ["zero.stage=1", "train.optimizer=adamw", "parallel.pp=2"],
         "pp2 zero1 aurora": ["zero.stage=1", "train.optimizer=aurora", "parallel.pp=2"],
         "dp2 zero2 aurora": ["zero.stage=2", "train.optimizer=aurora"],
         "ep2 zero2 muon": ["zero.stage=2", "train.optimizer=muon", "parallel.ep=2"],
         # virtual stages (megatron's interleaved 1F1B) and fp8 (torchao's emulated GEMMs off CUDA)
         "pp2 vpp2 zero1 aurora": ["zero.stage=1", "train.optimizer=aurora", "parallel.pp=2", "parallel.vpp=2"],
         "ep2 zero1 adamw fp8": ["zero.stage=1", "train.optimizer=adamw", "parallel.ep=2", "precision=fp8"]}
CONTROLS = ("dp2 zero1 aurora", "dp2 zero2 adamw", "pp2 zero1 adamw", "pp2 vpp2 zero1 aurora",
            "ep2 zero1 adamw fp8")
MERGE_CONTROL = "dp2 zero2 aurora"  # also run without grad_precision's item 4 (DeepSpeed's merge)


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accum")
    keys = [(k, "fp32") for k in CASES] + [(k, "bf16") for k in CONTROLS] + [(MERGE_CONTROL, "upstream merge")]
    plan = [{"overrides": BASE + CASES[k] + [f"train.grad_accum_dtype={'bf16' if a == 'bf16' else 'fp32'}",
                                             f"run.dir={tmp / f'run{i}'}"], "merge_fix": a != "upstream merge"}
            for i, (k, a) in enumerate(keys)]
    (tmp / "plan.json").write_text(json.dumps(plan))
    proc = subprocess.run(deepspeed_cmd(ROOT / "tests/support/grad_accum_worker.py", str(tmp / "plan.json"),
                                        str(tmp / "out.json"), port=free_port()),
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(zip(keys, json.loads((tmp / "out.json").read_text())))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_accumulated_gradients_equal_the_float64_sum(accumulated, case):
    """8 micro-batches per step over 2 ranks: ‖got − ref‖/‖ref‖ per parameter, the largest. fp32
    sums of bf16 gradients: ~1e-8 seen; bf16 accumulation: ~4e-3 seen."""
    got = accumulated[(case, "fp32")]
    assert got["worst"] < 1e-6, got
    assert all(d[1:] in (["torch.float32"], ["torch.float32", "torch.float32"]) for d in got["dtypes"]), got
    if case in CONTROLS:  # negative control: bf16 accumulation misses the float64 sum
        assert accumulated[(case, "bf16")]["worst"] > 1e-4, accumulated[(case, "bf16")]
    if case == MERGE_CONTROL:  # negative control: DeepSpeed's own merge drops AdamW parameters' gradients
        assert accumulated[(case, "upstream merge")]["worst"] > 0.5, accumulated[(case, "upstream merge")]
