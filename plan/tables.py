"""`python -m plan.tables`: docs/plan.md's tables of the published runs (megatron_kappa/plan/tables.py)."""
from megatron_kappa.cli import commands

if __name__ == "__main__":
    commands.plan_tables()
