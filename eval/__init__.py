"""Evaluation entry points (core.py: CORE; loss.py: validation loss and bits per byte)."""
