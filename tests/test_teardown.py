"""Process groups end before the process does: megatron_kappa.parallel.groups.teardown joins
every gloo thread (megatron's groups, the control group, the default group) while the
interpreter is alive. torch's destroy_process_group alone leaves them running until the exit,
where they were torn down with the C++ runtime and, now and then, took a rank down with SIGABRT
("terminate called without an active exception") after its work was done.

Each case runs in a fresh process (the test session keeps its own group); threads are counted in
/proc/self/task, so gloo's C++ threads count too."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

CODE = """
import gc, os, sys
import torch.distributed as dist
from megatron_kappa.config import ParallelConfig
from megatron_kappa.parallel import groups
threads = lambda: len(os.listdir("/proc/self/task"))
groups.init_distributed(ParallelConfig(), 1, 4)
started = threads()
if sys.argv[1] == "teardown":
    groups.teardown()
else:  # what the CLIs did before: torch's call alone, megatron's state still holding the groups
    dist.destroy_process_group()
    gc.collect()
print(started, threads(), dist.is_initialized())
"""


def threads_after(how: str) -> tuple[int, int, bool]:
    done = subprocess.run([sys.executable, "-c", CODE, how], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**{k: v for k, v in os.environ.items() if k not in LAUNCHER},
                                                    "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    started, after, initialized = done.stdout.split()[-3:]
    return int(started), int(after), initialized == "True"


@pytest.mark.slow
def test_teardown_joins_every_group_thread():
    started, after, initialized = threads_after("teardown")
    assert started >= 20  # megatron's groups each run gloo threads
    assert after <= 8 and not initialized  # what torch itself keeps (its thread pools)


@pytest.mark.slow
def test_destroy_process_group_alone_leaves_them_running():
    """Negative control: the check above sees the threads that torch's call leaves behind."""
    started, after, initialized = threads_after("destroy")
    assert after >= started - 8 and not initialized
