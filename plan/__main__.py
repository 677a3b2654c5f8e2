"""`python -m plan`: the memory planner's command line (megatron_kappa/plan/; `--help`)."""
from megatron_kappa.cli import commands

if __name__ == "__main__":
    commands.plan()
