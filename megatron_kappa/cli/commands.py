"""The command lines users run, each as one function: the console scripts of pyproject.toml's
[project.scripts] and the thin scripts beside the package (plan/, eval/, data_prep/, analysis/,
bench/, launch/) call these.

Each first installs the quiet filters and the launchers' hooks, before the command's own imports
can print, then runs the command's `main()` (megatron_kappa/entry.py: `run`).
"""
from __future__ import annotations

from megatron_kappa.entry import run


def pretrain() -> None:
    run("megatron_kappa.cli.pretrain")


def plan() -> None:
    run("megatron_kappa.plan.__main__")


def plan_tables() -> None:
    run("megatron_kappa.plan.tables")


def prep() -> None:
    run("megatron_kappa.data_prep.fineweb_edu")


def export() -> None:
    run("megatron_kappa.export.__main__")


def eval_core() -> None:
    run("megatron_kappa.cli.eval_core")


def eval_loss() -> None:
    run("megatron_kappa.cli.eval_loss")


def generate() -> None:
    run("megatron_kappa.cli.generate")


def consolidate() -> None:
    run("megatron_kappa.cli.consolidate")


def config() -> None:
    run("megatron_kappa.config.__main__")


def summary() -> None:
    run("megatron_kappa.summary.__main__")
