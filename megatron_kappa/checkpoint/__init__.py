"""Checkpoints of a run: `listing` says which exist (no torch), `store` saves and loads them."""
