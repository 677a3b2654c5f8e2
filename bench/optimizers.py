"""AdamW vs Muon vs Aurora at the demo's scale (megatron_kappa/bench/optimizers.py, `--help`)."""
from megatron_kappa.cli import commands

if __name__ == "__main__":
    commands.run("megatron_kappa.bench.optimizers")
