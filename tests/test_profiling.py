"""The profiler and memory in training (`profile`, megatron_kappa.train.profiling and
megatron_kappa.metrics.memory) and the step line's time, ETA and final line
(megatron_kappa.metrics.step_line).

A profiled run's Chrome trace holds `step <n>` ranges of the chosen steps only, each with its
forward, backward and optimizer ranges and the operators inside; the peak RSS in metrics.jsonl is
the kernel's own peak (VmHWM of /proc/self/status). The CUDA path (NVTX, peak allocated/reserved,
the memory snapshot) runs in bench/gpu_check.py's profile stage; here every torch.cuda and
torch.profiler name its source reads is checked to exist in the installed torch."""
import ast
import json
import resource
from collections import Counter
from pathlib import Path

import pytest
import torch

from megatron_kappa.config import ProfileConfig, load_config
from megatron_kappa.metrics import memory
from megatron_kappa.metrics.log import read_records
from megatron_kappa.metrics.memory import GIB, memory_words, peak_memory
from megatron_kappa.metrics.step_line import clock, done_line, step_line
from megatron_kappa.train import profiling

CPU = torch.device("cpu")
SETS = ["data.mock=true", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=4",
        "eval.valid_every=0", "log.interval=1", "checkpoint.interval=100", "log.tensorboard=false"]


def trace_names(path) -> Counter:
    return Counter(e.get("name") for e in json.loads(Path(path).read_text())["traceEvents"])


def fake_steps(profiler, first, last):
    """Steps first..last, each a forward matmul, a backward and an optimizer region."""
    w = torch.randn(16, 16, requires_grad=True)
    for n in range(first, last + 1):
        profiler.begin_step(n)
        with profiling.region("forward"):
            loss = (torch.randn(8, 16) @ w).square().mean()
        with profiling.region("backward"):
            loss.backward()
        with profiling.region("optimizer"):
            w.data.add_(w.grad, alpha=-0.1)
    profiler.close()


def test_the_trace_holds_the_chosen_steps_only(tmp_path):
    lines = []
    fake_steps(profiling.StepProfiler(ProfileConfig(steps=[3, 4]), tmp_path, 0, CPU, lines.append), 1, 6)
    (trace,) = (tmp_path / "profile").iterdir()
    assert trace.name == "rank0_steps3-4.pt.trace.json"
    names = trace_names(trace)
    assert sorted(n for n in names if n.startswith("step ")) == ["step 3", "step 4"]
    assert names["forward"] == names["backward"] == names["optimizer"] == 2
    assert names["aten::mm"] >= 2  # the operators inside the ranges
    assert lines == [f"profile: steps 3-4 of rank 0: {trace}"]
    assert not profiling._recording and not profiling._nvtx  # nothing left on after the run


def test_other_ranks_a_run_that_ends_early_and_no_profile(tmp_path):
    """Negative controls: a rank not listed writes nothing, nor does a run without profile.steps;
    a run that ends inside the window writes the steps it ran; a resume past the window's start
    traces from its first step."""
    fake_steps(profiling.StepProfiler(ProfileConfig(steps=[3, 4], ranks=[1]), tmp_path / "r0", 0, CPU), 1, 6)
    fake_steps(profiling.StepProfiler(ProfileConfig(), tmp_path / "off", 0, CPU), 1, 6)
    assert not (tmp_path / "r0").exists() and not (tmp_path / "off").exists()
    fake_steps(profiling.StepProfiler(ProfileConfig(steps=[3, 9]), tmp_path / "short", 0, CPU), 1, 5)
    (trace,) = (tmp_path / "short" / "profile").iterdir()
    assert trace.name == "rank0_steps3-5.pt.trace.json"
    assert sorted(n for n in trace_names(trace) if n.startswith("step ")) == ["step 3", "step 4", "step 5"]
    fake_steps(profiling.StepProfiler(ProfileConfig(steps=[3, 5]), tmp_path / "resumed", 0, CPU), 4, 8)
    (trace,) = (tmp_path / "resumed" / "profile").iterdir()
    assert sorted(n for n in trace_names(trace) if n.startswith("step ")) == ["step 4", "step 5"]


@pytest.mark.parametrize("sets, message", [
    (["profile.steps=[3]"], "config: profile.steps: expected [] or [first, last] with 1 <= first <= last, got [3]"),
    (["profile.steps=[4, 3]"], "config: profile.steps: expected [] or [first, last]"),
    (["profile.steps=[0, 3]"], "config: profile.steps: expected [] or [first, last]"),
    (["profile.ranks=[-1]"], "config: profile.ranks: expected a list of global ranks"),
    # issue 62: past the run's end nothing was traced, without a word ([50, 60] of 50 steps: control, below)
    (["profile.steps=[51, 60]", "train.steps=50"],
     "config: profile.steps: [51, 60] starts after the run's last step"),
    (["log.wandb.mode=cloud"], "config: log.wandb.mode: expected one of ['disabled', 'offline', 'online']"),
])
def test_bad_profile_and_wandb_settings_are_one_line(sets, message):
    from megatron_kappa.config import ConfigError
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config("configs/tiny.yaml", sets)


