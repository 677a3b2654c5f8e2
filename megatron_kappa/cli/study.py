"""Run a multi-seed study: every variant × seed as its own resumable run, evaluated, then a table.

    python launch/study.py --config configs/moe8.yaml --dir runs/study_moe8 \\
        --variants swiglu,kappa,kappa-no-alpha,kappa-no-bias --seeds 24,26,28 \\
        [--set key=value ...] [--launcher deepspeed|torchrun|python|slurm] [--nproc N]
        [--valid-data PREFIX ...] [--core-bundle PATH | --no-core] [--core-max-per-task N]

Variants: swiglu (model.kappa.enabled=false, the baseline), kappa, kappa-no-alpha
(model.kappa.use_alpha=false), kappa-no-bias (model.kappa.use_bias=false). Each run lives in
STUDY_DIR/runs/<variant>-seed<seed>/ (its run.dir: checkpoints, metrics.jsonl, logs/), trains
with train.seed=<seed> through launch/pretrain.py, then is evaluated with eval/loss.py
(validation loss, bits per byte on --valid-data or data.valid_paths) and eval/core.py (centered
CORE on --core-bundle or eval.core_bundle); its numbers go to result.json. STUDY_DIR/table.md and
table.json (analysis/study_table.py) hold mean ± sd per variant and the paired per-seed
difference to swiglu.

Rerunning the same command skips finished runs (a result.json) and resumes the others from their
last checkpoint; a killed study resumes the same way. SIGTERM or Ctrl-C stops the study cleanly:
the command running is passed SIGTERM and waited for (a training writes its checkpoint first),
then one line and exit status 143 (130). Every input (config per variant, data,
tokenizer, bundle, layout on --nproc processes) is checked before the first run starts.

--launcher slurm submits instead of running: per unfinished run one training job
(launch/slurm/pretrain.sbatch) and its evaluations (launch/slurm/eval.sbatch, after the training
job succeeds); the job ids go to the run's slurm.json. Run the same command again once they are
done: it collects the results, writes the table, and resubmits runs whose jobs failed.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from megatron_kappa.analysis.study_table import markdown, write_table
from megatron_kappa.cli_types import positive_int
from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.metrics.log import read_records
from megatron_kappa.paths import folder_problem

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {"swiglu": ["model.kappa.enabled=false"], "kappa": ["model.kappa.enabled=true"],
            "kappa-no-alpha": ["model.kappa.enabled=true", "model.kappa.use_alpha=false"],
            "kappa-no-bias": ["model.kappa.enabled=true", "model.kappa.use_bias=false"]}
LAUNCHERS = ("deepspeed", "torchrun", "python", "slurm")


class StudyError(RuntimeError):
    pass


class Stopped(Exception):
    """A stop signal reached the study while a run's command ran: that command was passed SIGTERM
    (a training checkpoints and exits, launch/pretrain.py) and waited for."""

    def __init__(self, signum: int, what: str):
        super().__init__(what)
        self.signum, self.what = signum, what


class _Signals:
    """SIGTERM and SIGINT while a command runs: recorded, and the command sent SIGTERM once (a
    terminal's Ctrl-C reaches it too; its handler keeps only the first). The default actions would
    end the study at once and leave the training running on, or killed by subprocess.run's SIGKILL
    0.25 s after a Ctrl-C, before its checkpoint, and a launcher killed so leaves its ranks behind."""

    def __init__(self):
        self.child, self.received = None, 0

    def __enter__(self):
        self.previous = {n: signal.signal(n, self._on) for n in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for n, handler in self.previous.items():
            signal.signal(n, handler)

    def _on(self, signum, frame):
        first = not self.received
        self.received = self.received or signum
        if first and self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)


_signals: _Signals | None = None  # set by main() while the runs go


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--config", required=True, help="YAML config shared by every run")
    ap.add_argument("--dir", required=True, help="study directory (runs/, table.md, table.json)")
    ap.add_argument("--variants", default="swiglu,kappa", help=f"comma-separated, from {', '.join(VARIANTS)}")
    ap.add_argument("--seeds", default="24,26,28", help="comma-separated training seeds (paper: 24,26,28)")
    ap.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="config overrides for every run")
    ap.add_argument("--kappa-set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="config overrides for the κ variants only, after --set (the paper configs already "
                         "give the κ arm 14c9b04's halved aux loss: model.moe.aux_loss null; docs/recipe.md)")
    ap.add_argument("--launcher", choices=LAUNCHERS, default="deepspeed")
    ap.add_argument("--nproc", type=positive_int, default=None,
                    help="processes per run (default: the visible GPUs, else 1); slurm: set by --sbatch-args")
    ap.add_argument("--valid-data", nargs="+", default=None, metavar="PREFIX",
                    help="held-out shard prefixes for eval/loss.py (default: data.valid_paths)")
    ap.add_argument("--valid-max-tokens", type=positive_int, default=None,
                    help="score at most this many validation tokens")
    ap.add_argument("--core-bundle", default=None, help="CORE bundle (default: eval.core_bundle)")
    ap.add_argument("--core-max-per-task", type=positive_int, default=None, help="CORE items per task (default: all)")
    ap.add_argument("--no-core", action="store_true", help="no CORE evaluation (the column stays empty)")
    ap.add_argument("--sbatch-args", default="", help="extra sbatch options for every job (slurm), e.g. "
                                                      "'-p gpu --time=2-00:00:00'")
    return ap.parse_args(argv)


def _split(text: str, what: str, cast=str) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise StudyError(f"--{what}: empty")
    try:
        items = [cast(t) for t in items]
    except ValueError:
        raise StudyError(f"--{what}: expected comma-separated integers, got {text!r}") from None
    if len(set(items)) != len(items):
        raise StudyError(f"--{what}: repeated entries in {text!r}")
    return items


class Run:
    """One variant × seed: its directory, overrides and files."""

    def __init__(self, study: Path, variant: str, seed: int, sets: list[str]):
        self.variant, self.seed = variant, seed
        self.name = f"{variant}-seed{seed}"
        self.dir = (study / "runs" / self.name).resolve()
        self.sets = [*sets, *VARIANTS[variant], f"train.seed={seed}", f"run.dir={self.dir}"]
        self.result, self.trained = self.dir / "result.json", self.dir / "logs" / "train.done"
        self.valid, self.core = self.dir / "valid.json", self.dir / "core.json"


def variant_sets(args, variant: str) -> list[str]:
    """The overrides of a variant's runs: --set, then --kappa-set for the κ variants."""
    return [*args.set, *(args.kappa_set if VARIANTS[variant] != VARIANTS["swiglu"] else [])]


def _check_flags(args):
    """The flags that are not config keys: one line each, before any config is read."""
    if not Path(args.config).is_file():
        raise StudyError(f"--config: {args.config}: no such file")
    problem = folder_problem(Path(args.dir).resolve())
    if problem:
        raise StudyError(f"--dir: {problem}")
    try:
        shlex.split(args.sbatch_args)
    except ValueError as e:
        raise StudyError(f"--sbatch-args: {e} in {args.sbatch_args!r}") from None


def plan(args) -> tuple[list[Run], dict]:
    """Check every input before anything runs; returns the runs and the evaluation inputs."""
    _check_flags(args)
    variants = _split(args.variants, "variants")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise StudyError(f"--variants: unknown {unknown} (expected some of {list(VARIANTS)})")
    seeds = _split(args.seeds, "seeds", int)
    study = Path(args.dir)
    runs = [Run(study, v, s, variant_sets(args, v)) for v in variants for s in seeds]
    from megatron_kappa.data.blend import parse_blend
    from megatron_kappa.preflight import check_data, check_run_dir, check_tokenizer, preflight
    nproc = args.nproc or _visible_gpus() or 1
    cfgs = {}
    for run in runs:
        cfg = load_config(args.config, run.sets)  # ConfigError names the key
        if args.launcher == "slurm":  # the world is the job's: only the world-free checks here
            check_run_dir(cfg.run)
            check_data(cfg.data, cfg.model.vocab_size)
            check_tokenizer(cfg.data, cfg.model.vocab_size)
        else:
            preflight(cfg, world=1 if args.launcher == "python" else nproc)
        cfgs[run.name] = cfg
    cfg = cfgs[runs[0].name]
    valid = [os.path.abspath(p) for p in (args.valid_data or parse_blend(cfg.data.valid_paths)[0])]
    if not valid:
        raise StudyError("no validation shards: give --valid-data PREFIX ... or set data.valid_paths")
    for prefix in valid:
        for ext in (".bin", ".idx"):
            if not Path(prefix + ext).is_file():
                raise StudyError(f"--valid-data: {prefix}{ext}: no such file")
    if not cfg.data.tokenizer:
        raise StudyError("data.tokenizer: not set (bits per byte and CORE need the tokenizer)")
    if args.valid_data:  # data.valid_paths were checked with the config; bits per byte from another
        from megatron_kappa.data.made_with import check_made_with  # tokenizer's ids would be wrong
        check_made_with(cfg.data.tokenizer, valid, "--valid-data", "--valid-data: data.tokenizer")
    bundle = None if args.no_core else (args.core_bundle or cfg.eval.core_bundle)
    if bundle and "://" not in bundle:
        bundle = os.path.abspath(bundle)
    if not args.no_core:
        if not bundle:
            raise StudyError("no CORE bundle: give --core-bundle PATH, set eval.core_bundle, or pass --no-core")
        from megatron_kappa.evaluation.bundle import BundleError, load_bundle
        try:
            load_bundle(bundle)
        except BundleError as e:
            raise StudyError(f"--core-bundle: {e}") from None
    spec = {"config": str(Path(args.config).resolve()), "set": args.set, "kappa_set": args.kappa_set,
            "variants": variants, "seeds": seeds,
            "title": f"{Path(args.config).name}: {len(variants)} variants × {len(seeds)} seeds"}
    _check_same_study(study, spec)
    return runs, {"valid": valid, "bundle": bundle, "nproc": nproc, "spec": spec}


def _check_same_study(study: Path, spec: dict):
    """A study directory belongs to one config and one set of overrides (variants and seeds may grow)."""
    path = study / "study.json"
    if path.is_file():
        old = json.loads(path.read_text())
        for key in ("config", "set", "kappa_set"):
            if old.get(key, []) != spec[key]:
                raise StudyError(f"--dir {study}: made with {key} {old.get(key, [])!r}, now {spec[key]!r}; "
                                 "use another --dir for another study")
    study.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, json.dumps(spec, indent=1) + "\n")


