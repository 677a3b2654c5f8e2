"""Evaluation of a causal LM: CORE (DCLM's in-context tasks) and validation loss / bits per byte.

Modules:
  bundle.py       CORE evaluation bundles (DCLM's / nanochat's format): reading, validating,
                  baselines
  cli.py          What the evaluation command lines (eval/core.py, eval/loss.py) share: join the
                  launcher's process group, load a checkpoint, split the work over data-parallel
                  ranks, write the result on rank 0, and leave the group so that every rank exits
                  cleanly
  core.py         CORE: DCLM's in-context-learning tasks scored the way nanochat scores them
                  (docs/core_eval.md)
  core_subset.py  The quick CORE subset the paper's pipeline logged during training
                  (`eval.core_every`)
  generation.py   Continuing a prompt with the trained model: greedy or sampled (temperature, top-k,
                  top-p), with a key/value cache
  lm_loss.py      Validation loss and bits per byte of a causal LM on held-out token documents
  loading.py      A trained checkpoint as a plain logits function, for evaluation
"""
