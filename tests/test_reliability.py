"""A run a user cannot lose or misread (issue 34): numbers checked up front, unusable paths and
bad --set values in one line, one writer per run.dir. (The resume check: tests/test_resume_check.py.)"""
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.train.run_lock import RunLock


@pytest.mark.parametrize("setting,message", [
    ("train.adam_eps=.inf", "train.adam_eps: expected a finite number, got inf"),
    ("model.kappa.l2_alpha=.nan", "model.kappa.l2_alpha: expected a finite number, got nan"),
    ("train.lr=nan", "train.lr: expected a finite number, got nan"),  # YAML's plain "nan" is a string
    ("train.lr=.inf", "train.lr: expected a finite number"),
    ("model.init_std=.nan", "model.init_std: expected a finite number"),
    ("model.init_std=0", "model.init_std: must be positive"),
    ("train.betas=[0.9,1.0]", r"train.betas: expected two numbers in \[0, 1\)"),
    ("train.x0_betas=[0.9]", r"train.x0_betas: expected two numbers in \[0, 1\)"),
    ("model.kappa.l2_bias=-0.01", "model.kappa.l2_bias: must not be negative"),
    ("model.kappa.l2_alpha=-0.02", "model.kappa.l2_alpha: must not be negative"),
    ("data.paths=[a,b", "--set 'data.paths=\\[a,b': the value is not valid YAML"),
    # issue 53's new-user pass over the newer keys and --set mistakes (docs/reliability.md)
    ("data.packing=foo", r"data.packing: expected one of \['concat', 'bestfit'\], got 'foo'"),
    ("model.moe.capacity=-1", r"model.moe.capacity: expected one of \['megatron', 'authors'\], got -1"),
    ("model.kappa.alpha_optimizer=muon", r"model.kappa.alpha_optimizer: expected one of \['adamw', 'matrix'\]"),
    ("train.grad_accum_dtype=fp16", r"train.grad_accum_dtype: expected one of \['fp32', 'bf16'\], got 'fp16'"),
    ("model.moe.drop_order=random", r"model.moe.drop_order: expected one of"),
    ("train.steps=abc", "train.steps: expected an integer, got 'abc'"),
    ("train.steps=1.5", "train.steps: expected an integer, got 1.5"),
    ("model.num_layers=[1]", r"model.num_layers: expected an integer, got \[1\]"),
    ("model.kappa.enabled=maybe", "model.kappa.enabled: expected true/false, got 'maybe'"),
    ("train=5", "train: expected a mapping, got 5"),
    ("train.lr", "--set 'train.lr': expected key=value"),
    ("trian.lr=1e-3", r"unknown key 'trian' \(did you mean 'train'\? expected one of"),
    ("model.moe.num_expert=8", r"unknown key 'model.moe.num_expert' \(did you mean 'model.moe.num_experts'\?"),
])
def test_numbers_and_values_are_checked_up_front(setting, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config("configs/tiny.yaml", [setting])
    assert "\n" not in str(e.value)


def test_a_config_that_is_a_folder_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=f"^config: {tmp_path}: is a folder, not a YAML config file$"):
        load_config(tmp_path)  # it said "no such file"


def test_an_unknown_key_far_from_any_gets_no_guess():  # negative control of "did you mean"
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", ["zzzz=1"])
    assert "did you mean" not in str(e.value) and "unknown key 'zzzz' (expected one of:" in str(e.value)


def test_the_checked_values_accept_what_is_valid():  # negative control of the checks above
    load_config("configs/tiny.yaml", ["train.adam_eps=1e-10", "model.kappa.l2_alpha=0", "train.betas=[0,0.999]",
                                      "train.x0_betas=[0.96,0.95]", "model.kappa.l2_bias=0", "model.init_std=1e-3"])


def test_unusable_run_dir_is_one_line(tmp_path):
    from megatron_kappa.preflight import check_run_dir
    afile = tmp_path / "file"
    afile.write_text("x")
    for run_dir, message in ((afile, "is a file, not a folder"), (afile / "sub", "is a file, not a folder")):
        with pytest.raises(ConfigError, match=f"run.dir: .*{message}"):
            check_run_dir(load_config("configs/tiny.yaml", [f"run.dir={run_dir}"]).run)
    check_run_dir(load_config("configs/tiny.yaml", [f"run.dir={tmp_path / 'new' / 'run'}"]).run)  # fine


