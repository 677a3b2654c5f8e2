"""What every entry point does first: the library notices known harmless filtered (quiet.py) and,
in a launcher process, its endings in one line (launcher_exit.py).

Importing the package changes nothing (no warning filter, no `sys.excepthook`); each command line
calls `start()` before its imports can print: `run()` does it for the scripts beside the
package, the console scripts (megatron_kappa/cli/commands.py) and the package's `python -m` mains.
"""
from __future__ import annotations

import gc
import importlib
import sys


def start() -> None:
    """The quiet filters, then the launcher hooks (set only when this process is torchrun or the
    deepspeed runner); both once per process, both off with KAPPA_SHOW_WARNINGS=1."""
    from megatron_kappa import launcher_exit, quiet
    quiet.install()
    launcher_exit.install()


def exit_process(code: int | None = 0):
    """sys.exit(code) without the cyclic garbage collection of interpreter shutdown, which walks the
    million objects torch, megatron-core and DeepSpeed create at import: 2-3 s at the end of every
    process on a CPU (bench/process_exit.py: 3.0 s → 0.45 s after importing megatron-core and
    DeepSpeed). Frozen objects are still freed by reference count;
    only objects in reference cycles are left to the operating system. By the time a command line
    calls this, what it writes is closed (`with` blocks, checkpoints renamed into place, the
    TensorBoard writer closed by the loop) and atexit handlers such as logging's flush still run."""
    gc.freeze()
    sys.exit(code)


class Terminated(KeyboardInterrupt):
    """SIGTERM in a command line run by run_command: a KeyboardInterrupt, so that what cleans up
    after Ctrl-C (the export's `<output>.tmp`) cleans up after it too."""


def _terminated(signum, frame):
    raise Terminated


def run_command(main, interrupted: str):
    """`exit_process(main())` for a command line, with Ctrl-C as one line and exit status 130 (the
    shell's for SIGINT) instead of a traceback, and SIGTERM likewise with 143 (it killed the process
    at once, leaving what it was writing); `interrupted` says what an interrupt leaves."""
    import signal
    signal.signal(signal.SIGTERM, _terminated)
    try:
        code = main()
    except Terminated:
        print(f"terminated (SIGTERM): {interrupted}", file=sys.stderr, flush=True)
        code = 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"interrupted: {interrupted}", file=sys.stderr, flush=True)
        code = 130
    exit_process(code)


def run(module: str) -> None:
    """Run the command line of `module` (a module, or a package's `__main__`) as the program:
    start() first, before its imports can print; then its `main()`, whose status is the exit
    status; where the module says what an interrupt leaves (`INTERRUPTED`), Ctrl-C is that one
    line and status 130 instead of a traceback."""
    start()
    command = importlib.import_module(module)
    interrupted = getattr(command, "INTERRUPTED", None)
    if interrupted is None:
        exit_process(command.main())
    run_command(command.main, interrupted)
