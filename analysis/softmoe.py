"""The SoftMoE allocation figure of a run (megatron_kappa/analysis/softmoe.py, `--help`)."""
from megatron_kappa.cli import commands

if __name__ == "__main__":
    commands.run("megatron_kappa.analysis.softmoe")
