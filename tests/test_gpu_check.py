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
