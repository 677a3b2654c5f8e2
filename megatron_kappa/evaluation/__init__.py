"""Evaluation of a causal LM: CORE (DCLM's in-context tasks) and validation loss / bits per byte.

bundle.py       CORE bundles: reading, validation, random baselines
core.py         CORE scoring (nanochat's rules), batched and split over ranks
lm_loss.py      validation loss and bits per byte on held-out shards
loading.py      a trained checkpoint as a logits function, in its layout or consolidated
core_subset.py  the quick CORE subset logged during training
"""