def write_lock(run_dir, host, pid, age_s=0.0):
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ".lock"
    path.write_text(json.dumps({"host": host, "pid": pid, "started": "earlier"}))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_lock_refuses_a_live_holder_and_takes_over_a_stale_one(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        write_lock(tmp_path, socket.gethostname(), sleeper.pid)
        with pytest.raises(ConfigError, match=rf"in use by pid {sleeper.pid} on {socket.gethostname()}"):
            RunLock(tmp_path).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
    RunLock(tmp_path).acquire()  # its holder is gone (a SIGKILL): stale, taken over
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    # another host's lock: alive while its heartbeat is fresh, stale after STALE_AFTER_S; a requeue of the
    # same Slurm job takes it over
    write_lock(tmp_path, "node-that-died", 12345)
    with pytest.raises(ConfigError, match="in use by pid 12345 on node-that-died"):
        RunLock(tmp_path).acquire()
    write_lock(tmp_path, "node-that-died", 12345, age_s=3600)
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()
    assert not (tmp_path / ".lock").exists()


def test_a_requeued_slurm_job_takes_its_own_lock(tmp_path, monkeypatch):
    path = write_lock(tmp_path, "node-that-died", 12345)
    path.write_text(json.dumps({"host": "node-that-died", "pid": 12345, "job": "77"}))
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    with pytest.raises(ConfigError, match="in use"):
        RunLock(tmp_path).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    RunLock(tmp_path).acquire()


def test_the_holder_heartbeats_while_it_lives(tmp_path, monkeypatch):
    from megatron_kappa.train import run_lock
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = RunLock(tmp_path)
    lock.acquire()
    old = time.time() - 3600
    os.utime(lock.path, (old, old))
    time.sleep(0.3)
    assert time.time() - lock.path.stat().st_mtime < 60  # touched again by the holder's thread
    lock.release()
    time.sleep(0.2)
    assert not lock.path.exists()


def test_a_second_training_on_the_run_dir_is_refused(world1, tmp_path):
    """loop.run refuses a run.dir that a live process holds, before writing anything; the same
    run goes ahead once the holder is gone (negative control)."""
    from megatron_kappa.train import loop
    sets = ["train.steps=1", "data.mock=true", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=2",
            "log.tensorboard=false", "eval.valid_every=0", f"run.dir={tmp_path}"]
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        write_lock(tmp_path, socket.gethostname(), sleeper.pid)
        with pytest.raises(ConfigError, match=f"in use by pid {sleeper.pid}"):
            loop.run(load_config("configs/tiny.yaml", sets), log=lambda *a: None)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]
    finally:
        sleeper.kill()
        sleeper.wait()
    loop.run(load_config("configs/tiny.yaml", sets), log=lambda *a: None)
    assert (tmp_path / "checkpoints/step_1/meta.json").is_file() and not (tmp_path / ".lock").exists()


TRAIN = ["data.mock=true", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=2",
         "log.tensorboard=false", "eval.valid_every=0", "checkpoint.interval=1", "checkpoint.keep=3"]
