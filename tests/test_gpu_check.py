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
    assert names[:2] == ["environment", "gpu-marked tests"] and "train: resume is exact" in names
    resume = next(s for s in report["stages"] if s["name"] == "train: resume is exact")["result"]
    assert resume["losses_equal"] and resume["steps"] == 8
    evaluation = next(s for s in report["stages"] if s["name"].startswith("evaluation"))["result"]
    assert evaluation["tokens"] > 1000 and -1 <= evaluation["core"] <= 1
    assert "| train: resume is exact | ok |" in (tmp_path / "report.md").read_text()
