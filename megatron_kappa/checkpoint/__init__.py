"""Checkpoints of a run: `listing` says which exist (no torch), `store` saves and loads them.

Modules:
  listing.py  Which checkpoints a run directory holds, read without torch (the preflight, the study,
              the plots and evaluation all ask; megatron_kappa.checkpoint.store writes them)
  store.py    Atomic, resumable checkpoints that store every weight once
"""