LONGER = "train.allow_schedule_change=true"  # a resume to more steps than the first start's


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_skipped(world1, tmp_path, monkeypatch):
    """Truncate a file of the newest checkpoint: resume and evaluation warn in one line naming it
    and use the one before; the next save sets the damaged one aside. Negative control: without
    the verification the resume stops inside the load."""
    from megatron_kappa.checkpoint.listing import CheckpointDir
    from megatron_kappa.evaluation.loading import load_model_for_eval
    from megatron_kappa.train import loop
    sets = TRAIN + [f"run.dir={tmp_path}"]
    loop.run(load_config("configs/tiny.yaml", [*sets, "train.steps=2"]), log=lambda *a: None)
    listing = CheckpointDir(tmp_path)
    assert listing.latest() == 2 and listing.verify(2) is None
    victim = sorted((tmp_path / "checkpoints/step_2").rglob("*.pt"))[-1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    warnings = []
    assert listing.latest(warn=warnings.append) == 1
    assert len(warnings) == 1 and str(victim) in warnings[0] and "\n" not in warnings[0]
    assert load_model_for_eval(tmp_path)[1].model.hidden_size == 64  # evaluation takes step 1
    with monkeypatch.context() as m:  # negative control: the damaged one taken as it is
        m.setattr(CheckpointDir, "verify", lambda self, step, content=True: None)
        with pytest.raises(Exception) as crash:
            loop.run(load_config("configs/tiny.yaml", [*sets, "train.steps=3", LONGER]), log=lambda *a: None)
        assert not isinstance(crash.value, ConfigError)
    loop.run(load_config("configs/tiny.yaml", [*sets, "train.steps=3", LONGER]), log=lambda *a: None)
    assert listing.complete() == [1, 2, 3] and listing.verify(2) is None  # step 2 trained and saved again
    # a damaged checkpoint is set aside by the next save's rotation, never kept in place of a good one
    victim = sorted((tmp_path / "checkpoints/step_3").rglob("*.pt"))[0]
    victim.write_bytes(b"")
    assert listing.set_aside_damaged() == [3] and listing.complete() == [1, 2]
    assert (tmp_path / "checkpoints/damaged/step_3").is_dir()


@pytest.mark.slow
def test_a_failed_save_removes_its_files_and_keeps_the_previous(world1, tmp_path, monkeypatch):
    from megatron_kappa.checkpoint import store
    from megatron_kappa.checkpoint.listing import CheckpointDir, CheckpointSaveError
    from megatron_kappa.train import loop
    sets = TRAIN + [f"run.dir={tmp_path}"]
    loop.run(load_config("configs/tiny.yaml", [*sets, "train.steps=1"]), log=lambda *a: None)
    real_save = store.torch.save

    def full_disk(obj, path, *a, **k):
        if "rank_" in str(path):
            raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing "
                               "file data/0: file write failed")
        return real_save(obj, path, *a, **k)
    monkeypatch.setattr(store.torch, "save", full_disk)
    with pytest.raises(CheckpointSaveError, match=r"step_2: saving failed \(rank 0: .*file write failed\).*"
                                                  r"the latest checkpoint is still .*step_1") as e:
        loop.run(load_config("configs/tiny.yaml", [*sets, "train.steps=2", LONGER]), log=lambda *a: None)
    assert "\n" not in str(e.value)
    assert CheckpointDir(tmp_path).complete() == [1] and not (tmp_path / "checkpoints/.tmp/step_2").exists()
    # a truly full disk: torch's "unexpected pos" is said as what it is
    monkeypatch.setattr(store.torch, "save", lambda obj, path, *a, **k: (_ for _ in ()).throw(
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")) if "rank_" in str(path)
        else real_save(obj, path, *a, **k))
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, 10 << 30, 1 << 20))
    with pytest.raises(CheckpointSaveError,
                       match=r"rank 0: no space left on the device \(1 MiB free in .*the write failed with: "
                                                  r"\[enforce fail .*unexpected pos"):
        loop.run(load_config("configs/tiny.yaml", [*sets, "train.steps=2", LONGER]), log=lambda *a: None)
    assert not (tmp_path / ".lock").exists()  # the run.dir is free again


