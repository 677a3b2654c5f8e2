"""The GPU check: what someone with one GPU runs (`make gpu-check`), in about 5 minutes.

    python bench/gpu_check.py [--out runs/gpu_check] [--quick]
    python bench/gpu_check.py --cpu --quick      # the same stages on the CPU (CI runs this)

Stages, each a separate process with a time limit, each recorded whether it passes or fails:
  1. environment: torch, CUDA device, Triton, megatron-core and DeepSpeed (from .venv or from
     PYTHONPATH, e.g. `.gpu/site` made by ../shared/tools/gpu-carry);
  2. the `gpu`-marked tests (tests/test_gpu.py, the compiled Triton kernels);
  3. the main command: configs/tiny.yaml in bf16 for a few dozen steps with a checkpoint, killed
     after the checkpoint and resumed, against an uninterrupted run (train.deterministic);
  4. evaluation of that checkpoint: CORE on tests/core_bundle and loss / bits per byte; the
     profiler and memory in training (`profile`): steps 3-4 traced, on CUDA with their kernels, a
     memory snapshot and the peak allocated/reserved memory in metrics.jsonl and the step line
     (the peak RSS on the CPU);
  5. the benchmarks: bench/kappa_activation.py, bench/model_step.py (the expert variants, then
     bf16 against fp8), bench/activation_memory.py (the planner's activation estimate against
     the allocator; GPU only), bench/plan_rates.py (the GEMM, grouped-GEMM and attention rates
     and the per-layer fixed cost behind the planner's step time) and bench/throughput.py at the
     paper's moe8 / sandwich28 shapes (tiny shapes with --quick or --cpu), and bench/compile.py
     (model.compile against eager in bf16 with MFU, κ against plain SwiGLU both compiled).
  6. the EP overlap (bench/ep_overlap.py: parallel.overlap_moe_expert_parallel_comm on and off)
     over every GPU, EP = their number; with one GPU it is recorded as not run (megatron refuses
     the overlap at EP 1, and NCCL puts one rank on a GPU); with --cpu, 2 gloo ranks.
It writes <out>/report.json and <out>/report.md (paste the latter into docs/benchmarks.md).
"""
from __future__ import annotations

from megatron_kappa.entry import start

start()  # first: the known library notices filtered before the imports below can print (megatron_kappa/entry.py)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["data.mock=true", "model.seq_length=128", "train.micro_batch=4", "train.global_batch=8",
         "log.interval=1", "eval.valid_every=0", "log.tensorboard=false", "train.deterministic=true",
         "model.kappa.freeze_fraction=0.25", "model.kappa.warmup=5"]


class Check:
    def __init__(self, out: Path, cpu: bool):
        self.out, self.cpu, self.stages = out, cpu, []
        device = "cpu" if cpu else "cuda"
        self.env = {**os.environ, "MEGATRON_KAPPA_DEVICE": device, "DS_ACCELERATOR": device,
                    "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p),
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if cpu else "8")}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            self.env.pop(k, None)
        if cpu:
            self.env["TORCHDYNAMO_DISABLE"] = "1"
        else:  # the Makefile exports CPU settings for its CPU targets: not for the GPU
            for k in ("TRITON_INTERPRET", "TORCHDYNAMO_DISABLE"):
                self.env.pop(k, None)

    def run(self, name: str, cmd: list, timeout: int, parse=None, **kw) -> dict:
        print(f"== {name}: {' '.join(map(str, cmd))}", flush=True)
        start = time.time()
        try:
            done = subprocess.run([str(c) for c in cmd], cwd=ROOT, env=self.env, capture_output=True,
                                  text=True, timeout=timeout, **kw)
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            out = e.stdout or b""
            code, output = "timeout", out.decode(errors="replace") if isinstance(out, bytes) else str(out)
        stage = {"name": name, "ok": code == 0, "returncode": code, "seconds": round(time.time() - start, 1),
                 "command": " ".join(map(str, cmd)), "tail": output[-3000:]}
        if parse is not None and code == 0:
            try:
                stage["result"] = parse(output)
            except Exception as e:  # a report with what failed beats no report
                stage.update(ok=False, parse_error=repr(e))
        print(f"   {'ok' if stage['ok'] else 'FAILED'} in {stage['seconds']} s", flush=True)
        self.stages.append(stage)
        return stage


