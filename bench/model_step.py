"""Whole-model forward + backward as ratios (megatron_kappa/bench/model_step.py, `--help`)."""
from megatron_kappa.cli import commands

if __name__ == "__main__":
    commands.run("megatron_kappa.bench.model_step")
