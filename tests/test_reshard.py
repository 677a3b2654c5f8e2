"""Checkpoints that load into another layout (issue 35): a run checkpointed at step 2 in one layout
resumes in another (TP, EP, PP, DP, the world size and the ZeRO stage changed) and its next 3
steps have the losses of the run that went on in its own layout (which resumes bit-exactly:
tests/test_preemption.py). Negative control: the optimizer moments reset instead of loaded."""
import json
import shutil
from pathlib import Path

import pytest

from megatron_kappa.config import load_config

ROOT = Path(__file__).resolve().parents[1]

STEPS = 5
COMMON = ["data.mock=true", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=8",
          f"train.steps={STEPS}", "log.interval=1", "checkpoint.interval=2", "checkpoint.keep=4",
          "eval.valid_every=0", "log.tensorboard=false", "model.kappa.warmup=1", "model.kappa.freeze_fraction=0.2"]


def losses(run_dir) -> dict:
    return {r["step"]: r["loss"] for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())}


def back_to_step_2(run_dir, into):
    """A copy of the run as it was after step 2's checkpoint."""
    shutil.copytree(run_dir, into)
    for folder in (into / "checkpoints").glob("step_*"):
        if folder.name != "step_2":
            shutil.rmtree(folder)
    (into / "checkpoints/latest").write_text("step_2\n")


CASES = {  # name: (processes, settings) before → after
    "ep2-to-tp2": ((2, ["parallel.ep=2"]), (2, ["parallel.tp=2"])),
    "tp2xep2-zero1-to-dp4-zero2": ((4, ["parallel.tp=2", "parallel.ep=2", "zero.stage=1"]), (4, ["zero.stage=2"])),
    "pp2-to-dp2": ((2, ["parallel.pp=2"]), (2, [])),
    # into virtual stages: rank 0 then holds layers 0 and 2 (model/virtual_stages.py), its optimizer
    # moments gathered from both stages' files
    "pp2-to-vpp2": ((2, ["parallel.pp=2"]), (2, ["parallel.pp=2", "parallel.vpp=2"])),
    "4-processes-to-2": ((4, ["parallel.ep=4"]), (2, ["parallel.ep=2"])),
    # Muon/Aurora orthogonalise each TP shard on its own (megatron_kappa/optim/muon.py): a TP change
    # changes the update itself, so Aurora moves between layouts that keep its matrices whole
    "aurora-ep2-to-dp2": ((2, ["parallel.ep=2", "train.optimizer=aurora"]), (2, ["train.optimizer=aurora"])),
    # the SoftMoE router's learned per-layer budgets (θ) and its κ experts move with the weights
    "softmoe-ep2-to-dp2": ((2, ["parallel.ep=2", "model.moe.router=softmoe"]), (2, ["model.moe.router=softmoe"])),
}


@pytest.fixture(scope="module")
def moved(tmp_path_factory):
    """Every case's run in its first layout, then its copy at step 2 resumed in the second: the runs
    of one process count share a launch (tests/support/training_worker.py; the imports dominate on CPU).
    Also the straight EP2 run of the one-process test below. Returns (folder, {case: the resumed
    run's log})."""
    from tests.support.pipeline_runs import launch
    tmp = tmp_path_factory.mktemp("reshard")
    for nproc in (2, 4):
        plan = [{"overrides": COMMON + before + [f"run.dir={tmp / case / 'straight'}"]}
                for case, ((n, before), _) in CASES.items() if n == nproc]
        if nproc == 2:
            plan.append({"overrides": COMMON + TO_ONE + [f"run.dir={tmp / 'to_one' / 'straight'}"]})
        launch(tmp, plan, nproc)
    logs = {}
    for nproc in (2, 4):
        names = [case for case, (_, (n, _)) in CASES.items() if n == nproc]
        for case in names:
            back_to_step_2(tmp / case / "straight", tmp / case / "moved")
        out = launch(tmp, [{"overrides": COMMON + CASES[case][1][1] + [f"run.dir={tmp / case / 'moved'}"], "log": True}
                           for case in names], nproc)
        for i, case in enumerate(names):  # each run's log follows "== case <i>" (once per rank)
            logs[case] = out.split(f"== case {i}\n", 1)[1].split(f"== case {i + 1}\n", 1)[0]
    return tmp, logs


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_resume_in_another_layout_continues_the_run(moved, case):
    tmp, logs = moved
    assert f"resumed from {tmp / case / 'moved'}/checkpoints/step_2 (written with" in logs[case], logs[case][-2000:]
    ref, got = losses(tmp / case / "straight"), losses(tmp / case / "moved")
    assert sorted(got) == list(range(1, STEPS + 1))
    gaps = {s: abs(got[s] - ref[s]) for s in range(3, STEPS + 1)}
    assert max(gaps.values()) <= 1e-5, (gaps, ref, got)