def test_profile_steps_past_the_token_budgets_end_are_refused_by_the_trainer(world1, tmp_path):
    """With train.steps null the run's length is the token budget's, known once the model is built:
    the config loads (it was a TypeError traceback) and the trainer refuses the window in one line
    before training (no checkpoint written); control: a window that starts at the last step is kept."""
    from megatron_kappa.config import ConfigError
    from megatron_kappa.train import loop
    sets = ["train.steps=null", "data.mock=true", "model.seq_length=16", "log.tensorboard=false",
            "eval.valid_every=0", f"run.dir={tmp_path}"]
    cfg = load_config("configs/tiny.yaml", [*sets, "profile.steps=[100000, 100001]"])
    with pytest.raises(ConfigError, match=r"^config: profile\.steps: \[100000, 100001\] starts after the "
                                          r"run's last step \(the token budget's steps=\d+\)"):
        loop.run(cfg, log=lambda *a: None)
    assert not (tmp_path / "checkpoints").exists()
    from megatron_kappa.config.checks import profile_past_end
    assert profile_past_end([7, 9], 7, "x") is None and profile_past_end([8, 9], 7, "x")


def test_profile_steps_reaching_past_the_end_start_inside_the_run():
    """The control of the row above: a range that starts at the run's last step is kept (its trace
    ends where the run ends)."""
    assert load_config("configs/tiny.yaml", ["profile.steps=[50, 60]", "train.steps=50"]).profile.steps == [50, 60]


def test_profile_ranks_beyond_the_world_are_refused_by_the_preflight():
    from megatron_kappa.config import ConfigError
    from megatron_kappa.preflight import check_logging
    cfg = load_config("configs/tiny.yaml", ["profile.steps=[1, 2]", "profile.ranks=[0, 1]"])
    check_logging(cfg.log, cfg.profile, 2)
    bad = load_config("configs/tiny.yaml", ["profile.steps=[1, 2]", "profile.ranks=[0, 2]"])
    with pytest.raises(ConfigError, match=r"profile.ranks: \[0, 2\] names a rank the world of 2 processes"):
        check_logging(bad.log, bad.profile, 2)


