"""zero.offload_optimizer: DeepSpeed's ZeRO-Offload (the fp32 master copy and the optimizer state in
CPU memory, the step on the CPU) with this project's torch optimizer. On this CPU-only machine the
memory is the same either way; what is checked is that DeepSpeed runs the offload path, that its
steps equal the default path's and that a resumed offload run continues exactly."""
import json

import pytest
import torch

from megatron_kappa.config import load_config
from megatron_kappa.parallel import engine
from megatron_kappa.parallel.groups import current_device

BASE = ["data.mock=true", "log.tensorboard=false", "eval.valid_every=0", "precision=bf16", "log.interval=1",
        "checkpoint.interval=2"]


def test_the_deepspeed_config_asks_for_it():
    def ds_config(*sets):
        cfg = load_config("configs/tiny.yaml", list(sets))
        return engine.ds_config(engine.EngineSettings.of(cfg.train, cfg.zero, cfg.parallel, cfg.precision), 1)
    on, off = ds_config("zero.offload_optimizer=true"), ds_config()
    assert on["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert "offload_optimizer" not in off["zero_optimization"]
    assert on["zero_force_ds_cpu_optimizer"] is False  # the configured torch optimizer, not DeepSpeed's C++ Adam


@pytest.mark.slow
def test_offloaded_steps_equal_the_default_and_resume_exactly(world1, tmp_path, monkeypatch):
    from megatron_kappa.model.build import build_model
    from megatron_kappa.train.loop import run
    torch.manual_seed(3)
    init = tmp_path / "init.pt"
    torch.save({k: v for k, v in build_model(load_config("configs/tiny.yaml", BASE),
                                             current_device()).state_dict().items()
                if not k.endswith("_extra_state")}, init)
    started = []
    original = engine.initialize

    def recorded(*args, **kwargs):
        started.append(original(*args, **kwargs))
        return started[-1]
    monkeypatch.setattr(engine, "initialize", recorded)

    def losses(run_dir, steps, offload):
        cfg = load_config("configs/tiny.yaml", BASE + [f"run.dir={run_dir}", f"train.steps={steps}",
                                                       f"zero.offload_optimizer={offload}",
                                                       f"train.init_weights={init}",
                                                       "train.allow_schedule_change=true"])  # resumed 2 → 4
        run(cfg, log=lambda *a, **k: None)
        return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    default = losses(tmp_path / "default", 4, "false")
    assert started[-1][1].cpu_offload is False  # negative control: DeepSpeed's own flag for the path
    offloaded = losses(tmp_path / "offloaded", 4, "true")
    assert started[-1][1].cpu_offload is True
    assert offloaded == default  # the same math, bit for bit
    losses(tmp_path / "resumed", 2, "true")
    assert losses(tmp_path / "resumed", 4, "true") == default
    # the checkpoint holds parameter-shaped optimizer state: offload may be turned on at a resume
    losses(tmp_path / "switched", 2, "false")
    assert losses(tmp_path / "switched", 4, "true") == default


@pytest.mark.slow
def test_offload_with_pipeline_stages_equals_the_default_and_resumes(tmp_path):
    """PP2 (2 processes): the offloaded steps equal the default path's bit for bit, losses and
    gradient norms (the stages' norm, megatron_kappa.parallel.stage_norm, reads the norms DeepSpeed
    records on its way to the CPU, summed in fp64 as DeepSpeed does); DeepSpeed's own flag says which
    path ran (the control); a resume from step 1 continues exactly."""
    import shutil

    from tests.support.pipeline_runs import launch
    from tests.support.processes import records
    sets = ["data.mock=true", "log.tensorboard=false", "eval.valid_every=0", "precision=bf16", "log.interval=1",
            "train.steps=3", "parallel.pp=2", "train.grad_clip=0.05", "checkpoint.interval=1", "checkpoint.keep=3"]
    out = launch(tmp_path, [{"overrides": sets + [f"run.dir={tmp_path / 'default'}"], "report_offload": True},
                            {"overrides": sets + [f"run.dir={tmp_path / 'offload'}", "zero.offload_optimizer=true"],
                             "report_offload": True}], 2)
    assert out.count("== cpu_offload False") == 2 and out.count("== cpu_offload True") == 2  # each rank, each run
    default, offload = records(tmp_path / "default"), records(tmp_path / "offload")
    assert [r["step"] for r in offload] == [1, 2, 3]
    assert [(r["loss"], r["grad_norm"]) for r in offload] == [(r["loss"], r["grad_norm"]) for r in default]
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "offload", resumed)
    for step in (2, 3):
        shutil.rmtree(resumed / f"checkpoints/step_{step}")
    launch(tmp_path, [{"overrides": sets + [f"run.dir={resumed}", "zero.offload_optimizer=true"]}], 2)
    assert [(r["step"], r["loss"]) for r in records(resumed)] == [(r["step"], r["loss"]) for r in offload]


def test_the_planner_counts_it_and_does_not_call_it_planned_only():
    from megatron_kappa import plan as planner
    from megatron_kappa.plan import Layout
    cfg = load_config("configs/tiny.yaml", ["precision=bf16", "zero.offload_optimizer=true"])
    on = planner.plan(cfg, Layout(2), gpu_mem_gib=80).most_loaded
    off = planner.plan(load_config("configs/tiny.yaml", ["precision=bf16"]), Layout(2), gpu_mem_gib=80).most_loaded
    assert on.bytes["master"] == on.bytes["moments"] == 0
    assert on.cpu_bytes == off.bytes["master"] + off.bytes["moments"] > 0
    assert planner.plan(cfg, Layout(2), gpu_mem_gib=80).planned_only == []