TO_ONE = ["parallel.ep=2", "model.moe.router=sigmoid"]


@pytest.mark.slow
def test_two_processes_to_one_and_moments_reset_differ(moved, tmp_path, monkeypatch, world1):
    """EP2 on 2 processes → 1 process, in this process: the losses continue; with the moments
    (and steps) reset instead of loaded they do not (negative control)."""
    from megatron_kappa.checkpoint import optimizer_state
    from megatron_kappa.train.loop import run
    straight = moved[0] / "to_one" / "straight"
    ref = losses(straight)

    def resumed(name):
        back_to_step_2(straight, tmp_path / name)
        run(load_config("configs/tiny.yaml", [*COMMON, "model.moe.router=sigmoid", f"run.dir={tmp_path / name}"]),
            log=lambda *a, **k: None)
        got = losses(tmp_path / name)
        return max(abs(got[s] - ref[s]) for s in range(3, STEPS + 1))

    assert resumed("moved") <= 1e-5
    real = optimizer_state.restore
    import torch

    def reset(engine, model, full, steps):  # the master weights loaded; the moments zero, step 0
        real(engine, model, {k: v if k == optimizer_state.MASTER else {n: torch.zeros_like(t) for n, t in v.items()}
                             for k, v in full.items()}, {n: 0 for n in steps})
    monkeypatch.setattr(optimizer_state, "restore", reset)
    assert resumed("reset") > 1e-3


def test_a_format_1_checkpoint_in_another_layout_is_one_line(tmp_path):
    """Checkpoints written before resharding (DeepSpeed's files) load only in their layout."""
    from megatron_kappa.config import ConfigError
    from megatron_kappa.preflight import check_resume
    folder = tmp_path / "checkpoints/step_2"
    folder.mkdir(parents=True)
    (tmp_path / "checkpoints/latest").write_text("step_2\n")
    cfg = load_config("configs/tiny.yaml", [f"run.dir={tmp_path}"])
    from megatron_kappa.config import to_dict
    from megatron_kappa.parallel.layout import layout_record
    meta = {"step": 2, "layout": layout_record(cfg.parallel, 2), "config": to_dict(cfg), "files": {}}
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"format 1, written before checkpoints resharded\) loads only in its own"):
        check_resume(cfg, world=1)
    check_resume(cfg, world=2)  # its own layout: fine
    (folder / "meta.json").write_text(json.dumps({**meta, "format": 2}))
    check_resume(cfg, world=1)  # format 2: any layout


def test_consolidate_reads_only_the_wanted_pieces():
    """A rank assembles only the full tensors it needs: the pieces of the others (another EP
    rank's experts, another stage's layers) are never touched, so their bytes stay on disk."""
    import torch

    from megatron_kappa.parallel.sharding import consolidate

    class Recording(dict):
        touched = set()

        def __getitem__(self, key):
            Recording.touched.add((id(self), key))
            return dict.__getitem__(self, key)

    expert = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    dense = "decoder.layers.0.self_attention.linear_qkv.weight"
    ranks = []
    for ep in range(2):
        coords = {"pp": [0, 1], "layer_offset": 0, "tp": [0, 1], "ep": [ep, 2], "etp": [0, 1], "dp": [ep, 2],
                  "edp": [0, 1], "num_local_experts": 1, "split_dim": {dense: None, expert: None}}
        ranks.append((coords, Recording({dense: torch.full((2, 2), 9.0), expert: torch.full((2, 2), float(ep))})))
    mine = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    got = consolidate(ranks, wanted={mine})
    assert list(got) == [mine] and got[mine].eq(1).all()
    assert Recording.touched == {(id(ranks[1][1]), expert)}  # nothing else was read
    every = consolidate(ranks)  # control: without `wanted`, everything
    assert set(every) == {dense, expert, mine}
