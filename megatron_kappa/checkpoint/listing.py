"""Which checkpoints a run directory holds, read without torch (the preflight, the study, the
plots and evaluation all ask; megatron_kappa.checkpoint.store writes them)."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
import zlib
from pathlib import Path

from megatron_kappa.config import ConfigError

_WARNED: set = set()  # damaged-checkpoint warnings already printed by this process
_SUMS: dict = {}  # (path, size, mtime_ns) → checksum, so that a process reads a file once
CHUNK = 1 << 24


def file_checksum(path: Path) -> str:
    """CRC-32 of a file's bytes ("crc32:<8 hex digits>"): zlib's, which reads faster than the disk
    writes (its cost beside a save: docs/benchmarks.md); it catches a flipped bit or a zeroed
    block, which a size cannot (it is no defence against a deliberate change)."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _SUMS:
        crc = 0
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                crc = zlib.crc32(chunk, crc)
        _SUMS[key] = f"crc32:{crc:08x}"
    return _SUMS[key]


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (megatron_kappa.checkpoint.store); the message is one line."""


FULL_BELOW = 64 << 20  # a failed write with less free space than this is read as a full disk
OTHER_CAUSE = re.compile(r"No such file|Permission denied|Read-only file system|Not a directory|Is a directory")


def write_failure(error: BaseException, folder) -> str:
    """A failed write in words for a one-line error: torch.save reports a full disk as
    "[enforce fail at inline_container.cc:672] unexpected pos ..." or "PytorchStreamWriter failed
    writing ...", which say nothing to a user; with (nearly) no space left in `folder` (the folder
    written to: its free space is the one that matters), it is said."""
    first = (str(error).splitlines() or [type(error).__name__])[0] or type(error).__name__
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return first
    code = getattr(error, "errno", None)
    # torch's wording hides the errno; a folder of a size-less file system (/proc, /sys) or an
    # error that names another cause is no full disk (it was called one: "0 MiB free in /proc")
    worded = code is None and usage.total > 0 and usage.free < FULL_BELOW and not OTHER_CAUSE.search(first)
    if code == errno.ENOSPC:  # the caller names the file; the errno's words add nothing
        return f"no space left on the device ({usage.free / 2**20:.0f} MiB free in {folder})"
    if worded:  # torch's or safetensors' words: kept, as what failed
        return f"no space left on the device ({usage.free / 2**20:.0f} MiB free in {folder}; the write failed " \
               f"with: {first[:120]})"
    return first


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

    def verify(self, step: int, content: bool = True) -> str | None:
        """None when the checkpoint's meta.json reads and every file it records is there at its
        recorded size and, with `content`, has its recorded checksum (checkpoints written before
        checksums, or sizes, were recorded: what they recorded); else what is wrong, in a few words."""
        folder = self.folder(step)
        try:
            meta = self.meta(step)
        except (OSError, ValueError) as e:
            return f"{folder / 'meta.json'}: unreadable ({type(e).__name__})"
        for name, size in meta.get("files", {}).items():
            path = folder / name
            if not path.is_file():
                return f"{path}: missing"
            if path.stat().st_size != size:
                return f"{path}: {path.stat().st_size} bytes, {size} written"
        if content:
            for name, written in meta.get("checksums", {}).items():
                path = folder / name
                try:
                    now = file_checksum(path)
                except OSError as e:
                    return f"{path}: unreadable ({type(e).__name__})"
                if now != written:
                    return f"{path}: checksum {now}, {written} written"
        return None

    def latest(self, warn=None, content: bool = True) -> int | None:
        """The newest complete checkpoint that verifies (its files' checksums too, with `content`:
        each file is read once per process); a damaged newer one is skipped with a one-line
        warning naming it (on stderr, once per process, unless `warn` is given)."""
        for step in reversed(self.complete()):
            problem = self.verify(step, content)
            if problem is None:
                return step
            message = f"warning: checkpoint {self.folder(step)} is damaged ({problem}); using the one before it"
            if warn is not None:
                warn(message)
            elif message not in _WARNED:
                _WARNED.add(message)
                print(message, file=sys.stderr, flush=True)
        return None

    def pick(self, step: int | None = None, flag: str = "--step") -> int:
        """The checkpoint a tool reads: `step`, which must be complete and verify (a damaged one is
        refused: when a step is asked for, no other is read in its place), or with None the
        latest that verifies (a damaged newer one skipped with its warning, as `latest`). Every
        refusal is one ConfigError line; a missing step lists the steps there are."""
        if step is None:
            latest = self.latest()
            if latest is None:
                raise ConfigError(f"--checkpoint: {self.root}: no complete checkpoint" + self._set_aside_note())
            return latest
        if step not in self.complete():
            steps = ", ".join(map(str, self.complete())) or "none"
            raise ConfigError(f"{flag}: {step}: no complete checkpoint at step {step} in {self.root} "
                              f"(available: {steps}){self._set_aside_note(step)}")
        problem = self.verify(step)
        if problem is not None:
            raise ConfigError(f"{flag}: {step}: checkpoint {self.folder(step)} is damaged ({problem}); "
                              "no other step is read in its place (leave out --step for the latest that verifies)")
        return step

    def _set_aside_note(self, step: int | None = None) -> str:
        """Where the trainer moved damaged checkpoints (checkpoints/damaged/), when it did."""
        aside = sorted(int(d.name[5:]) for d in (self.root / "damaged").glob("step_*") if d.name[5:].isdigit())
        if step is not None and step in aside:
            return f"; step {step} was set aside as damaged in {self.root / 'damaged'}"
        return f"; set aside as damaged: {', '.join(map(str, aside))}" if aside and step is None else ""

    def set_aside_damaged(self) -> list[int]:
        """Move complete-looking checkpoints that do not verify to checkpoints/damaged/ (so that
        rotation never keeps them in place of good ones); returns their steps. One writer only."""
        moved = []
        for step in self.complete():
            if self.verify(step, content=False) is not None:  # sizes: the trainer checks content at resume
                target = self.root / "damaged" / f"step_{step}"
                target.parent.mkdir(exist_ok=True)
                shutil.rmtree(target, ignore_errors=True)
                os.replace(self.folder(step), target)
                moved.append(step)
        return moved

    def record_files(self, folder: Path) -> dict:
        """{path relative to `folder`: size} of every file under it (what verify() checks)."""
        return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


    def folder(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def meta(self, step: int) -> dict:
        return json.loads((self.folder(step) / "meta.json").read_text())


STEP_FOLDER = re.compile(r"step_(\d+)")


def run_of(path: str | Path, step: int | None = None, flag: str = "--checkpoint") -> tuple[Path, int | None]:
    """(run directory, the step asked for or None) that a tool's `--checkpoint PATH [--step N]`
    names, from the path alone (no checkpoint is read): PATH is a run directory, its checkpoints/ folder,
    or one checkpoint folder, <run>/checkpoints/step_<N>, which names the step."""
    path = Path(path)
    named = STEP_FOLDER.fullmatch(path.name)
    if named and path.parent.name == "damaged":
        raise ConfigError(f"{flag}: {path}: a checkpoint the trainer set aside as damaged (its files do not "
                          "match their sizes or checksums); choose another step")
    if named and path.parent.name == "checkpoints":
        if step is not None and step != int(named.group(1)):
            raise ConfigError(f"--step: {step}, but {flag} {path} is the checkpoint of step {int(named.group(1))}; "
                              "give one of them")
        if path.is_dir() and not (path / "meta.json").is_file():
            raise ConfigError(f"{flag}: {path}: not a complete checkpoint (no meta.json: its save did not finish)")
        return path.parent.parent, int(named.group(1))
    if path.name == "checkpoints" and (path.parent / "config.yaml").is_file():
        return path.parent, step
    return path, step


def locate(path: str | Path, step: int | None = None, flag: str = "--checkpoint",
           need_config: bool = True) -> tuple[Path, int]:
    """(run directory, checkpoint step) for a tool's `--checkpoint PATH [--step N]` (`run_of`): the
    run's latest checkpoint that verifies, or the step asked for (by --step or by the folder),
    which is read or refused (CheckpointDir.pick): never another in its place. `need_config`: the
    run must have its config.yaml (every tool but consolidation builds the model from it)."""
    run, step = run_of(path, step, flag)
    if not need_config and not run.is_dir():  # consolidation said "<path>/checkpoints: no complete checkpoint"
        raise ConfigError(f"{flag}: {path}: no such folder (expected a training run directory, or one of its "
                          "checkpoints/step_<N> folders)")
    if need_config and not (run / "config.yaml").is_file():
        raise ConfigError(f"{flag}: {path}: no config.yaml (expected a training run directory, or one of its "
                          "checkpoints/step_<N> folders)")
    return run, CheckpointDir(run).pick(step)
