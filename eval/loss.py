"""Validation loss and bits per byte of a checkpoint (megatron_kappa/cli/eval_loss.py, `--help`)."""
from megatron_kappa.cli import commands

if __name__ == "__main__":
    commands.eval_loss()
