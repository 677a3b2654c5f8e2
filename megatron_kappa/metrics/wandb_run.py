"""Weights & Biases beside metrics.jsonl (`log.wandb`): the resolved config and the same records,
one W&B run per run.dir that every resume continues.

Written by global rank 0 only, as metrics.jsonl. The run's id is kept in <run.dir>/wandb/run_id,
so a resume passes it back with resume="allow" (Megatron-LM and torchtitan do the same with a
user-given id). Records are logged against their own `step` key (define_metric), not W&B's
internal step: a resume after a kill logs again the steps past the last checkpoint, which W&B
would drop with `step=` (it refuses a step below one it has seen) and here are kept, as in
metrics.jsonl's history. `wandb` is imported only when log.wandb.mode is not "disabled".
"""
from __future__ import annotations

import secrets
import sys
from pathlib import Path

from megatron_kappa.config import WandbConfig


def run_id_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "wandb" / "run_id"


def _run_id(run_dir: Path) -> str:
    """The run.dir's W&B id: the one its first start wrote, or a new one (W&B's own alphabet)."""
    path = run_id_path(run_dir)
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    new = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(8))
    path.write_text(new + "\n")
    return new


class WandbRun:
    """A W&B run for one start of a training run; every method is a no-op after a failure, which
    is one warning line (the run goes on: its checkpoints, not its metrics, resume it)."""

    def __init__(self, run_dir: str | Path, settings: WandbConfig, config: dict, log=print):
        self.run = None
        run_dir = Path(run_dir)
        try:
            import wandb
            run_id = _run_id(run_dir)
            name = config.get("run", {}).get("name") or run_dir.name  # run.name, as the exported card's title
            self.run = wandb.init(project=settings.project, entity=settings.entity, mode=settings.mode,
                                  dir=str(run_dir), id=run_id, resume="allow", name=name,
                                  config=config, settings=wandb.Settings(silent=True, console="off"))
            # a resume with allowed changes (train.steps, intervals...) logs this start's values
            self.run.config.update(config, allow_val_change=True)
            self.run.define_metric("step")
            self.run.define_metric("*", step_metric="step")
            folder = str(Path(self.run.dir).parent)
            log(f"W&B: run {run_id} " + (self.run.url if settings.mode == "online" else
                                         f"offline in {folder} (upload: wandb sync {folder})"))
        except Exception as e:  # wandb raises its own kinds (no API key, no network, a bad entity)
            self._fail("start", e)

    def _fail(self, what: str, error: BaseException):
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"warning: W&B: {what}: {first}; training goes on without it", file=sys.stderr, flush=True)
        if self.run is not None:
            try:
                self.run.finish(exit_code=1, quiet=True)
            except Exception:
                pass
        self.run = None

    def log(self, record: dict):
        if self.run is None:
            return
        try:
            self.run.log({k: v for k, v in record.items() if isinstance(v, (int, float))})
        except Exception as e:
            self._fail("log", e)

    def close(self):
        """Finish the run and wait until its files are written: finish() leaves the transaction log
        to wandb's service process, which writes it later; teardown stops the service after it has."""
        if self.run is None:
            return
        try:
            import wandb
            self.run.finish()
            wandb.teardown()
        except Exception as e:
            self._fail("finish", e)
        self.run = None
