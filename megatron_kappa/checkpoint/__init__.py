"""Checkpoints of a run: `listing` says which exist (no torch), `store` saves and loads them.

Modules:
  async_save.py       Checkpoints that do not stop training (checkpoint.async_save)
  listing.py          Which checkpoints a run directory holds, read without torch (the preflight,
                      the study, the plots and evaluation all ask; megatron_kappa.checkpoint.store
                      writes them)
  optimizer_state.py  The optimizer state by parameter: ZeRO's flat partitions as tensors shaped
                      like the parameters, so that a checkpoint loads into any layout
  resume.py           What a resumed run may change: the config keys that shape the parameters or
                      the optimizer state (refused: the checkpoint could not be loaded, or would
                      load into another model), against everything else (intervals, logging, data
                      paths, learning-rate and κ schedules, losses' weights...: allowed, and
                      recorded in the run's config history)
  store.py            Atomic, resumable checkpoints that store every weight once and load into any
                      layout
"""
