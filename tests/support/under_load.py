"""Run pytest tests N times in a row while a CPU-heavy process runs beside them; stop at the first
failure. For timing-dependent tests (issue 34: the lost-host test named the wrong host once under
load). Usage, as root on a machine that can build the two-host cluster:

    python tests/support/under_load.py -n 10 \
        "tests/test_multinode.py::test_lost_host_ends_the_job_naming_it_and_a_resubmission_resumes"
"""
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUSY = "import hashlib\nb = b'x' * (1 << 20)\nwhile True:\n    hashlib.sha256(b).digest()\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=10, help="passes in a row (default 10)")
    p.add_argument("tests", nargs="+", help="pytest node ids")
    args = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "DS_ACCELERATOR": "cpu"}
    busy = subprocess.Popen([sys.executable, "-c", BUSY])  # one core kept busy the whole time
    try:
        for i in range(1, args.n + 1):
            t0 = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s",
                                   *args.tests], cwd=ROOT, env=env, capture_output=True, text=True)
            took = time.monotonic() - t0
            tail = [line for line in done.stdout.splitlines() if "passed" in line or "failed" in line
                    or "killed ranks" in line]
            print(f"pass {i}/{args.n}: exit {done.returncode} in {took:.0f} s: {' | '.join(tail[-2:])}", flush=True)
            if done.returncode != 0:
                print(done.stdout[-6000:], done.stderr[-2000:], sep="\n")
                return 1
    finally:
        busy.kill()
    print(f"{args.n} passes in a row under load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
