"""The command lines: `commands` (what every console script and script beside the package calls:
the quiet filters first, then the command) and the commands of the scripts in launch/ and eval/.

Modules:
  commands.py     The command lines users run, each as one function: the console scripts of
                  pyproject.toml's [project.scripts] and the thin scripts beside the package (plan/,
                  eval/, data_prep/, analysis/, bench/, launch/) call these
  consolidate.py  Write the full weights of a run's latest checkpoint (or --step's) as one state
                  dict (any training layout)
  eval_core.py    CORE evaluation of a trained checkpoint (docs/core_eval.md)
  eval_loss.py    Validation loss and bits per byte of a trained checkpoint on held-out Megatron
                  shards
  generate.py     Continue a prompt with a trained model: greedy by default, or sampled
  launcher.py     The two launchers with this project's endings and without their known notices:
                  `kappa-deepspeed` and `kappa-torchrun` (or `python -m megatron_kappa.cli.launcher
                  deepspeed|torchrun ...`), with the launchers' own arguments
  pretrain.py     Pre-train a κ-SwiGLU MoE
  study.py        Run a multi-seed study: every variant × seed as its own resumable run, evaluated,
                  then a table
"""
