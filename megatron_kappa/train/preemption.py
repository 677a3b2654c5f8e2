"""Stopping a run cleanly when the scheduler says so: finish the step, checkpoint, exit 75.

Signals (`install()`, called by launch/pretrain.py before its heavy imports, so that an early
signal does not kill the process with the default action):
  - SIGUSR1: Slurm's warning before the time limit (`sbatch --signal=USR1@N`, sent to every task
    of the job's steps, i.e. the ranks);
  - SIGTERM: scancel, `scontrol requeue`, preemption, the time limit itself, or a launcher ending
    its workers; SIGKILL follows after the cluster's KillWait (30 s by default);
  - SIGINT: Ctrl-C, which a terminal sends to every process of the job (launcher and ranks): the
    same as SIGTERM, with a line saying so; a second Ctrl-C exits at once (status 130) without a
    checkpoint, saying that the last checkpoint stands.
The handler only records the signal; the loop reads it at the end of each step.

Agreement: a signal reaches the ranks at slightly different times (a step apart, or only some of
them), but the checkpoint is collective, so every rank must stop after the same step.
`StopAgreement.poll()`, called once per step by every rank, all-reduces (MAX) one integer (the
signal seen here, else 0) on the gloo control group (megatron_kappa.parallel.groups), pipelined:
the reduction started after step k is waited for after step k+1, so all ranks read the same value
at the same step and stop together one step after the first signal. The cost: one 4-byte gloo
all-reduce per step on the host, already finished when it is waited for (it had a whole step to
run in gloo's thread); no GPU work and no host-device sync (the buffer is a CPU tensor, made
once). bench/preemption.py measures it: see docs/benchmarks.md.

After the checkpoint the loop raises `Preempted`; launch/pretrain.py exits with EXIT_RESUMABLE
(75, sysexits' EX_TEMPFAIL: "try again later"). Who brings the job back: under Slurm,
launch/slurm/pretrain.sbatch requeues its own job after a warning (`scontrol requeue`, when the
job allows it); on SIGTERM, Slurm itself decides (a requeue or a preemption in REQUEUE mode comes
back, a scancel does not). Anywhere else: run the same command again, it resumes from the
checkpoint. A run killed without warning (SIGKILL, a node failure) resumes from its last
periodic checkpoint: checkpoints are atomic (megatron_kappa.checkpoint.store).
"""
from __future__ import annotations

import os
import signal
import sys

EXIT_RESUMABLE = 75
EXIT_INTERRUPTED = 130  # the shell's status for a process ended by Ctrl-C
SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)

_received: int = 0  # the first signal number recorded in this process (0: none)


class Preempted(Exception):
    """The run stopped early at `step` on a signal, after writing a checkpoint there."""

    def __init__(self, step: int, steps: int, signum: int, checkpoint):
        self.step, self.steps, self.signum, self.checkpoint = step, steps, signum, checkpoint
        super().__init__(f"stopped at step {step}/{steps} on {signal_name(signum)}; checkpoint "
                         f"{checkpoint}: the same command resumes from it")


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _record(signum, _frame=None):
    global _received
    first_rank = os.environ.get("RANK", "0") == "0"
    if signum == signal.SIGINT:
        if _received:  # a second Ctrl-C (or one after another stop signal): now
            if first_rank:
                print("second Ctrl-C: stopping now, without a checkpoint; the last checkpoint stands",
                      file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)
        if first_rank:
            print("Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again to stop at once)",
                  file=sys.stderr, flush=True)
    if not _received:
        _received = int(signum)


def install(signals=SIGNALS):
    """Record `signals` instead of dying of them, for the rest of the process. Installing also
    replaces an inherited "ignore" (the deepspeed-launcher path of launch/slurm/common.sh starts
    its ranks with USR1 ignored so that only they act on it)."""
    for sig in signals:
        signal.signal(sig, _record)


LAUNCHERS = ("torch.distributed.run", "torchrun", "deepspeed", "launch.py", "launcher")
WATCH_S = 1.0


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _parent(pid: int) -> int:
    fields = proc_stat(pid)
    return int(fields[1]) if fields and len(fields) > 1 else 0


def watch_launcher():
    """Ranks never outlive their launcher: when a process that started this one (torchrun, the
    deepspeed runner or its launch.py: the python launchers among its parent and grandparent) is
    gone, this process stops as on SIGTERM (after the step, with a checkpoint). A daemon thread
    polls every WATCH_S; nothing is watched outside a launcher (plain python, Slurm's srun)."""
    import threading
    import time
    watched = []
    pid = os.getpid()
    for _ in range(2):
        pid = _parent(pid)
        if pid > 1 and any(name in _command(pid) for name in LAUNCHERS):
            watched.append(pid)
    if not watched:
        return None
    parent = os.getppid()

    def watch():
        while not _received:
            if os.getppid() != parent or not all(os.path.exists(f"/proc/{p}") for p in watched):
                if os.environ.get("RANK", "0") == "0":
                    print("the launcher is gone: stopping after this step with a checkpoint",
                          file=sys.stderr, flush=True)
                _record(signal.SIGTERM)
                return
            time.sleep(WATCH_S)
    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return watched


def ignore_from_now(signals=SIGNALS):
    """Once the checkpoint is written: ignore further signals while the process exits. Python's
    shutdown restores the default action of signals that had a Python handler (and TERM's kills),
    while the launcher ends the ranks that are slower to exit with SIGTERM (`srun
    --kill-on-bad-exit` reads status 75 as a failure): such a rank would die of it with status
    143 instead of 75. An ignored signal stays ignored through the shutdown."""
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


def request_stop(signum: int = signal.SIGUSR1):
    """What a recorded signal does, without a signal (tests, embedding code)."""
    _record(signum)


def received() -> int:
    """The signal recorded in this process, or 0."""
    return _received


def reset():
    """Forget a recorded signal (tests that run several jobs in one process)."""
    global _received
    _received = 0


class StopAgreement:
    """Every rank calls `poll()` once per step, in the same order; all get the same answer at the
    same call. `signum` is then the largest signal number any rank had seen (SIGTERM over USR1)."""

    def __init__(self, group=None):
        import torch
        import torch.distributed as dist

        from megatron_kappa.parallel.groups import control_group

        self._dist = dist
        self._group = group if group is not None else control_group()
        self._buffer = torch.zeros(1, dtype=torch.int32)  # host memory, whatever the device
        self._work = None
        self.signum = 0

    def poll(self) -> bool:
        """True when the ranks have agreed to stop after the current step."""
        if self._work is not None:
            self._work.wait()  # started one step ago: done by now unless a rank is far behind
            self._work = None
            self.signum = int(self._buffer[0])  # a CPU tensor: no device sync
            if self.signum:
                return True
        self._buffer[0] = _received
        self._work = self._dist.all_reduce(self._buffer, op=self._dist.ReduceOp.MAX,
                                           group=self._group, async_op=True)
        return False

    def close(self):
        """Wait for the reduction still in flight (every rank has one after its last poll)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
