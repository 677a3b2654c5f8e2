"""A study's table, rebuilt from its runs (megatron_kappa/analysis/study_table.py)."""
from megatron_kappa.cli import commands

if __name__ == "__main__":
    commands.run("megatron_kappa.analysis.study_table")