def vm_hwm_bytes() -> int:
    """The kernel's peak resident set of this process (VmHWM, kB)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def test_peak_rss_is_the_kernels_peak(world1):
    before = vm_hwm_bytes()
    blob = torch.ones(64 * 2 ** 20, dtype=torch.uint8).add_(1)  # 64 MiB touched: the peak can only grow
    value = peak_memory(CPU)["mem_peak_rss_gib"]
    after = vm_hwm_bytes()
    del blob
    assert before / GIB <= value <= after / GIB and value >= 64 * 2 ** 20 / GIB
    assert memory_words({"mem_peak_rss_gib": value}) == f"rss {value:.2f} GiB"


GPU_PATH = [Path(profiling.__file__), Path(memory.__file__)]


def torch_names(source: str) -> set[str]:
    """The whole dotted names under torch.cuda and torch.profiler that `source` reads
    (torch.cuda.memory._dump_snapshot, not its prefixes; a call ends a name: torch.cuda.cudart)."""
    tree = ast.parse(source)
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            parts, at = [], node
            while isinstance(at, ast.Attribute):
                parts.insert(0, at.attr)
                at = at.value
            if isinstance(at, ast.Name) and at.id == "torch" and parts[0] in ("cuda", "profiler"):
                found.add(".".join(["torch", *parts]))
    return found


def missing_in_torch(names) -> list[str]:
    """The names that do not resolve, attribute by attribute, in the installed torch."""
    missing = []
    for name in sorted(names):
        at = torch
        for part in name.split(".")[1:]:
            at = getattr(at, part, missing)
            if at is missing:
                break
        if at is missing:
            missing.append(name)
    return missing


def test_every_cuda_name_of_the_gpu_path_exists_in_torch():
    """What the CUDA path reads (bench/gpu_check.py runs it on a GPU), from its source: a rename or a
    removal in torch fails here, on the CPU."""
    names = set().union(*(torch_names(path.read_text()) for path in GPU_PATH))
    # the scan sees what the GPU path is known to call (a scan that found nothing would pass)
    assert names >= {"torch.cuda.max_memory_allocated", "torch.cuda.max_memory_reserved",
                     "torch.cuda.reset_peak_memory_stats", "torch.cuda.cudart", "torch.cuda.nvtx.range_push",
                     "torch.cuda.nvtx.range_pop", "torch.cuda.memory._record_memory_history",
                     "torch.cuda.memory._dump_snapshot", "torch.profiler.ProfilerActivity.CUDA",
                     "torch.profiler.profile"}
    assert missing_in_torch(names) == []


def test_negative_control_a_name_torch_lacks_is_found():
    source = ("def f(device):\n    torch.cuda.max_memory_alocated(device)\n"
              "    return torch.profiler.ProfilerActivity.GPU, torch.cuda.nvtx.range_push, torch.cuda.cudart().x\n")
    names = torch_names(source)
    assert names == {"torch.cuda.max_memory_alocated", "torch.profiler.ProfilerActivity.GPU",
                     "torch.cuda.nvtx.range_push", "torch.cuda.cudart"}
    assert missing_in_torch(names) == ["torch.cuda.max_memory_alocated", "torch.profiler.ProfilerActivity.GPU"]


def test_the_step_line():
    cpu = {"step": 20, "loss": 5.12345, "lr": 3e-3, "grad_norm": 0.4123, "tokens_per_s": 5210.4, "tflops_per_gpu": 0.1,
           "mem_peak_rss_gib": 0.614, "elapsed_s": 19.4}
    assert step_line(cpu, 50, False, 0.98) == ("step 20/50 loss 5.1235 lr 3.00e-03 grad_norm 0.412 tokens/s 5210 "
                                               "rss 0.61 GiB 0:00:19 ETA 0:00:29")
    gpu = {**cpu, "tflops_per_gpu": 412.0, "mfu": 0.4166, "mem_peak_alloc_gib": 52.13, "mem_peak_reserved_gib": 60.31,
           "valid_loss": 4.97431}
    del gpu["mem_peak_rss_gib"]
    assert step_line({**gpu, "step": 50}, 50, True, 1.0) == (
        "step 50/50 loss 5.1235 lr 3.00e-03 grad_norm 0.412 tokens/s 5210 TFLOP/s/GPU 412 MFU 41.7% "
        "mem 52.1/60.3 GiB 0:00:19 valid 4.9743")
    # the validation sample says its size (it is not the whole split eval/loss.py reads)
    assert step_line({**cpu, "valid_loss": 4.97431, "valid_tokens": 2048}, 50, False, 0.98).endswith(
        "ETA 0:00:29 valid 4.9743 (2,048 tokens)")
    assert clock(3725) == "1:02:05" and clock(100 * 3600) == "100:00:00"
    assert done_line(50, 50, 48.2, "runs/x/checkpoints/step_50") == "done: step 50/50 in 0:00:48; checkpoint " \
                                                                    "runs/x/checkpoints/step_50"


@pytest.mark.slow
def test_a_profiled_training_run(world1, tmp_path):
    """6 steps, steps 3-4 profiled: the trace's steps, its ranges per micro-batch (2 per step), the
    step lines (time, ETA, memory; no TFLOP/s on the CPU), the final line, metrics.jsonl's wall
    clock and peak RSS; run again: "nothing to do" and no second final line."""
    import time

    from megatron_kappa.train import loop
    sets = [*SETS, f"run.dir={tmp_path}", "profile.steps=[3, 4]", "train.steps=6"]
    lines, started = [], time.time()
    loop.run(load_config("configs/tiny.yaml", sets), log=lines.append)
    (trace,) = (tmp_path / "profile").iterdir()
    names = trace_names(trace)
    assert sorted(n for n in names if n.startswith("step ")) == ["step 3", "step 4"]
    assert names["forward"] == names["backward"] == names["optimizer"] == 4  # 2 steps × 2 micro-batches
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 6 and all(" rss " in line and "TFLOP" not in line for line in steps), steps
    assert all(" ETA " in line for line in steps[:-1]) and " ETA " not in steps[-1]
    assert lines[-1].startswith("done: step 6/6 in 0:") and lines[-1].endswith(f"{tmp_path}/checkpoints/step_6")
    records, _ = read_records(tmp_path / "metrics.jsonl")
    peak_now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    assert all(0.1 < r["mem_peak_rss_gib"] <= peak_now for r in records)
    assert all(started <= r["time"] <= time.time() for r in records)
    assert [r["time"] for r in records] == sorted(r["time"] for r in records)
    assert all(b["elapsed_s"] > a["elapsed_s"] for a, b in zip(records, records[1:]))
    again = []
    loop.run(load_config("configs/tiny.yaml", sets), log=again.append)
    assert again[-1].startswith("nothing to do") and not any(line.startswith("done:") for line in again)
