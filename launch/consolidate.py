"""A run's checkpoint as one full state dict (megatron_kappa/cli/consolidate.py, `--help`)."""
from megatron_kappa.cli import commands

if __name__ == "__main__":
    commands.consolidate()
