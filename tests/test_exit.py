"""megatron_kappa.parallel.launch_env.exit_process: the command lines' exit skips shutdown's garbage
collection but keeps the exit status and the atexit handlers (which os._exit would drop)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import atexit, gc, logging, sys
from megatron_kappa.parallel.launch_env import exit_process
logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
logging.info("written before the exit")  # flushed by logging's own atexit handler
cycle = []; cycle.append(cycle)
atexit.register(lambda: print("atexit ran, frozen objects:", gc.get_freeze_count() > 0))
exit_process(int(sys.argv[2]))
"""


def test_exit_status_and_atexit_handlers_survive(tmp_path):
    for status in (0, 3):
        log = tmp_path / f"log{status}.txt"
        done = subprocess.run([sys.executable, "-c", CHILD, str(log), str(status)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == status, done.stderr
        assert "atexit ran, frozen objects: True" in done.stdout
        assert "written before the exit" in log.read_text()


def test_negative_control_os_exit_drops_the_handlers(tmp_path):
    log = tmp_path / "log.txt"
    child = CHILD.replace("exit_process(int(sys.argv[2]))", "import os; os._exit(int(sys.argv[2]))")
    done = subprocess.run([sys.executable, "-c", child, str(log), "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "atexit ran" not in done.stdout
