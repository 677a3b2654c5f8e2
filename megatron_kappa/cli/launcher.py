"""The two launchers with this project's endings and without their known notices: `kappa-deepspeed`
and `kappa-torchrun` (or `python -m megatron_kappa.cli.launcher deepspeed|torchrun ...`), with the
launchers' own arguments.

    kappa-deepspeed --num_gpus 2 launch/pretrain.py --config configs/tiny.yaml
    kappa-torchrun --nproc_per_node 2 launch/pretrain.py --config configs/tiny.yaml

A launcher never imports this package by itself, and the environment holds no start-up hook that
would make it: `deepspeed` and `torchrun` run the same ranks, with DeepSpeed's INFO lines, their
notices (no hostfile; OMP_NUM_THREADS unset) and their tracebacks on Ctrl-C or a failed rank.
These run the same launcher in this process after the quiet filters (megatron_kappa/quiet.py)
and its hook (megatron_kappa/launcher_exit.py): Ctrl-C and a failed rank end in one line. The
deepspeed runner logs at `--log_level warning` unless told otherwise (it passes the level on to
its launch.py): its warnings and errors still show, its INFO lines (the command, the world, each
rank spawned and exited) do not. KAPPA_SHOW_WARNINGS=1 shows them all, as the launchers' own.
"""
from __future__ import annotations

import sys

RUNNER_LEVEL = ("--log_level", "warning")


def runner_arguments(args: list[str]) -> list[str]:
    """The deepspeed runner's arguments, with `--log_level warning` first unless the runner's own
    options (those before the script) already say a level or -q."""
    options = []
    for arg in args:
        if not arg.startswith("-"):
            break
        options.append(arg)
    said = any(a in ("-q", "--quiet", "--log_level") or a.startswith("--log_level=") for a in options)
    return list(args) if said else [*RUNNER_LEVEL, *args]


def deepspeed(argv: list[str] | None = None) -> None:
    from megatron_kappa import launcher_exit, quiet
    args = sys.argv[1:] if argv is None else argv
    if quiet.install():  # False under KAPPA_SHOW_WARNINGS=1: the runner's INFO lines too
        args = runner_arguments(args)
    launcher_exit.install_for("deepspeed")
    from deepspeed.launcher.runner import main
    main(args)


def torchrun(argv: list[str] | None = None) -> None:
    from megatron_kappa import launcher_exit, quiet
    quiet.install()
    launcher_exit.install_for("torchrun")
    from torch.distributed.run import main
    main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("deepspeed", "torchrun"):
        print("usage: python -m megatron_kappa.cli.launcher deepspeed|torchrun [the launcher's arguments]",
              file=sys.stderr)
        sys.exit(2)
    {"deepspeed": deepspeed, "torchrun": torchrun}[sys.argv[1]](sys.argv[2:])
