"""Figures of a training run (megatron_kappa/analysis/plots.py, `--help`)."""
from megatron_kappa.cli import commands

if __name__ == "__main__":
    commands.run("megatron_kappa.analysis.plots")
