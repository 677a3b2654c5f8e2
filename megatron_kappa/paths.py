"""Whether a folder can be made where a command line or a config says (one check for run.dir,
the study's --dir, the export's and consolidation's --output and the evaluations' --json, before
any work)."""
from __future__ import annotations

import os
import tempfile


def folder_problem(path) -> str | None:
    """Why a folder at `path` could not be made or written (its nearest existing ancestor is a
    file, or not writable), as the end of a one-line error; None when it can."""
    path = os.path.abspath(path)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a folder" + ("" if existing == path else f" (under which {path} would go)")
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    # access() grants root everything, and knows nothing of file systems that take no files
    # (/proc, /sys): a file made and removed there says it for sure
    try:
        fd, probe = tempfile.mkstemp(prefix=".kappa-write-check-", dir=existing)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"{existing} is not writable ({e.strerror or e})"
    return None


def output_file_problem(path) -> str | None:
    """Why a file could not be written at `path` (its folder cannot take files, or `path` is a
    folder), as the end of a one-line error; None when it can. For output files checked before
    the work that fills them (the evaluation CLIs' --json)."""
    return folder_problem(os.path.dirname(os.path.abspath(path))) or (
        f"{path} is a folder" if os.path.isdir(path) else None)