def _visible_gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _atomic_write(path: Path, text: str):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if not _visible_gpus():
        env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's launcher needs it on a CPU-only machine
    return env


def launch_cmd(launcher: str, nproc: int, script: str, args: list) -> list[str]:
    py = sys.executable
    if launcher == "python":
        head = [py]
    elif launcher == "torchrun":
        head = [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    else:
        from megatron_kappa.parallel.launch_env import free_port
        head = [py, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port", str(free_port())]
    return [*head, str(ROOT / script), *map(str, args)]


def eval_args(run: Run, inputs: dict, args, valid_json, core_json) -> dict:
    """Arguments of eval/loss.py and eval/core.py for this run (None: nothing to do)."""
    loss = ["--checkpoint", run.dir, "--data", *inputs["valid"], "--no-progress", "--json", valid_json]
    if args.valid_max_tokens:
        loss += ["--max-tokens", args.valid_max_tokens]
    core = None
    if inputs["bundle"]:
        core = ["--checkpoint", run.dir, "--bundle", inputs["bundle"], "--no-progress", "--json", core_json]
        if args.core_max_per_task:
            core += ["--max-per-task", args.core_max_per_task]
    return {"loss": loss, "core": core}


def _step(cmd: list[str], log: Path, what: str):
    if _signals is not None and _signals.received:  # a stop signal between two commands: start none
        raise Stopped(_signals.received, what)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(f"\n=== {time.strftime('%F %T')} $ {shlex.join(cmd)}\n")
        f.flush()
        start = f.tell()
        child = subprocess.Popen(cmd, env=_env(), stdout=f, stderr=subprocess.STDOUT)  # relative paths: as given
        if _signals is not None:
            _signals.child = child
            if _signals.received and child.poll() is None:  # it came as the command started
                child.send_signal(signal.SIGTERM)
        child.wait()
    if _signals is not None and _signals.received:
        raise Stopped(_signals.received, what)
    if child.returncode:
        with log.open("rb") as f:  # this attempt's last lines, so the reason shows where the error does
            f.seek(start)
            lines = [ln for ln in f.read().decode(errors="replace").splitlines()
                     if ln.strip() and "warn" not in ln.lower()][-12:]
        print("\n".join(f"  | {ln}" for ln in lines), file=sys.stderr, flush=True)
        raise StudyError(f"{what} failed (exit status {child.returncode}); see {log}")


def run_locally(run: Run, inputs: dict, args):
    """Train (resuming), evaluate, write result.json; each finished piece is kept on a rerun."""
    n = 1 if args.launcher == "python" else inputs["nproc"]
    if not run.trained.is_file():
        print(f"[{run.name}] train → {run.dir}", flush=True)
        _step(launch_cmd(args.launcher, n, "launch/pretrain.py", ["--config", inputs["spec"]["config"], "--set",
                                                                   *run.sets]),
              run.dir / "logs/train.log", f"{run.name}: training")
        _atomic_write(run.trained, time.strftime("%F %T\n"))
    tmp_valid, tmp_core = run.valid.with_suffix(".json.tmp"), run.core.with_suffix(".json.tmp")
    cmds = eval_args(run, inputs, args, tmp_valid, tmp_core)
    for kind, final, tmp in (("loss", run.valid, tmp_valid), ("core", run.core, tmp_core)):
        if cmds[kind] is None or final.is_file():
            continue
        print(f"[{run.name}] eval {kind}", flush=True)
        _step(launch_cmd(args.launcher, n, f"eval/{kind}.py", cmds[kind]), run.dir / "logs/eval.log",
              f"{run.name}: eval/{kind}.py")
        os.replace(tmp, final)  # a killed evaluation leaves no half-written result
    write_result(run, inputs)


def write_result(run: Run, inputs: dict) -> dict:
    records, _ = read_records(run.dir / "metrics.jsonl")
    valid = json.loads(run.valid.read_text())
    core = json.loads(run.core.read_text()) if inputs["bundle"] else {}
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    result = {"variant": run.variant, "seed": run.seed, "run_dir": str(run.dir), "steps": records[-1]["step"],
              "final_train_loss": records[-1]["loss"], "valid_loss": valid["loss"],
              "bits_per_byte": valid["bits_per_byte"], "valid_tokens": valid["tokens"],
              "core": core.get("core"), "core_no_boolq": core.get("core_no_boolq"),
              # the first window holds the start-up (allocation, first-call costs): left out when there are more
              "tokens_per_s": statistics.median(speeds[1:] or speeds) if speeds else None,
              "tokens_seen": records[-1].get("tokens_seen")}
    _atomic_write(run.result, json.dumps(result, indent=1) + "\n")
    return result


# --- Slurm ----------------------------------------------------------------------------------

def _sbatch(args, script: str, words: list, after: str | None = None) -> str:
    cmd = ["sbatch", "--parsable", *shlex.split(args.sbatch_args)]
    if after:
        cmd.append(f"--dependency=afterok:{after}")
    cmd += [script, *map(str, words)]
    # submitted from the repository root, where the job scripts run (relative paths: from there)
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if done.returncode:
        raise StudyError(f"sbatch failed (exit status {done.returncode}): {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]


def _queued(ids: list[str]) -> dict:
    """{job id: reason} of the jobs Slurm still holds (pending or running)."""
    done = subprocess.run(["squeue", "-h", "-o", "%i %r", "-j", ",".join(ids)], capture_output=True, text=True)
    if done.returncode:  # squeue refuses ids it has forgotten: then none of them is queued
        return {}
    return dict(line.split(None, 1) if " " in line else (line, "") for line in done.stdout.split("\n") if line.strip())


def submit(run: Run, inputs: dict, args) -> str:
    """Collect a finished run, leave a queued one alone, (re)submit the rest. Returns its state."""
    jobs_file = run.dir / "slurm.json"
    jobs = json.loads(jobs_file.read_text()) if jobs_file.is_file() else {}
    queued = _queued(list(jobs.values())) if jobs else {}
    if queued and not any("DependencyNeverSatisfied" in reason for reason in queued.values()):
        return "queued"
    if queued:  # the training job failed: its evaluations would wait forever
        subprocess.run(["scancel", *queued], capture_output=True)
    if run.valid.is_file() and (run.core.is_file() or not inputs["bundle"]):
        write_result(run, inputs)
        return "finished"
    run.dir.joinpath("logs").mkdir(parents=True, exist_ok=True)
    train = _sbatch(args, "launch/slurm/pretrain.sbatch", ["--config", inputs["spec"]["config"], "--set", *run.sets])
    cmds = eval_args(run, inputs, args, run.valid, run.core)
    jobs = {"train": train}
    for kind in ("loss", "core"):
        if cmds[kind] is not None:
            jobs[kind] = _sbatch(args, "launch/slurm/eval.sbatch", [kind, *cmds[kind]], after=train)
    _atomic_write(jobs_file, json.dumps(jobs) + "\n")
    return "submitted"


def main(argv=None) -> int:
    global _signals
    args = parse_args(argv)
    try:
        with _Signals() as _signals:
            return _main(args)
    except Stopped as e:  # worded as every command line's (megatron_kappa/entry.py run_command)
        how = "terminated (SIGTERM)" if e.signum == signal.SIGTERM else "interrupted"
        print(f"{how}: {e.what} was stopped (a training writes its checkpoint first); the same command resumes "
              "the study", file=sys.stderr, flush=True)
        return 128 + e.signum
    finally:
        _signals = None


def _main(args) -> int:
    try:
        runs, inputs = plan(args)
        spec = inputs["spec"]
        states = {}
        for run in runs:
            if run.result.is_file():
                print(f"[{run.name}] done", flush=True)
                states[run.name] = "finished"
            elif args.launcher == "slurm":
                states[run.name] = submit(run, inputs, args)
                print(f"[{run.name}] {states[run.name]}", flush=True)
            else:
                run_locally(run, inputs, args)
                states[run.name] = "finished"
        table = write_table(Path(args.dir), spec["variants"], spec["seeds"], spec["title"])
    except (ConfigError, StudyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n" + markdown(table, spec["title"]), end="")
    pending = [n for n, s in states.items() if s != "finished"]
    print(f"\ntable: {Path(args.dir) / 'table.md'} and table.json"
          + (f"; waiting for Slurm: {', '.join(pending)} (run this command again when the jobs are done)"
             if pending else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
