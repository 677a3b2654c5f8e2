"""Which checkpoints a run directory holds, read without torch (the preflight, the study, the
plots and evaluation all ask; megatron_kappa.checkpoint.store writes them)."""
from __future__ import annotations

import json
import os
from pathlib import Path


def atomic_write_text(path: Path, text: str):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class CheckpointDir:
    """<run_dir>/checkpoints: step_<N>/ folders, complete once their meta.json exists."""

    def __init__(self, run_dir: str | Path, keep: int = 1):
        self.root = Path(run_dir) / "checkpoints"
        self.tmp = self.root / ".tmp"
        self.keep = keep

    def complete(self) -> list[int]:
        """Steps of the fully written checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(int(d.name[5:]) for d in self.root.glob("step_*")
                      if d.name[5:].isdigit() and (d / "meta.json").is_file())

    def latest(self) -> int | None:
        done = self.complete()
        return done[-1] if done else None

    def folder(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def meta(self, step: int) -> dict:
        return json.loads((self.folder(step) / "meta.json").read_text())
