"""Weights & Biases and TensorBoard beside metrics.jsonl (log.wandb, log.tensorboard).

A W&B offline run's transaction log, read back with wandb's own protobuf classes
(tests/support/wandb_records.py), holds the run's resolved config (config.yaml) and exactly the records of
metrics.jsonl; a resume continues the same W&B run id. TensorBoard's event file holds the config as
text and, per MoE layer, histograms of κ and of the tokens per expert whose counts and sums agree
with the same step's metrics. With log.wandb disabled, wandb is never imported."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_kappa.config import WandbConfig, load_config
from megatron_kappa.metrics.log import MetricsLog, read_records
from tests.support.wandb_records import run_files, run_summary

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = WandbConfig(mode="offline", project="tests")
RECORDS = [{"step": 2, "loss": 7.25, "lr": 1e-3, "grad_norm": 0.5, "load/layer1/cv": 0.125},
           {"step": 4, "loss": 6.5, "lr": 2e-3, "grad_norm": 0.25, "load/layer1/cv": 0.0625}]
SETS = ["data.mock=true", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=2",
        "eval.valid_every=0", "log.interval=2", "checkpoint.interval=2", "log.tensorboard=true",
        "log.wandb.mode=offline", "log.wandb.project=tests"]


def test_an_offline_run_holds_the_config_and_the_records(tmp_path):
    config = {"train": {"steps": 4, "lr": 1e-3}, "model": {"num_layers": 2}, "run": {"dir": str(tmp_path)}}
    log = MetricsLog(tmp_path, tensorboard=False, enabled=True, wandb=OFFLINE, config=config, log=lambda *a: None)
    for record in RECORDS:
        log.write(record)
    log.close()
    (first,) = run_files(tmp_path)
    run = run_summary(first)
    assert run["config"] == config
    assert run["history"] == read_records(tmp_path / "metrics.jsonl")[0] == RECORDS
    assert run["id"] == (tmp_path / "wandb" / "run_id").read_text().strip()


def test_a_resume_continues_the_same_run_and_another_dir_starts_its_own(tmp_path):
    def quiet(*a):
        return None
    for start, record in enumerate(RECORDS):
        log = MetricsLog(tmp_path / "a", tensorboard=False, enabled=True, wandb=OFFLINE,
                         config={"train": {"steps": 2 * (start + 1)}}, start=start, log=quiet)
        log.write(record)
        log.close()
    first, second = (run_summary(f) for f in run_files(tmp_path / "a"))
    assert first["id"] == second["id"]
    assert second["config"] == {"train": {"steps": 4}} and second["history"] == RECORDS[1:]
    other = MetricsLog(tmp_path / "b", tensorboard=False, enabled=True, wandb=OFFLINE, config={}, log=quiet)
    other.close()
    assert run_summary(run_files(tmp_path / "b")[0])["id"] != first["id"]  # negative control: the id file carries it


def test_rank_zero_only_and_disabled_means_no_wandb_import(tmp_path):
    """Other ranks write nothing; with mode disabled (the default) wandb is not even imported
    (control: offline imports it)."""
    MetricsLog(tmp_path / "rank1", tensorboard=False, enabled=False, wandb=OFFLINE, config={}).close()
    assert not (tmp_path / "rank1").exists()
    probe = ("import sys\n"
             "from megatron_kappa.config import WandbConfig\n"
             "from megatron_kappa.metrics.log import MetricsLog\n"
             "log = MetricsLog(sys.argv[1], tensorboard=False, enabled=True, wandb=WandbConfig(mode=sys.argv[2]), "
             "config={}, log=lambda *a: None)\n"
             "log.write({'step': 1, 'loss': 1.0})\n"
             "log.close()\n"
             "print('wandb' in sys.modules)\n")
    seen = {}
    for mode in ("disabled", "offline"):
        done = subprocess.run([sys.executable, "-c", probe, str(tmp_path / mode), mode], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        seen[mode] = done.stdout.splitlines()[-1]
    assert seen == {"disabled": "False", "offline": "True"}
    assert not (tmp_path / "disabled" / "wandb").exists()


def tensorboard_events(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(Path(run_dir) / "tb"), size_guidance={"tensors": 0, "histograms": 0, "scalars": 0})
    events.Reload()
    return events


@pytest.mark.slow
def test_training_logs_the_config_and_metrics_to_wandb_and_tensorboard(world1, tmp_path):
    """A 4-step run, then resumed to 6: the W&B runs against config.yaml and metrics.jsonl; the
    TensorBoard text and histograms against the records of their steps."""
    from megatron_kappa.train import loop
    sets = [*SETS, f"run.dir={tmp_path}"]
    lines = []
    loop.run(load_config("configs/tiny.yaml", [*sets, "train.steps=4"]), log=lines.append)
    assert any(line.startswith("W&B: run ") and "offline" in line for line in lines), lines
    config_4 = yaml.safe_load((tmp_path / "config.yaml").read_text())
    loop.run(load_config("configs/tiny.yaml", [*sets, "train.steps=6", "train.allow_schedule_change=true"]),
             log=lambda *a: None)
    config_6 = yaml.safe_load((tmp_path / "config.yaml").read_text())
    records, torn = read_records(tmp_path / "metrics.jsonl")
    assert torn == [] and [r["step"] for r in records] == [2, 4, 6]
    first, second = (run_summary(f) for f in run_files(tmp_path))
    assert first["id"] == second["id"]
    assert first["config"] == config_4 and second["config"] == config_6 != config_4  # train.steps 4 → 6
    assert first["history"] == records[:2] and second["history"] == records[2:]

    events = tensorboard_events(tmp_path)
    (text,) = events.Tensors("config/text_summary")[:1]  # the first start's
    shown = text.tensor_proto.string_val[0].decode()
    assert yaml.safe_load("\n".join(line[4:] for line in shown.splitlines())) == config_4
    by_step = {r["step"]: r for r in records}
    moe_layers = [1, 2, 3]  # configs/tiny.yaml: first_dense 1 of 4 layers
    tags = events.Tags()["histograms"]
    assert sorted(tags) == sorted([f"kappa/layer{i}" for i in moe_layers] + [f"load/layer{i}" for i in moe_layers])
    for i in moe_layers:
        for h in events.Histograms(f"load/layer{i}"):
            record = by_step[h.step]
            assert h.histogram_value.num == 4  # one count per expert
            assert h.histogram_value.sum == pytest.approx(4 * record[f"load/layer{i}/mean"], rel=1e-12)
            assert h.histogram_value.min == record[f"load/layer{i}/min"]
        kappa = events.Histograms(f"kappa/layer{i}")
        assert [h.step for h in kappa] == [2, 4, 6]
        for h in kappa:  # the κ sample the statistics are computed from
            mean = h.histogram_value.sum / h.histogram_value.num
            assert mean == pytest.approx(by_step[h.step][f"kappa/layer{i}/mean"], rel=1e-6)
    assert "time" not in events.Tags()["scalars"] and "loss" in events.Tags()["scalars"]
