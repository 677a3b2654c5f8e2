"""Continue a prompt with a trained model (megatron_kappa/cli/generate.py, `--help`)."""
from megatron_kappa.cli import commands

if __name__ == "__main__":
    commands.generate()
