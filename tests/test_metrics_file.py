"""metrics.jsonl survives a crash: a record a crash left half-written (a kill, a full disk) is
dropped at resume in one line, wherever it is, and a new record never joins a torn one."""
import json

from megatron_kappa.config import load_config
from megatron_kappa.metrics.log import MetricsLog, read_records

RECORDS = [{"step": s, "loss": 3.0 - s / 10} for s in (1, 2, 3)]


def write_file(path, lines):
    path.write_text("".join(lines))


def whole(record):
    return json.dumps(record) + "\n"


def test_a_torn_last_record_is_dropped_at_resume_in_one_line(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    write_file(path, [whole(r) for r in RECORDS] + ['{"step": 4, "lo'])  # killed mid-write
    MetricsLog(tmp_path, tensorboard=False, enabled=True).truncate_after(3)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dropped 1 torn record (line 4)" in err, err
    assert read_records(path) == (RECORDS, [])


def test_a_torn_record_in_the_middle_is_found_too(tmp_path, capsys):
    """Negative control of a check that only looks at the last line: a torn record inside the
    file (an older crash, before this version wrote records whole) is reported with its line."""
    path = tmp_path / "metrics.jsonl"
    write_file(path, [whole(RECORDS[0]), '{"step": 2, "lo\n', whole(RECORDS[2]), "[1, 2]\n", '{"step"'])
    assert read_records(path) == ([RECORDS[0], RECORDS[2]], [2, 4, 5])
    MetricsLog(tmp_path, tensorboard=False, enabled=True).truncate_after(3)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dropped 3 torn records (line 2, 4, 5)" in err, err
    assert read_records(path) == ([RECORDS[0], RECORDS[2]], [])


def test_a_new_record_never_joins_a_torn_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_file(path, [whole(RECORDS[0]), '{"step": 2, "lo'])
    log = MetricsLog(tmp_path, tensorboard=False, enabled=True)  # no resume: nothing truncated
    log.write(RECORDS[2])
    assert read_records(path) == ([RECORDS[0], RECORDS[2]], [2])  # the new record is whole
    # negative control: appending as before this change glues the new record onto the torn one
    write_file(path, [whole(RECORDS[0]), '{"step": 2, "lo'])
    with path.open("a") as f:
        f.write(whole(RECORDS[2]))
    assert read_records(path) == ([RECORDS[0]], [2])


def test_training_resumes_over_a_torn_record(world1, tmp_path, capsys):
    from megatron_kappa.train import loop
    sets = ["data.mock=true", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=2",
            "log.tensorboard=false", "eval.valid_every=0", "log.interval=1", "checkpoint.interval=1",
            f"run.dir={tmp_path}"]
    loop.run(load_config("configs/tiny.yaml", ["train.steps=2", *sets]), log=lambda *a: None)
    path = tmp_path / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"step": 3, "loss": 6.')  # the kill during step 3's record
    capsys.readouterr()
    loop.run(load_config("configs/tiny.yaml", ["train.steps=4", "train.allow_schedule_change=true", *sets]),
             log=lambda *a: None)
    err = capsys.readouterr().err
    assert sum("torn record" in line for line in err.splitlines()) == 1, err
    records, torn = read_records(path)
    assert torn == [] and [r["step"] for r in records] == [1, 2, 3, 4]


def test_a_finished_run_says_there_is_nothing_to_do(world1, tmp_path):
    """Started again, or with train.steps below its checkpoint, a run says so in one line and
    changes nothing (it used to say only "resumed")."""
    from megatron_kappa.train import loop
    sets = ["data.mock=true", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=2",
            "log.tensorboard=false", "eval.valid_every=0", "log.interval=1", f"run.dir={tmp_path}"]
    loop.run(load_config("configs/tiny.yaml", ["train.steps=2", *sets]), log=lambda *a: None)
    before = (tmp_path / "metrics.jsonl").read_text()
    for steps in (2, 1):
        lines = []
        loop.run(load_config("configs/tiny.yaml", [f"train.steps={steps}", *sets]), log=lines.append)
        assert [line for line in lines if line.startswith("nothing to do")] == [
            f"nothing to do: the checkpoint is at step 2 and the run has {steps} steps (train.steps)"], lines
    assert (tmp_path / "metrics.jsonl").read_text() == before
    lines = []  # control: a longer run trains on, without the line
    loop.run(load_config("configs/tiny.yaml", ["train.steps=3", "train.allow_schedule_change=true", *sets]),
             log=lines.append)
    assert not any(line.startswith("nothing to do") for line in lines)
