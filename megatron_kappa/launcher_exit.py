"""The launchers' own endings in one line: Ctrl-C to the deepspeed runner, and torchrun's signal
and failed-rank reports, instead of their Python tracebacks.

The launchers never import the package themselves (and the environment holds no start-up hook):
`kappa-deepspeed` and `kappa-torchrun` (megatron_kappa/cli/launcher.py) run them in a process that
sets the hook first (`install_for`); `install()`, which every entry point calls, sets it only in a
launcher process (told by `sys.orig_argv`). Nothing of DeepSpeed or torch is patched: an
exception they leave uncaught reaches the hook, which prints one line and exits.

- The deepspeed runner (`deepspeed`, `python -m deepspeed.launcher.runner`) on one host waits for
  its launch.py in `Popen.wait()` with no SIGINT handler: Ctrl-C to the terminal's process group
  raised KeyboardInterrupt there, a 14-line traceback, and the runner exited at once while its
  ranks were still writing their checkpoint. Now it waits for its children (launch.py, which
  ends the ranks: they stop after an agreed step with a checkpoint and say so), prints one line,
  and exits 130.
- torchrun (`torchrun`, `python -m torch.distributed.run`) raises SignalException after it has
  stopped its workers on SIGINT/SIGTERM (a 26-line traceback): one line, exit 128 + the signal.
  A failed rank became a ChildFailedError of about forty lines around the rank's own message:
  one line naming the first failed rank and its status, exit that status (the deepspeed runner
  also passes its ranks' status on; a rank killed by a signal: 1, torchrun's own).

KAPPA_SHOW_WARNINGS=1 (quiet.py's switch) leaves the launchers' reports as they were.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys

DEEPSPEED_RUNNER = ("deepspeed.launcher.runner", "deepspeed", "ds")
TORCHRUN = ("torch.distributed.run", "torch.distributed.launch", "torchrun")
# torch's logger and its lines that the summary line below replaces: the first failure, and the
# SIGTERM it sends each rank still running then (or on Ctrl-C), one warning per rank
_TORCHRUN_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_TORCHRUN_REPLACED = ("failed (exitcode: ", "Sending process %s closing signal %s")

_PYTHON_OPTIONS_WITH_VALUE = {"-W", "-X", "--check-hash-based-pycs"}


def program(argv: list[str]) -> str:
    """What a Python command line runs: the module of `-m`, else the script's file name."""
    args = iter(argv[1:])
    for arg in args:
        if arg == "-m":
            return next(args, "")
        if arg == "-c":
            return ""
        if arg in _PYTHON_OPTIONS_WITH_VALUE:
            next(args, None)
        elif not arg.startswith("-"):
            return os.path.basename(arg)
    return ""


def _finish(line: str, code: int):
    print(line, file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(code)  # after an uncaught exception: exit with this status, nothing left to unwind


def deepspeed_runner_hook(kind, value, tb, default=sys.__excepthook__):
    if not issubclass(kind, KeyboardInterrupt):
        return default(kind, value, tb)
    # The ranks got the same Ctrl-C (one process group) and launch.py ends them (SIGTERM, 30 s to
    # exit): wait for it, so the shell's prompt returns once their checkpoint is written. A second
    # Ctrl-C reaches the ranks (they exit at once) and launch.py, not this wait.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    children = 0
    while True:
        try:
            os.waitpid(-1, 0)
            children += 1
        except ChildProcessError:
            break
    said = "its ranks have stopped (each says above what it left)" if children else "no ranks had started"
    _finish(f"deepspeed: interrupted (Ctrl-C); {said}", 130)


def torchrun_hook(kind, value, tb, default=sys.__excepthook__):
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    if issubclass(kind, SignalException):
        name = signal.Signals(value.sigval).name
        _finish(f"torchrun: stopped on {name}; its ranks were signalled and have exited (each says above "
                f"what it left)", 128 + int(value.sigval))
    if issubclass(kind, ChildFailedError):
        rank, failure = value.get_first_failure()
        others = len(value.failures) - 1
        also = f"; {others} other rank{'s' if others != 1 else ''} failed too" if others > 0 else ""
        status = failure.exitcode
        how = f"exited with status {status}" if status >= 0 else f"was killed by {failure.signal_name()}"
        _finish(f"error: torchrun: rank {rank} (on {socket.gethostname()}) {how} first{also}; its own "
                f"message is above", status if status > 0 else 1)
    return default(kind, value, tb)


class _DropReplacedLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(line in str(record.msg) for line in _TORCHRUN_REPLACED)


def install(argv: list[str] | None = None) -> str | None:
    """Set the hook when this process is a launcher; the launcher's name, or None."""
    from megatron_kappa.quiet import ENV
    if os.environ.get(ENV, "") not in ("", "0"):
        return None
    name = program(list(getattr(sys, "orig_argv", sys.argv)) if argv is None else argv)
    if name in DEEPSPEED_RUNNER:
        return install_for("deepspeed")
    if name in TORCHRUN:
        return install_for("torchrun")
    return None


def install_for(launcher: str) -> str | None:
    """Set the hook of `launcher` ("deepspeed" or "torchrun") in this process, which runs it
    (megatron_kappa/cli/launcher.py); the launcher's name, or None under KAPPA_SHOW_WARNINGS."""
    from megatron_kappa.quiet import ENV
    if os.environ.get(ENV, "") not in ("", "0"):
        return None
    if launcher == "deepspeed":
        sys.excepthook = deepspeed_runner_hook
    elif launcher == "torchrun":
        sys.excepthook = torchrun_hook
        logging.getLogger(_TORCHRUN_LOGGER).addFilter(_DropReplacedLines())
    else:
        raise ValueError(f"launcher: {launcher!r}: expected deepspeed or torchrun")
    return launcher
