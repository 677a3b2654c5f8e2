"""metrics.jsonl and TensorBoard: one JSON line per log interval in <run.dir>/metrics.jsonl and
the same scalars to TensorBoard, written by global rank 0."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _warn(what: str, error: BaseException):
    """One line for a failed metrics write: the run goes on (its checkpoints, not its metrics, are
    what resumes it; a full disk stops it at the next checkpoint, in one line)."""
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    print(f"warning: {what}: {first}; training goes on without it", file=sys.stderr, flush=True)


class MetricsLog:
    """Writes on global rank 0 only; other ranks hold a no-op instance. A failed write is one
    warning line: metrics.jsonl keeps trying at each record, TensorBoard is dropped for the run."""

    def __init__(self, run_dir: str | Path, tensorboard: bool, enabled: bool):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = None
        self.failing = False
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            try:
                self.tb = SummaryWriter(str(Path(run_dir) / "tb"))
            except OSError as e:
                _warn(f"TensorBoard: {Path(run_dir) / 'tb'}", e)

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
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            self.failing = False
        except OSError as e:
            if not self.failing:  # once per failing spell, not once per step
                _warn(f"metrics: {self.path}", e)
            self.failing = True
        if self.tb is not None:
            try:
                for key, value in record.items():
                    if key != "step" and isinstance(value, (int, float)):
                        self.tb.add_scalar(key, value, record["step"])
                self.tb.flush()
            except OSError as e:
                _warn(f"TensorBoard: {self.tb.log_dir}", e)
                self.tb = None

    def close(self):
        if self.tb is not None:
            try:
                self.tb.close()
            except OSError as e:
                _warn(f"TensorBoard: {self.tb.log_dir}", e)