def losses(run_dir: Path) -> list:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main_command(check: Check, steps: int, out: Path):
    """Straight run vs a run killed after its first checkpoint and resumed."""
    sets = TRAIN + [f"train.steps={steps}", f"checkpoint.interval={steps // 2}", "precision=bf16"]
    straight, killed = out / "straight", out / "killed"
    def cmd(d):
        return [sys.executable, "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set",
                f"run.dir={d}", *sets]
    check.run("train: uninterrupted", cmd(straight), 600)
    start = time.time()
    proc = subprocess.Popen([str(c) for c in cmd(killed)], cwd=ROOT, env=check.env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    marker = killed / f"checkpoints/step_{steps // 2}/meta.json"
    while not marker.exists() and proc.poll() is None and time.time() - start < 600:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = check.run("train: killed after the checkpoint, resumed", cmd(killed), 600)
    ok = marker.exists() and resumed["ok"] and (straight / "metrics.jsonl").exists()
    record = {"name": "train: resume is exact", "ok": False, "seconds": 0.0}
    if ok:
        a, b = losses(straight), losses(killed)
        last = json.loads((straight / "metrics.jsonl").read_text().splitlines()[-1])
        record.update(ok=a == b and len(a) == steps, result={
            "losses_equal": a == b, "steps": len(a), "first_loss": a[0], "last_loss": a[-1],
            "tokens_per_s": last.get("tokens_per_s"), "tflops_per_gpu": last.get("tflops_per_gpu"),
            "mfu": last.get("mfu")})
    check.stages.append(record)
    return straight


EVAL = """
import json, sys
from megatron_kappa.evaluation.loading import load_model_for_eval
from megatron_kappa.evaluation.core import evaluate_core
from megatron_kappa.evaluation.lm_loss import validation_loss
from megatron_kappa.bench.toy import ByteTokenizer
fn, cfg = load_model_for_eval(sys.argv[1])
tok = ByteTokenizer()
core = evaluate_core(fn, tok, "tests/core_bundle", 128, max_per_task=20, progress=False)
docs = [[5 + (i * 7 + j) % 250 for j in range(300)] + [tok.eod] for i in range(16)]
print(json.dumps({"core": core["core"], "device": str(fn.device), **validation_loss(fn, docs, tok, 128)}))
"""


def profiled_run(check: Check, out: Path):
    """The main command with profile.steps [3, 4] and a memory snapshot (megatron_kappa.train.profiling)."""
    run_dir = out / "profiled"
    sets = TRAIN + ["train.steps=5", "checkpoint.interval=5", "profile.steps=[3,4]", "profile.memory_snapshot=true",
                    "precision=bf16"]
    check.run("train: profiler and memory", [sys.executable, "launch/pretrain.py", "--config", "configs/tiny.yaml",
                                             "--set", f"run.dir={run_dir}", *sets], 600,
              lambda o: profile_result(run_dir, o, check.cpu))


def profile_result(run_dir: Path, output: str, cpu: bool) -> dict:
    """What the profiled run must leave: a trace of steps 3 and 4 only (with CUDA kernels on a GPU),
    on a GPU the memory snapshot of those steps and peak allocated ≤ reserved memory in every
    record and step line (with TFLOP/s/GPU), on the CPU the peak RSS and no snapshot. Anything
    else raises, which marks the stage failed."""
    import pickle
    folder = Path(run_dir) / "profile"
    trace = folder / "rank0_steps3-4.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    steps = sorted({e["name"] for e in events if str(e.get("name", "")).startswith("step ")})
    if steps != ["step 3", "step 4"]:
        raise ValueError(f"{trace}: step ranges {steps}, expected step 3 and step 4 only")
    kernels = sum(e.get("cat") == "kernel" for e in events)
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    lines = [line for line in output.splitlines() if line.startswith("step ")]
    snapshot = folder / "rank0_steps3-4.memory.pickle"
    if not records or len(lines) != len(records):
        raise ValueError(f"{len(records)} records, {len(lines)} step lines")
    if cpu:
        if snapshot.exists() or any("TFLOP" in line or " rss " not in line for line in lines) or \
                not all(r.get("mem_peak_rss_gib", 0) > 0 for r in records):
            raise ValueError("on the CPU: the peak RSS in every record and step line, no snapshot, no TFLOP/s")
        return {"steps": steps, "peak_rss_gib": max(r["mem_peak_rss_gib"] for r in records)}
    if not kernels:
        raise ValueError(f"{trace}: no CUDA kernel events")
    if not all(0 < r.get("mem_peak_alloc_gib", 0) <= r.get("mem_peak_reserved_gib", 0) for r in records):
        raise ValueError("on a GPU every record needs 0 < mem_peak_alloc_gib <= mem_peak_reserved_gib")
    if not all("TFLOP/s/GPU" in line and " mem " in line for line in lines):
        raise ValueError(f"step lines without TFLOP/s/GPU or mem: {lines[:1]}")
    memory = pickle.loads(snapshot.read_bytes())
    traced = sum(len(t) for t in memory.get("device_traces", []))
    if not memory.get("segments") or not traced:
        raise ValueError(f"{snapshot}: no segments or no allocator events")
    return {"steps": steps, "kernels": kernels, "snapshot_events": traced,
            "peak_alloc_gib": max(r["mem_peak_alloc_gib"] for r in records),
            "peak_reserved_gib": max(r["mem_peak_reserved_gib"] for r in records)}


def gpu_tests_result(output: str, cpu: bool) -> dict:
    """The counts of pytest's closing line for the gpu-marked tests. On a GPU every one must run
    and pass (a stage of skips checks nothing); on the CPU (--cpu) every one must be collected and
    skipped for want of CUDA. Anything else raises, which marks the stage failed."""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", output)}
    passed, skipped = counts.get("passed", 0), counts.get("skipped", 0)
    if cpu:
        if passed or not skipped or "needs CUDA" not in output:
            raise ValueError(f"on the CPU every gpu-marked test should skip for want of CUDA: {counts}")
    elif skipped or not passed or set(counts) - {"passed", "deselected"}:
        raise ValueError(f"on a GPU every gpu-marked test must run and pass: {counts}")
    return counts


def last_json(output: str):
    return json.loads([line for line in output.splitlines() if line.startswith("{") or line.startswith("[")][-1])


def ep_overlap(check: Check, out: Path, small: bool):
    """Stage 6: bench/ep_overlap.py under torchrun, one rank per GPU (2 gloo ranks with --cpu)."""
    py = sys.executable
    if check.cpu:
        ranks = 2
    else:
        count = subprocess.run([py, "-c", "import torch; print(torch.cuda.device_count())"], cwd=ROOT,
                               env=check.env, capture_output=True, text=True, timeout=300)
        ranks = int(count.stdout.strip().splitlines()[-1]) if count.returncode == 0 else 0
    name = "bench: EP overlap on/off"
    if ranks < 2:
        check.stages.append({"name": name, "ok": True, "seconds": 0.0, "not_run": (
            f"{ranks} GPU: the overlap hides the expert all-to-all, which needs EP >= 2 ranks, one per GPU")})
        print(f"== {name}: not run ({ranks} GPU)", flush=True)
        return
    config = ["--config", "configs/tiny.yaml", "--micro-batch", "2", "--set", "model.seq_length=64"] if small else \
        ["--config", "configs/moe8.yaml", "--micro-batch", "4"]
    target = out / "ep_overlap.json"
    check.run(name, [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                     "bench/ep_overlap.py", *config, "--json", target], 900, lambda o: json.loads(target.read_text()))


def write_report(check: Check, out: Path):
    report = {"when": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(), "stages": check.stages}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    lines = [f"# GPU check, {report['when']}", "", "| stage | result | seconds |", "|---|---|---|"]
    for s in check.stages:
        result = f"not run: {s['not_run']}" if "not_run" in s else "ok" if s["ok"] else "FAILED"
        lines.append(f"| {s['name']} | {result} | {s['seconds']} |")
    for s in check.stages:
        if "result" in s:
            lines += ["", f"## {s['name']}", "", "```", json.dumps(s["result"], indent=1)[:6000], "```"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print(f"report: {out / 'report.md'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/gpu_check")
    ap.add_argument("--quick", action="store_true", help="small shapes and few steps")
    ap.add_argument("--cpu", action="store_true", help="run the stages on the CPU (a check of this script)")
    args = ap.parse_args(argv)
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, args.cpu)
    py = sys.executable
    check.run("environment", [py, "-c", (
        "import json, torch, triton, megatron.core, deepspeed; d = torch.cuda.is_available(); "
        "print(json.dumps({'torch': torch.__version__, 'triton': triton.__version__, "
        "'megatron_core': megatron.core.__version__, 'megatron_from': megatron.core.__file__, "
        "'deepspeed': deepspeed.__version__, 'cuda': d, "
        "'device': torch.cuda.get_device_name(0) if d else 'cpu', "
        "'capability': torch.cuda.get_device_capability(0) if d else None}))")], 300, last_json)
    check.run("gpu-marked tests", [py, "-m", "pytest", "-q", "-m", "gpu", "-rs", "tests/test_gpu.py",
                                   "tests/test_kappa_triton.py"], 1200,
              lambda o: gpu_tests_result(o, args.cpu))
    run_dir = main_command(check, 8 if args.quick else 40, out)
    check.run("evaluation: CORE, loss and bits per byte", [py, "-c", EVAL, str(run_dir)], 600, last_json)
    profiled_run(check, out)
    small = args.quick or args.cpu
    benches = [
        ("bench: κ activation", ["bench/kappa_activation.py", "--dtype", "fp32" if args.cpu else "bf16"]
         + (["--tokens", "2048", "--ffn", "512", "--reps", "2"] if small else
            ["--tokens", "32768", "65536", "--ffn", "3072", "4096", "--reps", "20"])),
        ("bench: model forward+backward", ["bench/model_step.py"]
         + (["--config", "configs/tiny.yaml", "--reps", "2"] if small else
            ["--config", "configs/moe8.yaml", "--set", "parallel.ep=1", "--micro-batch", "4"])),
        ("bench: model bf16 vs fp8", ["bench/model_step.py", "--precisions", "bf16", "fp8"]
         + (["--config", "configs/tiny.yaml", "--reps", "2"] if small else
            ["--config", "configs/moe8.yaml", "--set", "parallel.ep=1", "--micro-batch", "4"])),
        ("bench: activation memory vs the planner", ["bench/activation_memory.py"]
         + (["--config", "configs/tiny.yaml"] if small else ["--config", "configs/moe8.yaml", "--micro-batch", "4"])),
        ("bench: planner rates", ["bench/plan_rates.py"] + (["--quick"] if small else [])),
        ("bench: checkpoint async vs sync", ["bench/checkpoint_async.py"]  # on a GPU: pinned host buffers
         + (["--shape", "tiny", "--steps", "6", "--interval", "2"] if small else ["--writer-probe"])),
        ("bench: throughput moe8", ["bench/throughput.py"]
         + (["--config", "configs/tiny.yaml", "--steps", "2"] if small else
            ["--config", "configs/moe8.yaml", "--micro-batch", "4", "--recompute", "none", "selective"])),
        # model.compile: compiled vs eager (bf16 on the GPU, with MFU), κ vs plain both compiled
        ("bench: compiled vs eager", ["bench/compile.py", "--kappa-vs-plain"]
         + (["--cases", "tiny", "--reps", "2"] if small else
            ["--config", "configs/moe8.yaml", "--set", "parallel.ep=1", "--precision", "bf16", "--micro-batch", "4"])),
    ]
    if not small:
        benches.append(("bench: throughput sandwich28 (8 layers)",
                        ["bench/throughput.py", "--config", "configs/sandwich28.yaml", "--layers", "8",
                         "--micro-batch", "2"]))
    for name, cmd in benches:
        target = out / (name.split(": ")[1].replace(" ", "_").replace("+", "_") + ".json")
        check.run(name, [py, *cmd, "--json", target], 900,
                  lambda o, t=target: json.loads(t.read_text()))
    ep_overlap(check, out, small)
    write_report(check, out)
    return 0 if all(s["ok"] for s in check.stages) else 1


if __name__ == "__main__":
    from megatron_kappa.entry import start
    start()  # first: the known library notices filtered (megatron_kappa/entry.py)
    sys.exit(main())
