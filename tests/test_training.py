"""Training under DeepSpeed: 1 vs 2 processes, kill -9 and resume, the κ recipe, failure modes."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_kappa.config import load_config
from megatron_kappa.model.layout import moe_layer_pattern
from megatron_kappa.optim import schedule
from megatron_kappa.parallel.groups import current_device
from megatron_kappa.train import recipe
from tests.support.compare import max_gap
from tests.support.processes import ROOT, deepspeed_cmd, env, free_port, losses, records
from tests.support.weights import save_init_weights

STEPS = 4
COMMON = [f"train.steps={STEPS}", "data.mock=true", "log.interval=1", "checkpoint.interval=100",
          "eval.valid_every=0", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=4",
          "train.grad_clip=0.05", "model.kappa.freeze_fraction=0.25", "model.kappa.warmup=2",
          "model.moe.aux_loss=1e-2", "log.tensorboard=false"]


@pytest.fixture(scope="module")
def init_weights(world1, tmp_path_factory):
    """Full-layout initial weights shared by every run (random init depends on the layout)."""
    tmp = tmp_path_factory.mktemp("init")
    return {kappa: save_init_weights(tmp / f"init_{kappa}.pt", COMMON + [f"model.kappa.enabled={str(kappa).lower()}"])
            for kappa in (True, False)}


def overrides(init_weights, run_dir, kappa, zero, ep=1, tp=1, precision="fp32"):
    return COMMON + [f"run.dir={run_dir}", f"model.kappa.enabled={str(kappa).lower()}",
                     f"zero.stage={zero}", f"parallel.ep={ep}", f"parallel.tp={tp}", f"precision={precision}",
                     f"train.init_weights={init_weights[kappa]}"]


VARIANTS = [(kappa, zero) for kappa in (True, False) for zero in (1, 2)]


@pytest.fixture(scope="module")
def runs(init_weights, tmp_path_factory):
    """Single-process references here; all 2-process runs in one deepspeed launch."""
    from megatron_kappa.train.loop import run
    tmp = tmp_path_factory.mktemp("runs")
    out = {}
    for kappa, zero in VARIANTS:
        ref = tmp / f"ref-{kappa}-{zero}"
        run(load_config("configs/tiny.yaml", overrides(init_weights, ref, kappa, zero)), log=lambda *a: None)
        out[("ref", kappa, zero)] = ref
    out[("ref", "bf16")] = tmp / "ref-bf16"
    run(load_config("configs/tiny.yaml", overrides(init_weights, out[("ref", "bf16")], True, 2, precision="bf16")),
        log=lambda *a: None)
    plan = []
    for kappa, zero in VARIANTS:
        for ep in (1, 2):  # DP2 and EP2 (2 processes)
            out[(f"ep{ep}", kappa, zero)] = tmp / f"ep{ep}-{kappa}-{zero}"
            plan.append({"overrides": overrides(init_weights, out[(f"ep{ep}", kappa, zero)], kappa, zero, ep)})
        if kappa:  # TP2 (with sequence parallelism) under DeepSpeed
            out[("tp2", kappa, zero)] = tmp / f"tp2-{kappa}-{zero}"
            plan.append({"overrides": overrides(init_weights, out[("tp2", kappa, zero)], kappa, zero, tp=2)})
    out[("ep2", "bf16")] = tmp / "ep2-bf16"
    plan.append({"overrides": overrides(init_weights, out[("ep2", "bf16")], True, 2, ep=2, precision="bf16")})
    out["unmarked"] = tmp / "unmarked"
    plan.append({"overrides": overrides(init_weights, out["unmarked"], True, 2, ep=2), "negative": "unmarked_experts"})
    (tmp / "plan.json").write_text(json.dumps(plan))
    proc = subprocess.run(deepspeed_cmd(ROOT / "tests/support/training_worker.py", str(tmp / "plan.json"),
                                        port=free_port()),
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("layout", ["ep1", "ep2"])
@pytest.mark.parametrize("kappa,zero", VARIANTS)
@pytest.mark.slow
def test_two_processes_match_one(runs, layout, kappa, zero):
    ref, got = losses(runs[("ref", kappa, zero)]), losses(runs[(layout, kappa, zero)])
    assert len(ref) == STEPS
    assert max_gap(ref, got) <= 1e-5, (ref, got)
    # clipping was active, so equal losses also mean equal global gradient norms
    assert all(r["grad_norm"] > 0.05 for r in records(runs[("ref", kappa, zero)]))


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.slow
def test_tensor_parallel_under_deepspeed_matches_one_process(runs, zero):
    ref, got = losses(runs[("ref", True, zero)]), losses(runs[("tp2", True, zero)])
    assert len(ref) == STEPS
    assert max_gap(ref, got) <= 1e-5, (ref, got)


@pytest.mark.slow
def test_bf16_expert_parallel_close_to_one_process(runs):
    """bf16 rounds differently when the work is split, so only closeness is expected."""
    ref, got = losses(runs[("ref", "bf16")]), losses(runs[("ep2", "bf16")])
    fp32 = losses(runs[("ref", True, 2)])
    assert len(ref) == STEPS
    assert max_gap(ref, got) <= 2e-2, (ref, got)
    assert max_gap(ref, fp32) <= 5e-2  # and bf16 tracks fp32


@pytest.mark.slow
def test_negative_control_unmarked_experts_break_ep(runs):
    ref, got = losses(runs[("ref", True, 2)]), losses(runs["unmarked"])
    assert max_gap(ref, got) > 1e-4


@pytest.mark.slow
def test_kappa_frozen_at_zero_then_trained(runs):
    recs = records(runs[("ref", True, 1)])
    start = schedule.unfreeze_step(STEPS, 0.25)  # = 1: step index 0 is frozen
    layers = [k for k in recs[0] if k.endswith("/alpha_abs")]
    assert layers
    for rec in recs:
        frozen = rec["step"] <= start
        for key in layers + [k.replace("alpha", "bias") for k in layers]:
            assert (rec[key] == 0.0) == frozen, (rec["step"], key, rec[key])
        assert (rec["lr_kappa"] == 0.0) == frozen


def test_kappa_lr_schedule_corner_points():
    cfg = load_config(None, ["model.kappa.freeze_fraction=0.1", "model.kappa.warmup=1000"])
    total = 20000
    start = schedule.unfreeze_step(total, 0.1)
    assert start == 2000
    assert schedule.kappa_lr(start - 1, total, cfg.train, cfg.model) == 0.0
    assert schedule.kappa_lr(start, total, cfg.train, cfg.model) == pytest.approx(0.12 / 1000)
    assert schedule.kappa_lr(start + 999, total, cfg.train, cfg.model) == pytest.approx(0.12)
    assert schedule.kappa_lr(total - 1, total, cfg.train, cfg.model) == pytest.approx(0.06)
    mid = (start + 999 + total - 1) // 2
    assert schedule.kappa_lr(mid, total, cfg.train, cfg.model) == pytest.approx(0.09, abs=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_kappa_l2_gradient(world1, reduction):
    """The penalty and its gradient against a hand count: per layer λ·mean(p²) over the layer's
    entries (mean, the authors' code) or λ·Σp² (sum, the paper's text)."""
    from megatron_kappa.model.build import build_model
    cfg = load_config("configs/tiny.yaml", ["model.kappa.l2_alpha=0.02", "model.kappa.l2_bias=0.01",
                                            f"model.kappa.l2_reduction={reduction}"])
    model = build_model(cfg, current_device())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "kappa_" in name:
                p.copy_(torch.randn(p.shape))
    loss = recipe.kappa_l2(model, cfg.model.kappa, cfg.parallel, torch.device("cpu"))
    loss.backward()
    kappa = [(n, p) for n, p in model.named_parameters() if "kappa_" in n]
    assert len(kappa) == 2 * sum(moe_layer_pattern(cfg.model))
    def count(p):
        return p.numel() if reduction == "mean" else 1
    for name, p in model.named_parameters():
        if name.endswith("kappa_alpha"):
            torch.testing.assert_close(p.grad, 2 * 0.02 * p.detach() / count(p))
        elif name.endswith("kappa_bias"):
            torch.testing.assert_close(p.grad, 2 * 0.01 * p.detach() / count(p))
        else:
            assert p.grad is None
    expected = sum((0.02 if n.endswith("alpha") else 0.01) * p.detach().double().pow(2).sum().item() / count(p)
                   for n, p in kappa)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # the two reductions differ by the layer's entry count (the negative control of each other)
    flipped = load_config("configs/tiny.yaml", [
        "model.kappa.l2_alpha=0.02", "model.kappa.l2_bias=0.01",
        f"model.kappa.l2_reduction={'sum' if reduction == 'mean' else 'mean'}"])
    other = recipe.kappa_l2(model, flipped.model.kappa, flipped.parallel, torch.device("cpu"))
    assert abs(other.item() - loss.item()) > 0.5 * min(other.item(), loss.item())


@pytest.mark.slow
def test_sigkill_and_resume_continue_exactly(init_weights, tmp_path):
    """EP2 on 2 processes (deepspeed launcher), killed hard after its first checkpoint, then
    started again; compared with an uninterrupted run started by torchrun."""
    steps = 6
    sets = overrides(init_weights, tmp_path / "killed", True, 2, ep=2) + [
        f"train.steps={steps}", "checkpoint.interval=2"]
    straight = overrides(init_weights, tmp_path / "straight", True, 2, ep=2) + [
        f"train.steps={steps}", "checkpoint.interval=2"]
    def cmd(s):
        return deepspeed_cmd(ROOT / "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set", *s,
                             port=free_port())
    proc = subprocess.Popen(cmd(sets), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    marker = tmp_path / "killed/checkpoints/step_2/meta.json"
    deadline = time.time() + 600
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists()
    outputs = []
    # The uninterrupted run goes through torchrun: the launcher must not matter either.
    def torchrun(s):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set", *s]
    for command in (cmd(sets), torchrun(straight)):
        done = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(done.stdout)
    assert "resumed from" in outputs[0] and "resumed from" not in outputs[1]
    assert losses(tmp_path / "killed") == losses(tmp_path / "straight")
    assert [r["step"] for r in records(tmp_path / "killed")] == list(range(1, steps + 1))


def test_interrupted_checkpoint_write_keeps_previous(tmp_path, world1, monkeypatch):
    from megatron_kappa.checkpoint import store
    from megatron_kappa.checkpoint.store import Checkpoints

    def dying_save(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        raise KeyboardInterrupt  # the process dies mid-write

    ckpts = Checkpoints(tmp_path, keep=2)
    good = ckpts.root / "step_2"
    good.mkdir(parents=True)
    (good / "meta.json").write_text('{"step": 2}')
    monkeypatch.setattr(store.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        ckpts._write(4, {}, {"weights": {}})
    assert ckpts.latest() == 2 and ckpts.complete() == [2]
    assert not (ckpts.root / "step_4").exists()


def test_config_errors_before_any_process_group(tmp_path):
    bad = [("data.paths=[/nonexistent/shard]", "data.paths: /nonexistent/shard.bin: no such file"),
           ("data.mock=false", "data.paths: empty"),
           ("zero.stage=3", "ZeRO-3 is not supported"),
           ("model.moe.num_experts=3", "parallel.ep"),
           ("train.init_weights=/nope.pt", "train.init_weights: /nope.pt: no such file")]
    for setting, message in bad:
        args = ["--set", "data.mock=false", "parallel.ep=2", setting] if "num_experts" in setting \
            else ["--set", "data.mock=false", setting] if "data.paths" in setting else ["--set", setting]
        done = subprocess.run([sys.executable, "launch/pretrain.py", "--config", "configs/tiny.yaml", *args],
                              cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr[-2000:]
        assert message in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    corrupt = tmp_path / "corrupt"
    (tmp_path / "corrupt.bin").write_bytes(b"\x00" * 16)
    (tmp_path / "corrupt.idx").write_bytes(b"not an index")
    done = subprocess.run([sys.executable, "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set",
                           "data.mock=false", f"data.paths=[{corrupt}]"], cwd=ROOT, env=env(), capture_output=True,
                          text=True)
    assert done.returncode == 2 and "bad magic" in done.stderr


def _tree(folder: Path) -> dict:
    """Every file under `folder` with its bytes' hash."""
    import hashlib
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_nan_loss_stops_with_last_checkpoint_intact(init_weights, tmp_path, monkeypatch):
    """A run resumed from its step-2 checkpoint diverges at step 3 (a NaN loss from there on):
    it stops naming the good checkpoint, and the run's checkpoints are exactly as before, with no
    checkpoint of the diverged step although every step is a checkpoint step."""
    from megatron_kappa.train import loop
    run_dir = tmp_path / "nan"
    sets = overrides(init_weights, run_dir, True, 1) + ["checkpoint.interval=1", "checkpoint.keep=5"]
    loop.run(load_config("configs/tiny.yaml", sets + ["train.steps=2"]), log=lambda *a: None)
    before = _tree(run_dir / "checkpoints")
    assert any(name.startswith("step_2/") for name in before)

    real_loss = loop.lm_loss
    monkeypatch.setattr(loop, "lm_loss", lambda *args: real_loss(*args) * float("nan"))
    with pytest.raises(loop.TrainingDiverged, match=r"step 3: loss is nan.*step_2"):
        loop.run(load_config("configs/tiny.yaml", sets + ["train.steps=4", "train.allow_schedule_change=true"]),
                 log=lambda *a: None)
    assert _tree(run_dir / "checkpoints") == before


def test_default_steps_follow_the_token_budget(world1):
    """Without train.steps the run length is the summary's 5 × N_eff budget, counted on the
    (here: expert-sharded-looking) local model with global_numel."""
    from megatron_kappa.model.build import build_model
    from megatron_kappa.summary import summarize
    from megatron_kappa.train.loop import total_steps
    cfg = load_config("configs/tiny.yaml", ["train.steps=null"])
    assert total_steps(cfg, build_model(cfg, current_device())) == summarize(cfg)["steps_for_budget"] > 0