def test_commands_print_no_known_library_warnings(tmp_path):
    """A plain pretrain's first output line is its own; KAPPA_SHOW_WARNINGS=1 shows the library
    lines again (negative control), and a warning not on the known list always shows."""
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "KAPPA_SHOW_WARNINGS")}
    base.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(root))
    def cmd(run_dir):
        return [sys.executable, "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set", "train.steps=1",
                "data.mock=true", f"run.dir={run_dir}", "log.tensorboard=false", "eval.valid_every=0"]
    quiet = subprocess.run(cmd(tmp_path / "run"), cwd=root, env=base, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr[-2000:]
    assert quiet.stdout.splitlines()[0].startswith("step 1/1")
    loud = subprocess.run(cmd(tmp_path / "loud"), cwd=root, env={**base, "KAPPA_SHOW_WARNINGS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert loud.returncode == 0 and "Transformer Engine and Apex are not installed" in loud.stderr
    assert "CPU RNG state changed" in loud.stderr and "GPTModel IS DEPRECATED" in loud.stderr
    other = subprocess.run([sys.executable, "-c", "import megatron_kappa, warnings; warnings.warn('a new warning')"],
                           cwd=root, env=base, capture_output=True, text=True, timeout=60)
    assert "UserWarning: a new warning" in other.stderr


def test_token_ids_beyond_the_vocabulary_are_found_up_front(tmp_path):
    """Shards whose ids reach past model.vocab_size: refused by the preflight, from the manifest
    when one lists them, else from the .bin; the same shards fit a large enough model (control)."""
    import numpy as np

    from megatron_kappa.data.indexed import index_bytes
    from megatron_kappa.preflight import check_data

    def checked(sets):
        cfg = load_config("configs/tiny.yaml", sets)
        check_data(cfg.data, cfg.model.vocab_size)
    prefix = tmp_path / "shard"
    ids = np.array([5, 9, 3000, 7], dtype=np.uint16)
    (tmp_path / "shard.bin").write_bytes(ids.tobytes())
    (tmp_path / "shard.idx").write_bytes(index_bytes([4], np.uint16))
    sets = ["data.mock=false", f"data.paths=[{prefix}]", f"data.valid_paths=[{prefix}]", "model.vocab_size=2048"]
    with pytest.raises(ConfigError,
                       match=r"shard: token ids up to 3000 \(read from its .bin\), but model.vocab_size is 2048"):
        checked(sets)
    checked([*sets[:-1], "model.vocab_size=4096"])
    (tmp_path / "manifest.json").write_text(json.dumps({"prefixes": {"train": ["shard"]},
                                                        "tokenizer": {"vocab_size": 32768}}))
    with pytest.raises(ConfigError, match=r"token ids up to 32767 \(its tokenizer's vocabulary per .*manifest.json\)"):
        checked([*sets[:-1], "model.vocab_size=4096"])


def test_eval_loss_checks_the_shards_against_the_checkpoint_before_loading(tmp_path, capsys):
    import numpy as np
    import yaml

    from megatron_kappa.cli.eval_loss import main
    from megatron_kappa.config import to_dict
    from megatron_kappa.data.indexed import index_bytes
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(load_config("configs/tiny.yaml", [])), sort_keys=False))
    (tmp_path / "val.bin").write_bytes(np.array([1, 2, 4000], dtype=np.uint16).tobytes())
    (tmp_path / "val.idx").write_bytes(index_bytes([3], np.uint16))
    assert main(["--checkpoint", str(run), "--data", str(tmp_path / "val")]) == 2
    err = capsys.readouterr().err
    assert "token ids up to 4000" in err and "model.vocab_size is 2048" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv,flag", [
    (["-m", "plan", "--config", "configs/tiny.yaml", "--world", "4", "--gpu-mem", "-1"], "--gpu-mem"),
    (["-m", "plan", "--config", "configs/tiny.yaml", "--world", "4", "--gpu-mem", "nan"], "--gpu-mem"),
    (["-m", "plan", "--config", "configs/tiny.yaml", "--world", "0"], "--world"),
    (["eval/core.py", "--checkpoint", "x", "--bundle", "y", "--max-per-task", "0"], "--max-per-task"),
    (["eval/loss.py", "--checkpoint", "x", "--data", "y", "--max-tokens", "-5"], "--max-tokens"),
    (["launch/demo.py", "--steps", "0"], "--steps"),
    (["launch/demo.py", "--max-docs", "-3"], "--max-docs"),
])
def test_command_line_numbers_are_checked(argv, flag):
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, *argv], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 2 and f"argument {flag}: expected a positive" in done.stderr, done.stderr[-1000:]
    assert "Traceback" not in done.stderr


def test_a_failed_metrics_write_is_one_warning_and_training_goes_on(tmp_path, capsys):
    from megatron_kappa.metrics.log import MetricsLog
    log = MetricsLog(tmp_path, tensorboard=False, enabled=True)
    log.write({"step": 1, "loss": 2.0})
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "metrics.jsonl").mkdir()  # the next appends fail (a stand-in for a full disk)
    log.write({"step": 2, "loss": 1.5})
    log.write({"step": 3, "loss": 1.4})
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: metrics: ") and "training goes on" in err
    (tmp_path / "metrics.jsonl").rmdir()
    log.write({"step": 4, "loss": 1.3})  # writes again once the path works
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 4


