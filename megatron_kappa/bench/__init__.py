"""What the benchmarks in bench/ share: a toy model and tokenizer, interleaved timing, and the
benchmarks whose functions other benchmarks and the tests use (run them as bench/<name>.py).

Modules:
  interleave.py        Timing variants against each other in one process, their steps interleaved
  model_step.py        Whole-model forward + backward from `build_model`, on this machine's device,
                       as ratios
  optimizers.py        AdamW vs Muon vs Aurora at the demo's scale: losses and step time, as ratios
                       against AdamW
  plan_calibration.py  The planner's step-time estimate against measured step times on this machine
                       (issue 37)
  toy.py               Tiny stand-ins for tests and benchmarks: a byte-level tokenizer and a small
                       causal LM
"""
