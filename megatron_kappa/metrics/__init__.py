"""What a run reports: metrics.jsonl and TensorBoard, κ and router statistics, the paper's
analyses per MoE layer and the throughput (a router's own metrics, SoftMoE's budgets, come from
its registry entry).

Modules:
  log.py             metrics.jsonl, TensorBoard and W&B: one JSON line per log interval in
                     <run.dir>/metrics.jsonl, the same scalars to TensorBoard and Weights & Biases,
                     written by global rank 0
  memory.py          Peak memory for the step line and metrics.jsonl, the largest over all ranks
  paper_analyses.py  The paper's analyses (arXiv 2606.00761 §5; docs/analysis.md) as metrics, per
                     MoE layer
  stats.py           κ's spread and the router losses for metrics.jsonl: κ statistics per MoE layer
                     from the last forward's logits, the aux and z losses that entered the objective
  step_line.py       The step line (one per logged step) and the line that ends a run, from a
                     metrics.jsonl record
  throughput.py      Throughput accounting: model FLOPs per token, achieved TFLOP/s per GPU, and MFU
  wandb_run.py       Weights & Biases beside metrics.jsonl (`log.wandb`): the resolved config and
                     the same records, one W&B run per run.dir that every resume continues
"""
