"""metrics.jsonl and TensorBoard: one JSON line per log interval in <run.dir>/metrics.jsonl and
the same scalars to TensorBoard, written by global rank 0."""
from __future__ import annotations

import json
import os
from pathlib import Path


class MetricsLog:
    """Writes on global rank 0 only; other ranks hold a no-op instance."""

    def __init__(self, run_dir: str | Path, tensorboard: bool, enabled: bool):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(Path(run_dir) / "tb"))

    def truncate_after(self, step: int):
        """On resume: drop lines a killed run logged past its last checkpoint."""
        if not self.enabled or not self.path.is_file():
            return
        keep = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)

    def write(self, record: dict):
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])
            self.tb.flush()

    def close(self):
        if self.tb is not None:
            self.tb.close()
