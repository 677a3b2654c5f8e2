"""bench/gpu_check.py (the GPU check) runs every stage and writes its report: checked here on the
CPU with small shapes, so the script a GPU user runs cannot rot unseen."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_stages_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    report = json.loads((tmp_path / "report.json").read_text())
    failed = [(s["name"], s.get("tail", "")[-1500:]) for s in report["stages"] if not s["ok"]]
    assert done.returncode == 0 and not failed, failed or done.stderr[-3000:]
    names = [s["name"] for s in report["stages"]]
    gpu_tests = report["stages"][1]["result"]  # on the CPU: every gpu-marked test collected, skipped
    assert gpu_tests["skipped"] > 0 and "passed" not in gpu_tests, gpu_tests
    assert names[:2] == ["environment", "gpu-marked tests"] and "train: resume is exact" in names
    resume = next(s for s in report["stages"] if s["name"] == "train: resume is exact")["result"]
    assert resume["losses_equal"] and resume["steps"] == 8
    evaluation = next(s for s in report["stages"] if s["name"].startswith("evaluation"))["result"]
    assert evaluation["tokens"] > 1000 and -1 <= evaluation["core"] <= 1
    assert "| train: resume is exact | ok |" in (tmp_path / "report.md").read_text()
    profiled = next(s for s in report["stages"] if s["name"] == "train: profiler and memory")["result"]
    assert profiled["steps"] == ["step 3", "step 4"] and profiled["peak_rss_gib"] > 0
    saves = next(s for s in report["stages"] if s["name"] == "bench: checkpoint async vs sync")["result"]
    assert saves[0]["shape"] == "tiny" and saves[0]["sync_blocked_s"] > 0 and saves[0]["async_blocked_s"] > 0
    assert saves[0]["pinned_buffers"] == 0  # on a GPU the snapshot goes to pinned buffers instead


@pytest.mark.parametrize("output, cpu, ok", [
    ("12 passed in 40.1s", False, True),
    ("10 passed, 2 deselected in 40.1s", False, True),
    # negative controls: on a GPU, skips or failures fail the stage; on the CPU, a run
    ("12 skipped in 1.0s\nSKIPPED [12] tests/test_gpu.py: needs CUDA", False, False),
    ("11 passed, 1 skipped in 40.1s", False, False),
    ("11 passed, 1 failed in 40.1s", False, False),
    ("no tests ran in 0.1s", False, False),
    ("SKIPPED [12] tests/test_gpu.py:20: needs CUDA\n12 skipped in 1.0s", True, True),
    ("12 passed in 1.0s", True, False),
    ("no tests ran in 0.1s", True, False),
])
def test_gpu_tests_stage_fails_on_skips_on_a_gpu(output, cpu, ok):
    from bench.gpu_check import gpu_tests_result
    if ok:
        gpu_tests_result(output, cpu)
    else:
        with pytest.raises(ValueError):
            gpu_tests_result(output, cpu)


def fake_profiled_run(run_dir, gpu: bool, steps=(3, 4), kernels=2, snapshot=True, alloc=1.5):
    """A run folder as the profiled stage leaves it on a GPU (or the CPU): the checker's input."""
    import pickle
    folder = run_dir / "profile"
    folder.mkdir(parents=True)
    events = [{"name": f"step {n}", "ph": "X"} for n in steps] + [{"name": "gemm", "cat": "kernel"}] * kernels
    (folder / "rank0_steps3-4.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    memory = {"mem_peak_alloc_gib": alloc, "mem_peak_reserved_gib": 2.0} if gpu else {"mem_peak_rss_gib": 0.7}
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": n, **memory}) + "\n" for n in range(1, 6)))
    if snapshot:
        (folder / "rank0_steps3-4.memory.pickle").write_bytes(pickle.dumps(
            {"segments": [{"address": 0}], "device_traces": [[{"action": "alloc"}] * 3]}))
    words = "TFLOP/s/GPU 1.2 mem 1.5/2.0 GiB" if gpu else "rss 0.70 GiB"
    return "\n".join(f"step {n}/5 loss 7.0 {words} 0:00:01" for n in range(1, 6))


def test_the_profile_stage_checks_what_a_gpu_run_leaves(tmp_path):
    """bench/gpu_check.py's profile stage on the run folders a GPU and the CPU leave (made here:
    no GPU on this machine), and negative controls: another step traced, no kernels, no snapshot,
    allocated above reserved, a CPU run with a snapshot."""
    from bench.gpu_check import profile_result
    assert profile_result(tmp_path / "gpu", fake_profiled_run(tmp_path / "gpu", True), cpu=False) == {
        "steps": ["step 3", "step 4"], "kernels": 2, "snapshot_events": 3, "peak_alloc_gib": 1.5,
        "peak_reserved_gib": 2.0}
    assert profile_result(tmp_path / "cpu", fake_profiled_run(tmp_path / "cpu", False, kernels=0, snapshot=False),
                          cpu=True)["peak_rss_gib"] == 0.7
    for name, kw, cpu in [("steps", {"steps": (3, 4, 5)}, False), ("kernels", {"kernels": 0}, False),
                          ("snapshot", {"snapshot": False}, False), ("alloc", {"alloc": 2.5}, False),
                          ("cpu_snapshot", {"kernels": 0}, True)]:
        run_dir = tmp_path / name
        output = fake_profiled_run(run_dir, not cpu, **kw)
        with pytest.raises((ValueError, FileNotFoundError)):
            profile_result(run_dir, output, cpu)


def test_the_compile_bench_rows():
    """bench/compile.py's rows (its GPU stage cannot run here): ratios, the compile time of the
    first compiled variant only, and MFU against a peak; negative controls: no peak, no MFU; an
    eager row has no compile time or compiled/eager ratio."""
    from bench.compile import summarize
    ms = {("kappa", "eager"): 200.0, ("kappa", "compiled"): 100.0, ("plain", "compiled"): 80.0}
    first = {("kappa", "eager"): 250.0, ("kappa", "compiled"): 5200.0, ("plain", "compiled"): 300.0}
    flops = dict.fromkeys(ms, 1e9)
    rows = {(r["activation"], r["mode"]): r for r in summarize(ms, first, 4096, flops, 1000.0)}
    assert rows[("kappa", "compiled")]["compiled_over_eager"] == 0.5
    assert rows[("kappa", "compiled")]["kappa_over_plain"] == 1.25
    assert rows[("kappa", "compiled")]["compile_s"] == 5.0 and rows[("plain", "compiled")]["compile_s"] is None
    assert rows[("kappa", "eager")]["compile_s"] is None and rows[("kappa", "eager")]["compiled_over_eager"] is None
    assert abs(rows[("plain", "compiled")]["mfu"] - 1e9 * 4096 / 0.08 / 1e12 / 1000) < 1e-12
    assert all(r["mfu"] is None for r in summarize(ms, first, 4096, flops, None))
