"""CORE evaluation of a trained checkpoint (docs/core_eval.md; megatron_kappa/cli/eval_core.py, `--help`)."""
from megatron_kappa.cli import commands

if __name__ == "__main__":
    commands.eval_core()
