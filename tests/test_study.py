"""launch/study.py and analysis/study_table.py: a 2 × 2 study that finishes, is killed and resumed,
is skipped when rerun, and whose table matches its per-run files; the Slurm path against stand-in
sbatch/squeue/scancel; input errors before any run; the paired statistics."""
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_kappa.analysis import study_table

pytestmark = pytest.mark.slow  # every test launches studies of several runs

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16


def env(**extra):
    inherited = {k: v for k, v in os.environ.items()
                 if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**inherited, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": str(ROOT), **extra}


@pytest.fixture(scope="module")
def data(sample_shards):
    return sample_shards


def study_cmd(data, study_dir, *extra, launcher="torchrun", variants="swiglu,kappa", seeds="24,26", core=True):
    core_flags = ["--core-bundle", "tests/core_bundle", "--core-max-per-task", "5"] if core else ["--no-core"]
    return [sys.executable, "launch/study.py", "--config", "configs/tiny.yaml", "--dir", str(study_dir),
            "--variants", variants, "--seeds", seeds, "--launcher", launcher, *core_flags, "--valid-max-tokens", "4000",
            "--set", "data.mock=false", f"data.paths=[{','.join(data['train'])}]",
            f"data.valid_paths=[{','.join(data['valid'])}]", f"data.tokenizer={data['tokenizer']}",
            f"train.steps={STEPS}", "model.seq_length=64", "train.micro_batch=2", "train.global_batch=4",
            "log.interval=2", "checkpoint.interval=2", "eval.valid_every=0", "log.tensorboard=false",
            "model.kappa.warmup=2", *extra]


def run(cmd, timeout=1200, **kw):
    done = subprocess.run([str(c) for c in cmd], cwd=ROOT, env=kw.pop("env", env()), capture_output=True,
                          text=True, timeout=timeout, **kw)
    return done


@pytest.mark.slow
def test_study_killed_resumed_skipped_and_tabulated(data, tmp_path):
    """2 variants × 2 seeds, each run one process (--launcher python): SIGTERM to the study alone
    (`kill <pid>`, as a scheduler stops it) in its second run after a checkpoint: the study passes
    it to the run, which writes its checkpoint and exits, then says so in one line with status 143
    and leaves no process behind (it ended at once, leaving the run training; a Ctrl-C let
    subprocess.run SIGKILL the run before its checkpoint). Restarted, the first run is kept and the
    second resumes; then rerun, all skipped. Without CORE (an evaluation process less per run):
    test_study_under_deepspeed scores it with a multi-process run, and
    test_summary_statistics_and_pairing tabulates it."""
    study = tmp_path / "study"
    cmd = study_cmd(data, study, launcher="python", core=False)
    runs = study / "runs"
    proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    marker = runs / "swiglu-seed26/checkpoints/step_2/meta.json"
    deadline = time.time() + 900
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # the study only, not its process group
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 143, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith(
        "terminated (SIGTERM): swiglu-seed26: training was stopped (a training writes its checkpoint first)"), stderr
    from megatron_kappa.train.run_lock import RunLock
    assert not RunLock(runs / "swiglu-seed26").holder()  # the run ended and let go of its lock
    assert subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True).stdout == b""  # nothing left
    from megatron_kappa.checkpoint.listing import CheckpointDir
    assert CheckpointDir(runs / "swiglu-seed26").latest() >= 2 and (runs / "swiglu-seed24/result.json").is_file()
    assert not (runs / "swiglu-seed26/result.json").exists()  # stopped before it finished
    first = (runs / "swiglu-seed24/result.json").stat().st_mtime_ns

    done = run(cmd)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[swiglu-seed24] done" in done.stdout
    assert (runs / "swiglu-seed24/result.json").stat().st_mtime_ns == first
    assert "resumed from" in (runs / "swiglu-seed26/logs/train.log").read_text()
    for name in ("swiglu-seed24", "swiglu-seed26", "kappa-seed24", "kappa-seed26"):
        records = [json.loads(x) for x in (runs / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(2, STEPS + 1, 2)), name
        assert "align/layer1/mean" in records[-1] and "load/layer3/cv" in records[-1]
        assert ("kappa/layer1/top5" in records[-1]) == name.startswith("kappa")

    logs = {p: p.read_text() for p in runs.glob("*/logs/*.log")}
    again = run(cmd)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("] done") == 4
    assert {p: p.read_text() for p in runs.glob("*/logs/*.log")} == logs  # nothing ran again

    # the table: mean ± sd recomputed from the per-run files (valid.json, core.json, metrics.jsonl)
    table = json.loads((study / "table.json").read_text())
    assert not table["missing"]
    rows = {row["variant"]: row for row in table["variants"]}
    for variant in ("swiglu", "kappa"):
        valid = [json.loads((runs / f"{variant}-seed{s}/valid.json").read_text()) for s in (24, 26)]
        assert not (runs / f"{variant}-seed24/core.json").exists()  # --no-core
        for key, values in (("valid_loss", [v["loss"] for v in valid]),
                            ("bits_per_byte", [v["bits_per_byte"] for v in valid])):
            assert rows[variant][key]["mean"] == pytest.approx(statistics.mean(values), rel=1e-12)
            assert rows[variant][key]["sd"] == pytest.approx(statistics.stdev(values), rel=1e-12)
        assert rows[variant]["tokens_per_s"]["mean"] > 0
    paired = rows["kappa"]["vs_baseline"]["valid_loss"]
    diffs = [json.loads((runs / f"kappa-seed{s}/valid.json").read_text())["loss"]
             - json.loads((runs / f"swiglu-seed{s}/valid.json").read_text())["loss"] for s in (24, 26)]
    assert paired["per_seed"] == pytest.approx(diffs, rel=1e-12)
    md = (study / "table.md").read_text()
    assert f"{rows['swiglu']['valid_loss']['mean']:.4f} ± {rows['swiglu']['valid_loss']['sd']:.4f}" in md
    assert "Difference to swiglu" in md


@pytest.mark.slow
def test_study_under_deepspeed(data, tmp_path):
    """The default launcher (deepspeed, 2 processes, EP2) finishes a run with its evaluations, CORE
    too (a plain process: test_study_killed_resumed_skipped_and_tabulated; torchrun's command
    line: test_launch_commands)."""
    study = tmp_path / "deepspeed"
    done = run(study_cmd(data, study, "parallel.ep=2", "--nproc", "2", launcher="deepspeed", variants="kappa",
                         seeds="28"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((study / "runs/kappa-seed28/result.json").read_text())
    assert result["steps"] == STEPS and math.isfinite(result["valid_loss"]) and -1 <= result["core"] <= 1
    assert "Difference to" not in (study / "table.md").read_text()  # no baseline in this study


def test_launch_commands():
    """Each launcher's command line for a run of N processes (torchrun's form is the one
    tests/test_preemption.py runs; deepspeed's and python's run in the studies above)."""
    sys.path.insert(0, str(ROOT))
    from megatron_kappa.cli.study import launch_cmd
    script = str(ROOT / "launch/pretrain.py")
    assert launch_cmd("python", 1, "launch/pretrain.py", ["--config", "x.yaml"]) == \
        [sys.executable, script, "--config", "x.yaml"]
    assert launch_cmd("torchrun", 2, "launch/pretrain.py", ["--set", "a=1"]) == \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, "--set", "a=1"]
    ds = launch_cmd("deepspeed", 4, "eval/loss.py", [])
    assert ds[:5] == [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "4"] and ds[5] == "--master_port"
    assert ds[7:] == [str(ROOT / "eval/loss.py")] and 1024 <= int(ds[6]) < 65536


FAKE_SLURM = r"""#!/bin/bash
# stand-in for {name}: records its arguments, answers like Slurm
echo "{name} $*" >> "$FAKE_SLURM_LOG"
case {name} in
sbatch) n=$(cat "$FAKE_SLURM_DIR/next" 2>/dev/null || echo 100); echo $((n + 1)) > "$FAKE_SLURM_DIR/next"; echo "$n" ;;
squeue) cat "$FAKE_SLURM_DIR/queue" 2>/dev/null ;;
scancel) ;;
esac
"""


def test_slurm_submission_collection_and_resubmission(data, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("sbatch", "squeue", "scancel"):
        (bin_dir / name).write_text(FAKE_SLURM.replace("{name}", name))
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "slurm.log"
    slurm_env = env(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_SLURM_LOG=str(log), FAKE_SLURM_DIR=str(tmp_path))
    study = tmp_path / "study"
    cmd = study_cmd(data, study, "--sbatch-args", "-p cpu --time=10", launcher="slurm", seeds="24")
    done = run(cmd, env=slurm_env)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = [line for line in log.read_text().splitlines() if line.startswith("sbatch")]
    assert len(calls) == 6  # per run: training, then loss and CORE evaluation after it
    assert calls[0].startswith("sbatch --parsable -p cpu --time=10 launch/slurm/pretrain.sbatch --config")
    assert "train.seed=24" in calls[0] and "model.kappa.enabled=false" in calls[0]
    assert calls[1].startswith("sbatch --parsable -p cpu --time=10 --dependency=afterok:100 launch/slurm/eval.sbatch "
                               "loss")
    assert "--dependency=afterok:100 launch/slurm/eval.sbatch core" in calls[2]
    assert json.loads((study / "runs/swiglu-seed24/slurm.json").read_text()) == {"train": "100", "loss": "101",
                                                                                 "core": "102"}
    assert "waiting for Slurm" in done.stdout

    (tmp_path / "queue").write_text("101 Dependency\n102 Dependency\n104 Priority\n")  # still queued
    done = run(cmd, env=slurm_env)
    assert done.returncode == 0 and len([x for x in log.read_text().splitlines() if x.startswith("sbatch")]) == 6
    assert "[swiglu-seed24] queued" in done.stdout

    # swiglu's jobs finished (their files written), kappa's training failed: its evaluations wait forever
    run_dir = study / "runs/swiglu-seed24"
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": STEPS, "loss": 5.0, "tokens_per_s": 900.0}) + "\n")
    (run_dir / "valid.json").write_text(json.dumps({"loss": 5.5, "bits_per_byte": 2.0, "tokens": 4000}))
    (run_dir / "core.json").write_text(json.dumps({"core": 0.01, "core_no_boolq": 0.02}))
    (tmp_path / "queue").write_text("104 DependencyNeverSatisfied\n105 DependencyNeverSatisfied\n")
    done = run(cmd, env=slurm_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[swiglu-seed24] finished" in done.stdout and "[kappa-seed24] submitted" in done.stdout
    lines = log.read_text().splitlines()
    assert "scancel 104 105" in lines
    assert len([x for x in lines if x.startswith("sbatch")]) == 9  # kappa resubmitted
    table = json.loads((study / "table.json").read_text())
    assert table["variants"][0]["valid_loss"]["mean"] == 5.5 and table["missing"] == ["kappa-seed24"]


@pytest.mark.parametrize("args,message", [
    (["--variants", "swiglu,nope"], "--variants: unknown ['nope']"),
    (["--seeds", "24,x"], "--seeds: expected comma-separated integers"),
    (["--set", "model.kappa.U=0.5"], "model.kappa.U: must be > 1"),
    (["--set", "parallel.ep=2"], "parallel.ep: world size 1"),
    (["--no-core", "--valid-data", "/nonexistent/valid"], "--valid-data: /nonexistent/valid.bin: no such file"),
    (["--core-bundle", "/nonexistent/bundle"], "--core-bundle"),
])
def test_bad_input_fails_before_any_run(data, tmp_path, args, message):
    study = tmp_path / "study"
    cmd = study_cmd(data, study, launcher="python") + args  # later flags override the defaults
    done = run(cmd, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    assert not (study / "runs").exists()


def test_valid_data_of_another_tokenizer_is_refused_before_any_run(data, tmp_path):
    """--valid-data whose manifest records another tokenizer than data.tokenizer: one line before
    the first run (eval/loss.py would refuse it only after every run had trained); the same shards
    listed under the run's tokenizer pass (control)."""
    import shutil

    from megatron_kappa.cli import study
    for case, sha in (("other", "0" * 64), ("same", None)):
        folder = tmp_path / case
        folder.mkdir()
        name = Path(data["valid"][0]).name
        for ext in (".bin", ".idx"):
            shutil.copy(data["valid"][0] + ext, folder / (name + ext))
        manifest = json.loads((data["dir"] / "manifest.json").read_text())
        manifest["tokenizer"]["sha256"] = sha or manifest["tokenizer"]["sha256"]
        (folder / "manifest.json").write_text(json.dumps(manifest))
        args = study.parse_args([str(c) for c in study_cmd(data, tmp_path / "study", launcher="python", core=False)[2:]]
                                + ["--valid-data", str(folder / name)])
        if case == "other":
            with pytest.raises(study.ConfigError, match=rf"^--valid-data: data.tokenizer: {data['tokenizer']} is not "
                                                        rf"the tokenizer --valid-data {folder / name} was made with"):
                study.plan(args)
        else:
            assert study.plan(args)[1]["valid"] == [str(folder / name)]
    assert not (tmp_path / "study" / "runs").exists()


def test_student_t_p_value_against_numerical_integration():
    def pdf(x, df):
        c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
        return c * (1 + x * x / df) ** (-(df + 1) / 2)

    def tail(t, df, n=200_000):  # 2 ∫_|t|^∞ pdf, by Simpson's rule after x = |t| + u / (1 − u)
        h = 1.0 / n
        total = 0.0
        for i in range(n + 1):
            u = min(i * h, 1 - 1e-12)
            f = pdf(abs(t) + u / (1 - u), df) / (1 - u) ** 2
            total += f * (1 if i in (0, n) else 4 if i % 2 else 2)
        return 2 * total * h / 3

    for df in (1, 2, 3, 4, 5, 8):
        for t in (0.3, 1.0, 2.5, 7.0):
            assert study_table.student_t_two_sided_p(t, df) == pytest.approx(tail(t, df), abs=2e-6), (t, df)
    assert study_table.student_t_two_sided_p(4.302653, 2) == pytest.approx(0.05, abs=1e-6)  # t table
    assert study_table.student_t_two_sided_p(0.0, 3) == 1.0
    # negative control: the normal approximation is far off at 2 degrees of freedom
    assert abs(math.erfc(4.302653 / math.sqrt(2)) - 0.05) > 0.04


def test_summary_statistics_and_pairing():
    results = [{"variant": v, "seed": s, "valid_loss": loss, "bits_per_byte": loss / 2, "core": c,
                "tokens_per_s": 100.0}
               for v, s, loss, c in [("swiglu", 24, 3.0, 0.10), ("swiglu", 26, 3.2, 0.12), ("swiglu", 28, 3.1, 0.11),
                                     ("kappa", 24, 2.9, 0.13), ("kappa", 26, 3.15, 0.12), ("kappa", 28, 3.0, 0.14)]]
    table = study_table.summarize(results, ["swiglu", "kappa"], [24, 26, 28])
    kappa = table["variants"][1]
    assert kappa["valid_loss"]["mean"] == pytest.approx(statistics.mean([2.9, 3.15, 3.0]))
    assert kappa["valid_loss"]["sd"] == pytest.approx(statistics.stdev([2.9, 3.15, 3.0]))
    diff = kappa["vs_baseline"]["valid_loss"]
    assert diff["per_seed"] == pytest.approx([-0.1, -0.05, -0.1]) and diff["better"] == 3
    d = [-0.1, -0.05, -0.1]
    assert diff["t"] == pytest.approx(statistics.mean(d) / (statistics.stdev(d) / math.sqrt(3)))
    assert kappa["vs_baseline"]["core"]["better"] == 2  # higher CORE is better: +0.03, 0.0, +0.03
    # a seed missing from one variant drops out of the pairing, and is listed
    table = study_table.summarize(results[:-1], ["swiglu", "kappa"], [24, 26, 28])
    assert table["missing"] == ["kappa-seed28"] and table["variants"][1]["vs_baseline"]["valid_loss"]["n"] == 2
    md = study_table.markdown(table)
    assert "| kappa | 24,26 |" in md and "Not finished" in md


@pytest.mark.parametrize("flags,message", [
    (["--nproc", "0"], "argument --nproc: expected a positive integer, got '0'"),
    (["--nproc", "-1"], "argument --nproc: expected a positive integer, got '-1'"),
    (["--valid-max-tokens", "0"], "argument --valid-max-tokens: expected a positive integer"),
    (["--core-max-per-task", "-1"], "argument --core-max-per-task: expected a positive integer"),
    (["--launcher", "mpirun"], "argument --launcher: invalid choice: 'mpirun'"),
])
def test_study_numbers_are_argparse_errors(flags, message, capsys):
    from megatron_kappa.cli import study
    with pytest.raises(SystemExit) as e:
        study.parse_args(["--config", "configs/tiny.yaml", "--dir", "x", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]
    study.parse_args(["--config", "configs/tiny.yaml", "--dir", "x", "--nproc", "2"])  # a good value passes


def test_study_flags_are_checked_before_any_config(tmp_path):
    """The flags that are not config keys: one line naming the flag, before any run or config."""
    from megatron_kappa.cli import study
    (tmp_path / "file").write_text("")
    base = ["--config", str(ROOT / "configs/tiny.yaml"), "--dir", str(tmp_path / "study")]
    cases = [(["--config", str(tmp_path / "none.yaml")], "--config: " + str(tmp_path / "none.yaml") + ": no such file"),
             (["--dir", str(tmp_path / "file" / "study")],
              f"--dir: {tmp_path / 'file'} is a file, not a folder (under which {tmp_path / 'file' / 'study'} would "
              f"go)"),
             (["--sbatch-args", "-p 'gpu"], "--sbatch-args: No closing quotation in \"-p 'gpu\"")]
    for flags, message in cases:
        with pytest.raises(study.StudyError) as e:
            study._check_flags(study.parse_args([*base, *flags]))
        assert str(e.value) == message
    study._check_flags(study.parse_args(base))  # control: the same flags, good, pass
