"""`python -m analysis.kappa_range`: κ's spread at the end of a study's runs
(megatron_kappa/analysis/kappa_range.py)."""
from megatron_kappa.cli import commands

if __name__ == "__main__":
    commands.run("megatron_kappa.analysis.kappa_range")
