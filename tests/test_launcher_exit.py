"""The launchers' own endings in one line (megatron_kappa/launcher_exit.py, issue 53): Ctrl-C to
the deepspeed runner's or torchrun's process group, and a rank failing under torchrun, under the
real launchers with 2 ranks. KAPPA_SHOW_WARNINGS=1 leaves the launchers' tracebacks (the negative
control: it is the hook that makes them one line). Training under Ctrl-C:
tests/test_preemption.py::test_ctrl_c_to_the_deepspeed_launcher_checkpoints_and_resumes_exactly."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_kappa import launcher_exit

ROOT = Path(__file__).resolve().parents[1]
# a rank that says it started, stops 1 s after SIGINT/SIGTERM (as pretrain checkpoints), or fails
RANK = r"""import os, signal, sys, time
if "fail" in sys.argv:  # (the deepspeed launcher adds --local_rank=N)
    print(f"error: rank {os.environ['RANK']}: model.hidden_size: expected a positive integer", file=sys.stderr)
    sys.exit(2)
def stop(signum, frame):
    time.sleep(1)
    sys.stdout.write(f"rank {os.environ['RANK']} stopped on {signal.Signals(signum).name}\n")
    sys.stdout.flush()
    sys.exit(75)
signal.signal(signal.SIGINT, stop)
signal.signal(signal.SIGTERM, stop)
sys.stdout.write("started\n")  # one write: the ranks share the pipe
sys.stdout.flush()
time.sleep(120)
"""


def test_only_the_launcher_processes_get_the_hook():
    assert launcher_exit.program(["python", "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", "2"]) \
        == "deepspeed.launcher.runner"
    assert launcher_exit.program(["python", "/venv/bin/deepspeed", "train.py"]) == "deepspeed"
    assert launcher_exit.program(["python", "-X", "utf8", "/venv/bin/torchrun", "x.py"]) == "torchrun"
    assert launcher_exit.program(["python", "-c", "import deepspeed"]) == ""
    hook = sys.excepthook
    try:
        for argv, kind in ((["python", "launch/pretrain.py"], None),
                           (["python", "-u", "-m", "deepspeed.launcher.launch"], None),  # ends its ranks itself
                           (["python", "-m", "deepspeed.launcher.runner"], "deepspeed"),
                           (["python", "-m", "torch.distributed.run"], "torchrun")):
            sys.excepthook = hook
            assert launcher_exit.install(argv) == kind
            assert (sys.excepthook is not hook) == (kind is not None)
    finally:
        sys.excepthook = hook


def test_the_torch_symbols_the_hook_reads_exist():
    """The torchrun hook reads these of torch's elastic launcher (not patched: read)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    assert SignalException("x", signal.SIGINT).sigval == signal.SIGINT
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=-9, error_file="/nonexistent")
    assert failure.signal_name() == "SIGKILL"
    assert ChildFailedError("x", {3: failure}).get_first_failure() == (3, failure)


def test_the_torchrun_lines_replaced_are_torchs_and_only_they_are_dropped():
    """The log lines the torchrun hook drops (its summary line says them) are still torch's own:
    the first failure, and the SIGTERM sent to each rank still running then (a rank slower to fail
    under load printed it in CI). Any other line of that logger passes."""
    import inspect
    import logging

    from torch.distributed.elastic.multiprocessing import api
    source = inspect.getsource(api)
    assert all(line in source for line in launcher_exit._TORCHRUN_REPLACED)
    assert api.logger.name == launcher_exit._TORCHRUN_LOGGER
    keep = launcher_exit._DropReplacedLines().filter
    def record(msg):
        return logging.LogRecord(api.logger.name, logging.WARNING, "api.py", 1, msg, (), None)
    assert not keep(record("Sending process %s closing signal %s"))
    assert not keep(record("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"))
    assert keep(record("Starting elastic_operator with launch configs:"))  # control


def launchers():
    """kappa-deepspeed and kappa-torchrun (megatron_kappa/cli/launcher.py): the launchers never
    import the package themselves, and the environment holds no start-up hook."""
    from megatron_kappa.parallel.launch_env import free_port
    return {"deepspeed": [sys.executable, "-m", "megatron_kappa.cli.launcher", "deepspeed", "--num_gpus", "2",
                          "--master_port", str(free_port())],
            "torchrun": [sys.executable, "-m", "megatron_kappa.cli.launcher", "torchrun", "--nproc_per_node", "2",
                         "--master_port", str(free_port())]}


def environment(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "KAPPA_SHOW_WARNINGS")}
    return {**env, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT), **extra}


def ctrl_c(cmd, env):
    # SIGINT at its default, as in a terminal: a suite started in the background by a
    # non-interactive shell (`make test &`) inherits it ignored, and the runner would keep it so
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    before = []
    for line in proc.stdout:
        before.append(line)
        if "".join(before).count("started") == 2:
            break
    assert proc.poll() is None, "".join(before)[-3000:]
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepspeed", "torchrun"])
def test_ctrl_c_to_a_launcher_is_one_line_after_its_ranks_stopped(tmp_path, name):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    cmd = [*launchers()[name], str(script), "run"]
    code, out = ctrl_c(cmd, environment())
    last = out.strip().splitlines()[-1]
    assert code == 130 and "Traceback" not in out, out[-3000:]
    assert last.startswith(f"{name}: ") and ("interrupted (Ctrl-C)" in last or "stopped on SIGINT" in last), out[-2000:]
    assert sorted(re.findall(r"rank (\d) stopped on SIG", out)) == ["0", "1"]  # before the launcher's line
    code, out = ctrl_c(cmd, environment(KAPPA_SHOW_WARNINGS="1"))  # negative control: the launcher's own ending
    assert "Traceback" in out and code != 130, out[-2000:]


@pytest.mark.slow
def test_a_failed_rank_under_torchrun_is_one_line(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    cmd = [*launchers()["torchrun"], str(script), "fail"]
    done = subprocess.run(cmd, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    # each rank's own line (rank 1's, when torchrun ended it first, may be missing), then torchrun's
    assert set(lines[:-1]) <= {f"error: rank {r}: model.hidden_size: expected a positive integer" for r in (0, 1)}
    assert lines[:-1], done.stderr
    assert re.fullmatch(r"error: torchrun: rank [01] \(on .+\) exited with status 2 first(; 1 other rank failed too)?; "
                        r"its own message is above", lines[-1]), lines[-1]
    loud = subprocess.run(cmd, cwd=ROOT, env=environment(KAPPA_SHOW_WARNINGS="1"), capture_output=True, text=True,
                          timeout=120)
    assert loud.returncode == 1 and "ChildFailedError" in loud.stderr and "Traceback" in loud.stderr