def test_consolidate_output_under_a_file_is_one_line(tmp_path, capsys):
    from megatron_kappa.cli.consolidate import main
    (tmp_path / "afile").write_text("x")
    assert main(["--checkpoint", str(tmp_path), "--output", str(tmp_path / "afile" / "full.pt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--output: " in err and "is not a writable folder" in err


def test_a_folder_that_takes_no_files_is_found_before_any_work(tmp_path, capsys):
    """/proc (or a read-only mount) passes access() for root: a file made and removed there is
    the check (paths.folder_problem), so consolidate and the export refuse it in one line before
    any checkpoint is read (the export found it only at its last rename, consolidate called it a
    full disk: '0 MiB free in /proc'). A folder that takes files passes (control)."""
    from megatron_kappa.cli import consolidate
    from megatron_kappa.export import writer
    from megatron_kappa.paths import folder_problem
    assert folder_problem("/proc/hf").startswith("/proc is not writable")
    assert folder_problem(tmp_path / "new" / "hf") is None and list(tmp_path.iterdir()) == []  # the probe is gone
    assert consolidate.main(["--checkpoint", str(tmp_path / "no_run"), "--output", "/proc/full.pt"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --output: /proc is not a writable folder\n", err
    with pytest.raises(ConfigError, match=r"^--output: /proc is not writable \(.*\)$"):
        writer.export(tmp_path / "no_run", "/proc/hf")


def test_only_a_full_disk_is_called_one(monkeypatch):
    """write_failure says "no space left" for ENOSPC, or torch's wording with (nearly) no space
    left; not for torch's "open file failed ... No such file or directory", nor in /proc."""
    import errno
    import shutil
    from collections import namedtuple

    from megatron_kappa.checkpoint.listing import write_failure
    usage = namedtuple("usage", "total used free")
    assert "no space left" not in write_failure(FileNotFoundError(errno.ENOENT, "No such file or directory"), "/proc")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, 10 << 30, 1 << 20))  # nearly full
    missing = RuntimeError("[enforce fail at inline_container.cc:747] . open file failed with strerror: "
                           "No such file or directory")
    assert write_failure(missing, "/x").startswith("[enforce fail")
    full = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    assert write_failure(full, "/x").startswith("no space left on the device (1 MiB free in /x")  # control
    assert write_failure(OSError(errno.ENOSPC, "No space left on device"), "/x").startswith("no space left")


def test_consolidating_a_folder_that_does_not_exist_says_so(tmp_path, capsys):
    from megatron_kappa.cli import consolidate
    assert consolidate.main(["--checkpoint", str(tmp_path / "nowhere"), "--output", str(tmp_path / "f.pt")]) == 2
    err = capsys.readouterr().err  # it said "<nowhere>/checkpoints: no complete checkpoint"
    assert err.startswith(f"error: --checkpoint: {tmp_path / 'nowhere'}: no such folder") and err.count("\n") == 1


def test_consolidate_refuses_an_existing_output_unless_forced(tmp_path, capsys, monkeypatch):
    """An existing --output is refused in one line before any checkpoint is read, its bytes kept;
    --force replaces it (the control: the same call goes on to read the checkpoint)."""
    from megatron_kappa.cli import consolidate
    (tmp_path / "run").mkdir()  # a run without checkpoints
    out = tmp_path / "full.pt"
    out.write_bytes(b"earlier work")
    assert consolidate.main(["--checkpoint", str(tmp_path / "run"), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--output: {out} exists; choose another path, or --force" in err
    assert out.read_bytes() == b"earlier work"
    assert consolidate.main(["--checkpoint", str(tmp_path / "run"), "--output", str(out), "--force"]) == 2
    err = capsys.readouterr().err  # past the output check: the (empty) run is what is refused now
    assert "no complete checkpoint" in err and "--output" not in err, err
    assert out.read_bytes() == b"earlier work"  # nothing to consolidate: still untouched


def test_a_damaged_bundle_member_is_one_line(tmp_path):
    """A byte of a .jsonl flipped inside the zip: one BundleError naming the member; the intact
    zip loads (control)."""
    import shutil
    import zipfile
    from pathlib import Path

    from megatron_kappa.evaluation.bundle import BundleError, load_bundle
    src = Path(__file__).resolve().parent / "core_bundle"
    good = Path(shutil.make_archive(str(tmp_path / "bundle"), "zip", src))
    assert load_bundle(good).tasks
    data = bytearray(good.read_bytes())
    with zipfile.ZipFile(good) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(".jsonl"))
    data[info.header_offset + 30 + len(info.filename) + 5] ^= 0xFF  # inside the member's data
    bad = tmp_path / "bad.zip"
    bad.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=rf"{info.filename}: damaged inside the zip") as e:
        load_bundle(bad)
    assert "\n" not in str(e.value)


def test_a_zombie_or_a_reused_pid_does_not_hold_the_lock(tmp_path):
    """A killed holder that nobody reaped (a zombie: its launcher was killed too) and a live
    process that merely got the holder's pid (another start time) are both stale; the live
    holder itself is not (control)."""
    zombie = subprocess.Popen(["true"])
    time.sleep(0.5)  # exited, not waited for: a zombie until wait()
    try:
        write_lock(tmp_path, socket.gethostname(), zombie.pid)
        RunLock(tmp_path).acquire()
    finally:
        zombie.wait()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        path = write_lock(tmp_path, socket.gethostname(), sleeper.pid)
        from megatron_kappa.train.run_lock import _start_time
        path.write_text(json.dumps({"host": socket.gethostname(), "pid": sleeper.pid,
                                    "pid_started": _start_time(sleeper.pid)}))
        with pytest.raises(ConfigError, match="in use"):
            RunLock(tmp_path).acquire()
        path.write_text(json.dumps({"host": socket.gethostname(), "pid": sleeper.pid, "pid_started": "1"}))
        RunLock(tmp_path).acquire()  # the pid belongs to another process now
    finally:
        sleeper.kill()
        sleeper.wait()


def test_every_numeric_key_has_a_range_that_refuses_values_outside_it():
    """config/ranges.py covers every numeric schema key; for each, a value just outside its range
    is refused naming the key, and the default is inside it (control)."""
    from megatron_kappa.config import Config, facts, ranges
    keys = dict(ranges.numeric_keys(Config))
    assert set(keys) == set(ranges.RANGES), set(keys) ^ set(ranges.RANGES)
    outside = {ranges.POSITIVE: 0, ranges.NON_NEGATIVE: -1, ranges.FRACTION: 1, ranges.OPEN_FRACTION: 0,
               ranges.PROBABILITY: 1.5, ranges.BEYOND_ONE: 1, ranges.AT_LEAST_ONE: 0.5, facts.OPEN_UNIT: 1}
    for key, spec in ranges.RANGES.items():
        value = outside[spec] if keys[key] is float or float(outside[spec]).is_integer() else -1
        with pytest.raises(ConfigError, match=rf"config: {key}: "):
            load_config("configs/tiny.yaml", [f"{key}={value}"])
    assert "| `train.lr_wsd_decay_fraction` | `0.5` | finite number (0, 1] |" in Path("docs/config.md").read_text()


def test_library_escape_warnings_stay_quiet_without_bytecode(tmp_path):
    """Without cached bytecode (PYTHONDONTWRITEBYTECODE=1) Python reports a library's invalid
    string escapes at every start: quiet drops them for files under site-packages; the same
    warning from a file outside it still shows, and KAPPA_SHOW_WARNINGS=1 shows both (controls)."""
    import sys
    (tmp_path / "site-packages").mkdir(), (tmp_path / "own").mkdir()
    (tmp_path / "site-packages/escaping_library.py").write_text('x = "\\-"\n')
    (tmp_path / "own/escaping_own.py").write_text('y = "\\-"\n')
    base = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": f"{tmp_path / 'site-packages'}{os.pathsep}{tmp_path / 'own'}"}
    base.pop("KAPPA_SHOW_WARNINGS", None)
    code = "from megatron_kappa import quiet; quiet.install(); import escaping_library, escaping_own"
    for show in ("", "1"):
        done = subprocess.run([sys.executable, "-c", code], env={**base, "KAPPA_SHOW_WARNINGS": show},
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert ("escaping_library.py:1: SyntaxWarning: invalid escape "
                "sequence" in done.stderr) == bool(show), done.stderr
        assert "escaping_own.py:1: SyntaxWarning: invalid escape sequence" in done.stderr, done.stderr


@pytest.mark.slow
def test_launchers_print_no_known_library_warnings(tmp_path):
    """kappa-torchrun (OMP_NUM_THREADS unset) and kappa-deepspeed (no hostfile; parallel.cp=2, whose
    reduce-scatter torch 2.14 calls deprecated), 2 ranks each: no warning or INFO line from the
    launchers or the ranks before pretrain's first line (megatron_kappa/cli/launcher.py and the
    entry points' megatron_kappa/entry.py). KAPPA_SHOW_WARNINGS=1 brings the launchers' notices
    back (negative control)."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "KAPPA_SHOW_WARNINGS", "OMP_NUM_THREADS")}
    base.update(TORCHDYNAMO_DISABLE="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(root))
    from megatron_kappa.parallel.launch_env import free_port
    launchers = {"torchrun": [sys.executable, "-m", "megatron_kappa.cli.launcher", "torchrun", "--standalone",
                              "--nproc_per_node", "2"],
                 "deepspeed": [sys.executable, "-m", "megatron_kappa.cli.launcher", "deepspeed", "--num_gpus", "2",
                               "--master_port", str(free_port())]}
    layouts = {"torchrun": "parallel.ep=2", "deepspeed": "parallel.cp=2"}
    for name, head in launchers.items():
        done = subprocess.run([*head, "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set", "train.steps=1",
                               "data.mock=true", f"run.dir={tmp_path / name}", "log.tensorboard=false",
                               "eval.valid_every=0", layouts[name]],
                              cwd=root, env=base, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = (done.stderr + done.stdout).splitlines()
        noisy = [x for x in lines if "warning" in x.lower() or x.startswith("W1") or "*****" in x or "[INFO]" in x
                 or "Setting OMP_NUM_THREADS" in x or "Unable to find hostfile" in x]
        assert noisy == [], f"{name}: {noisy}"
        assert any(x.startswith("step 1/1") for x in done.stdout.splitlines()), done.stdout[-2000:]
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    for name, notice in (("torchrun", "Setting OMP_NUM_THREADS"), ("deepspeed", "Unable to find hostfile")):
        loud = subprocess.run([*launchers[name], str(script)], cwd=root, env={**base, "KAPPA_SHOW_WARNINGS": "1"},
                              capture_output=True, text=True, timeout=300)
        assert loud.returncode == 0 and notice in loud.stderr + loud.stdout, (name, loud.stderr[-2000:])
        assert name != "deepspeed" or "[INFO]" in loud.stdout + loud.stderr  # the runner's level as DeepSpeed sets it


@pytest.mark.parametrize("content", ["", '{"host": "a", "pi'], ids=["empty", "garbled"])
def test_an_empty_or_garbled_lock_is_taken_over_after_a_few_seconds(tmp_path, content):
    """A start that failed while writing its lock (a full disk, a kill) left it empty or half
    written: past UNREADABLE_AFTER_S it is stale; younger, it may be a start writing it this
    instant, so the next start waits that long instead of refusing for 90 s as 'pid None'."""
    from megatron_kappa.train import run_lock
    path = tmp_path / ".lock"
    path.write_text(content)
    then = time.time() - run_lock.UNREADABLE_AFTER_S - 1
    os.utime(path, (then, then))
    lock = RunLock(tmp_path)
    lock.acquire()  # old: taken over at once
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()
    path.write_text(content)  # fresh: waited for, then taken over (nobody wrote a record meanwhile)
    start = time.time()
    RunLock(tmp_path).acquire()
    assert time.time() - start >= run_lock.UNREADABLE_AFTER_S - 0.5
    assert json.loads(path.read_text())["pid"] == os.getpid()


def test_a_lock_that_cannot_be_written_is_one_line_and_leaves_none(tmp_path, monkeypatch):
    """A full disk at start: one line naming the lock, and no empty lock left to refuse the rerun."""
    import errno

    from megatron_kappa.train import run_lock
    real_write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(run_lock.os, "write", full)
    with pytest.raises(ConfigError, match=r"run.dir: cannot write the lock .*\.lock: No space left on device$"):
        RunLock(tmp_path).acquire()
    assert not (tmp_path / ".lock").exists()
    monkeypatch.setattr(run_lock.os, "write", real_write)
    RunLock(tmp_path).acquire()  # the rerun takes it
    assert (tmp_path / ".lock").is_file()
