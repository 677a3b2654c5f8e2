"""Training: the loop and what it needs.

loop.py        run(cfg): setup → data → steps → metrics/checkpoints (the algorithm)
recipe.py      the paper's recipe: learning-rate schedules, the κ freeze, the κ L2 penalty
schedule.py    the main learning-rate and weight-decay schedules, each group's peak values
optimizer.py   parameter groups and the optimizer built from them
matrix_optim.py the orthogonalised update of Muon and Aurora (the math)
muon.py        Muon/Aurora inside DeepSpeed's ZeRO: parameter tags, matrix blocks, the patched update
data.py        megatron-core datasets, the resumable batch order, batches to the device
checkpoint.py  atomic checkpoints that store each weight once
metrics.py     metrics.jsonl, TensorBoard, κ and router statistics
analysis.py    the paper's analyses per MoE layer (alignment, gate bias, κ/α/b, router load)
softmoe_metrics.py the SoftMoE router's per-layer budgets and experts run per token
preemption.py  SIGUSR1/SIGTERM: every rank stops after the same step, checkpoints, exits 75
"""
