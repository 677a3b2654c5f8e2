"""`python -c CODE` in a bare environment (PATH and PYTHONPATH only, from the repository root): what a
command sees with nothing of the test process's imports or settings."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bare(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
