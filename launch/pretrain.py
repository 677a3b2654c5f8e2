"""Pre-train a κ-SwiGLU MoE: `deepspeed launch/pretrain.py --config configs/sandwich28.yaml`
(megatron_kappa/cli/pretrain.py says the rest; `--help`)."""
from megatron_kappa.cli import commands

if __name__ == "__main__":
    commands.pretrain()
