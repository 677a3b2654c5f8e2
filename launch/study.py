"""A multi-seed study of variants × seeds (megatron_kappa/cli/study.py, `--help`)."""
from megatron_kappa.cli import commands

if __name__ == "__main__":
    commands.run("megatron_kappa.cli.study")
