"""argparse types for the command lines' numbers: a bad value is argparse's one error line, before
any work (planner, evaluation)."""
from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number ≥ 0, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number ≥ 0, got {text!r}")
    return value


def add_checkpoint_arguments(parser: argparse.ArgumentParser):
    """--checkpoint and --step, as every tool that reads a trained checkpoint takes them (the export,
    eval/generate.py, eval/core.py, eval/loss.py, launch/consolidate.py; megatron_kappa.checkpoint.listing.locate)."""
    parser.add_argument("--checkpoint", required=True,
                        help="a training run directory (its latest checkpoint that verifies), or one of its "
                             "checkpoint folders, <run>/checkpoints/step_<N>")
    parser.add_argument("--step", type=positive_int,
                        help="the checkpoint of this step (default: the latest that verifies); a step that is "
                             "missing or damaged is refused in one line, never replaced by another")
    parser.set_defaults(run_dir=None)  # the run directory, once the tool has found it
