"""A run whose loss or gradients are no longer numbers stops, and says so in one line, without a
checkpoint of the dead model (Megatron-LM's --check-for-nan-in-loss-and-grad is the model).

A step is bad when its loss or global gradient norm is not finite, or when DeepSpeed skipped it
for an overflow (its own check found non-finite gradients: the weights were not updated, and a
run that only skips is as dead). `train.nonfinite_steps` consecutive bad steps end the run. The
count is kept on the device, so it costs no host sync: it is read on logging and checkpoint steps,
where the loop reads the loss anyway. A checkpoint step whose last step was bad writes nothing.
"""
from __future__ import annotations

import math


class TrainingDiverged(RuntimeError):
    """The run stopped on non-finite numbers; the message is one line naming the step and the last
    good checkpoint."""


class BadSteps:
    """Consecutive bad steps, counted on `device`."""

    def __init__(self, limit: int, device, skipped_steps: int = 0):
        import torch  # here, not at the top: launch/pretrain.py imports TrainingDiverged before torch
        self.limit = limit  # 0: never stop
        self.run = torch.zeros((), dtype=torch.long, device=device)  # bad steps in a row, up to now
        self.worst = torch.zeros((), dtype=torch.long, device=device)  # the longest such run since the last read
        self.skipped = skipped_steps  # DeepSpeed's count of skipped steps, as last seen

    def observe(self, loss, grad_norm, skipped_steps: int):
        """One step: its loss (a device tensor), its gradient norm (a float, a tensor or None) and
        DeepSpeed's running count of skipped steps."""
        import torch
        bad = ~torch.isfinite(loss.detach())
        if isinstance(grad_norm, torch.Tensor):
            bad = bad | ~torch.isfinite(grad_norm.detach().to(bad.device))
        elif grad_norm is not None and not math.isfinite(grad_norm):
            bad = torch.ones_like(bad)
        if skipped_steps > self.skipped:
            bad = torch.ones_like(bad)
        self.skipped = skipped_steps
        self.run = (self.run + 1) * bad
        self.worst = torch.maximum(self.worst, self.run)

    def read(self) -> tuple[int, int]:
        """(bad steps in a row up to now, the longest run since the last read): a host sync."""
        run, worst = int(self.run), int(self.worst)
        self.worst = self.run.clone()
        return run, worst

    def diverged(self, worst: int) -> bool:
        return self.limit > 0 and worst >= self.limit
