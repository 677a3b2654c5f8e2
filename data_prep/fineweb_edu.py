"""A text corpus → SentencePiece → Megatron shards (megatron_kappa/data_prep/fineweb_edu.py, `--help`)."""
from megatron_kappa.cli import commands

if __name__ == "__main__":
    commands.prep()
