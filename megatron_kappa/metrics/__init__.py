"""What a run reports: metrics.jsonl and TensorBoard, κ and router statistics, the paper's
analyses per MoE layer and the throughput (a router's own metrics, SoftMoE's budgets, come from
its registry entry).

Modules:
  log.py             metrics.jsonl and TensorBoard: one JSON line per log interval in
                     <run.dir>/metrics.jsonl and the same scalars to TensorBoard, written by global
                     rank 0
  paper_analyses.py  The paper's analyses (arXiv 2606.00761 §5; docs/analysis.md) as metrics, per
                     MoE layer
  stats.py           κ's spread and the router losses for metrics.jsonl: κ statistics per MoE layer
                     from the last forward's logits, the aux and z losses that entered the objective
  throughput.py      Throughput accounting: model FLOPs per token, achieved TFLOP/s per GPU, and MFU
"""
