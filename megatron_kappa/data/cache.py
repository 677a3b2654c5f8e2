"""The dataset index cache (`data.cache_dir`, by default `<run.dir>/data_cache`): a write into it
that fails (a full disk) is one line naming the folder, and leaves none of its files behind.

megatron-core writes its document, sample and shuffle indices with numpy.save and wraps the
OSError in two exceptions of its own (three chained tracebacks, no word of the disk); a half-
written index left there would be read back by the next start as if it were whole.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path


class DataCacheError(RuntimeError):
    """The dataset index cache could not be written; the message is one line."""


def _os_error(error: BaseException | None) -> OSError | None:
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def writing_cache(folder: str | Path, describe):
    """Run the dataset builder: an OSError of a write into `folder` (however megatron-core wrapped
    it) becomes a DataCacheError, after the files this build made there are removed. `describe`:
    (error, folder) -> the failure in words (the trainer's: checkpoint.listing.write_failure)."""
    folder = Path(folder)
    before = set(folder.iterdir()) if folder.is_dir() else set()
    try:
        yield
    except Exception as e:
        cause = _os_error(e)
        name = cause.filename if cause is not None and isinstance(cause.filename, str) else None
        if cause is None or (name and not os.path.abspath(name).startswith(str(folder.absolute()))):
            raise  # not a write into the cache (a shard that cannot be read names itself)
        for path in (set(folder.iterdir()) if folder.is_dir() else set()) - before:
            path.unlink(missing_ok=True)
        raise DataCacheError(f"data: the dataset index cache in {folder} could not be written: "
                             f"{describe(cause, folder)}; none of its new files were kept: free space there "
                             "(or set data.cache_dir) and run again") from None
