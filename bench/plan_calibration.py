"""`python -m bench.plan_calibration`: the planner's step time against measured ones
(megatron_kappa/bench/plan_calibration.py)."""
from megatron_kappa.cli import commands

if __name__ == "__main__":
    commands.run("megatron_kappa.bench.plan_calibration")
