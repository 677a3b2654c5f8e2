"""Training: the loop and what it needs step by step (data, pipeline stages, the κ recipe, stop signals).

Modules:
  data.py        Training data through megatron-core's datasets: GPTDataset over indexed shards
                 (weighted blends, train/valid split), the authors' best-fit rows (data.packing:
                 bestfit, megatron_kappa.data.bestfit) or MockGPTDataset, a deterministic batch
                 order that resumes from a step number alone, and the move of each batch to the
                 device (pinned, non-blocking)
  divergence.py  A run whose loss or gradients are no longer numbers stops, and says so in one line,
                 without a checkpoint of the dead model (Megatron-LM's --check-for-nan-in-loss-and-
                 grad is the model)
  hf_exports.py  Hugging Face exports written while the run goes on (checkpoint.hf_every,
                 checkpoint.hf_keep)
  loop.py        The training job: config → model/parallel setup → data → train loop →
                 checkpoints/metrics → eval
  pipeline.py    The training step with pipeline stages (`parallel.pp > 1`): megatron-core's 1F1B
                 schedule over this rank's micro-batches, DeepSpeed's ZeRO-1 for the reduction and
                 the update
  preemption.py  Stopping a run cleanly when the scheduler says so: finish the step, checkpoint,
                 exit 75
  profiling.py   The profiler in training (`profile`): a torch.profiler trace of the chosen steps on
                 the chosen ranks, Megatron-style NVTX ranges on CUDA, and a CUDA memory snapshot on
                 request
  recipe.py      What the paper's recipe does to κ's α and b during training: the freeze, the U ramp
                 and the κ L2 penalty
  run_lock.py    One training per run directory: `<run.dir>/.lock`, held for the run's life
"""
