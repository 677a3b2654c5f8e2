"""Inputs: local parquet/jsonl files (paths, globs, folders) or a streamed hub dataset.

Work is cut into *units* whose order fixes the output order: a parquet row group, a byte range of a
jsonl file (lines belong to the range they start in), or, for the hub, a batch of streamed records.
Local units are small descriptors that workers read themselves, so the main process never touches
document text; hub units carry their records. Every file is checked (exists, not empty, readable,
has the needed columns) before any work starts.
"""
from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from megatron_kappa.data_prep import DataPrepError

FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}
HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")

# Row status codes returned by workers: why a row was not kept (0 = kept).
KEPT, EMPTY, LANGUAGE, SCORE = 0, 1, 2, 3
STATUS_NAMES = {EMPTY: "empty_text", LANGUAGE: "language", SCORE: "int_score"}


@dataclass(frozen=True)
class Selection:
    """Which columns are read and which rows are kept (FineWeb-Edu column names by default)."""
    text: str = "text"
    min_int_score: int | None = None
    languages: tuple[str, ...] | None = None
    score_column: str = "int_score"
    language_column: str = "language"

    def columns(self) -> list[str]:
        cols = [self.text]
        if self.languages:
            cols.append(self.language_column)
        if self.min_int_score is not None:
            cols.append(self.score_column)
        return cols

    def status(self, batch: dict) -> list[int]:
        """Per-row status (KEPT, EMPTY, LANGUAGE, SCORE) for a dict of column lists."""
        texts = batch[self.text]
        out = [KEPT if t else EMPTY for t in texts]
        if self.languages:
            langs = set(self.languages)
            out = [s or (LANGUAGE if lang not in langs else KEPT)
                   for s, lang in zip(out, batch[self.language_column])]
        if self.min_int_score is not None:
            k = self.min_int_score
            out = [s or (SCORE if score is None or score < k else KEPT)
                   for s, score in zip(out, batch[self.score_column])]
        return out


def is_hub_name(spec: str) -> bool:
    """`owner/name` that is not a local path or glob: a hub dataset."""
    return (HUB_NAME.fullmatch(spec) is not None and not os.path.exists(spec)
            and not glob.has_magic(spec))


def resolve_files(specs: list[str]) -> list[Path]:
    """Expand paths, globs and folders (recursively) into a list of supported files, in order."""
    files: list[Path] = []
    for spec in specs:
        if os.path.isdir(spec):
            found = sorted(p for p in Path(spec).rglob("*") if p.suffix in FORMATS and p.is_file())
            if not found:
                raise DataPrepError(f"{spec}: folder holds no .parquet, .jsonl or .json files")
        elif glob.has_magic(spec):
            found = sorted(Path(p) for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not found:
                raise DataPrepError(f"{spec}: no files match")
        elif os.path.isfile(spec):
            found = [Path(spec)]
        else:
            raise DataPrepError(f"{spec}: no such file, folder, glob or hub dataset (owner/name)")
        for path in found:
            if path.suffix not in FORMATS:
                raise DataPrepError(f"{path}: unsupported file type (expected .parquet, .jsonl or .json)")
            if path not in files:
                files.append(path)
    return files


def check_file(path: Path, columns: list[str]) -> dict:
    """Cheap up-front check of one file; returns its description (format, bytes, row groups)."""
    if not os.access(path, os.R_OK):
        raise DataPrepError(f"{path}: not readable")
    size = path.stat().st_size
    if size == 0:
        raise DataPrepError(f"{path}: empty file")
    fmt = FORMATS[path.suffix]
    info = {"path": str(path), "format": fmt, "bytes": size}
    if fmt == "parquet":
        try:
            meta = pq.ParquetFile(path).metadata
        except Exception as e:  # pyarrow raises several types for a bad footer
            raise DataPrepError(f"{path}: corrupt or not a parquet file ({_short(e)})") from None
        names = set(meta.schema.to_arrow_schema().names)
        info["rows"] = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    else:
        first = _first_record(path)
        names = set(first)
    _require(path, columns, names)
    return info


def _require(where, columns: list[str], names) -> None:
    missing = [c for c in columns if c not in names]
    if missing:
        hint = ("set the text column with --text-column" if missing[0] == columns[0]
                else "needed by --language/--min-int-score")
        raise DataPrepError(f"{where}: no column {missing[0]!r} (columns: {', '.join(sorted(names))}); "
                            f"{hint}")


def _first_record(path: Path) -> dict:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise DataPrepError(f"{path}: line {number} is not JSON ({_short(e)})") from None
                if not isinstance(record, dict):
                    raise DataPrepError(f"{path}: line {number} is not a JSON object")
                return record
    raise DataPrepError(f"{path}: no records (only blank lines)")


def local_units(files: list[dict], jsonl_unit_bytes: int) -> list[tuple]:
    """The ordered work units of checked local files."""
    units = []
    for info in files:
        if info["format"] == "parquet":
            units += [("parquet", info["path"], rg) for rg, n in enumerate(info["rows"]) if n]
        else:
            size = info["bytes"]
            units += [("jsonl", info["path"], start, min(start + jsonl_unit_bytes, size))
                      for start in range(0, size, jsonl_unit_bytes)]
    return units


def read_unit(unit: tuple, columns: list[str]) -> dict:
    """Column lists of one local unit (run inside workers). Errors name the file."""
    kind, path = unit[0], unit[1]
    if kind == "parquet":
        try:
            table = pq.ParquetFile(path).read_row_group(unit[2], columns=columns)
        except Exception as e:
            raise DataPrepError(f"{path}: row group {unit[2]}: corrupt parquet ({_short(e)})") from None
        return {c: table.column(c).to_pylist() for c in columns}
    return _read_jsonl_range(path, unit[2], unit[3], columns)


def _read_jsonl_range(path: str, start: int, end: int, columns: list[str]) -> dict:
    out = {c: [] for c in columns}
    with open(path, "rb") as f:
        if start:
            f.seek(start - 1)
            f.readline()  # finish the line that began before `start` (it belongs to the last unit)
        pos = f.tell()
        while pos < end:
            line = f.readline()
            if not line:
                break
            if line.strip():
                try:
                    record = json.loads(line)
                    out[columns[0]].append(record[columns[0]])
                except (ValueError, KeyError, TypeError) as e:
                    raise DataPrepError(f"{path}: byte {pos}: bad record, expected a JSON object "
                                        f"with {columns[0]!r} ({_short(e)})") from None
                for c in columns[1:]:
                    out[c].append(record.get(c))
            pos += len(line)
    return out


def open_hub(name: str, config: str | None, split: str, columns: list[str]):
    """A streamed hub dataset restricted to `columns`; checked by reading its first record."""
    try:
        import datasets
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
        first = next(iter(ds))
    except Exception as e:
        raise DataPrepError(f"{name}: no such local path, and cannot open it as a hub dataset "
                            f"(config {config}, split {split}): {_short(e)}") from None
    _require(name, columns, first)
    return ds.select_columns(columns)


def hub_units(ds, columns: list[str], unit_docs: int, skip_units: int = 0):
    """Batches of `unit_docs` streamed records; resuming re-streams (but does not re-tokenize)."""
    if skip_units:
        ds = ds.skip(skip_units * unit_docs)
    batch = {c: [] for c in columns}
    for record in ds:
        for c in columns:
            batch[c].append(record[c])
        if len(batch[columns[0]]) == unit_docs:
            yield ("hub", batch)
            batch = {c: [] for c in columns}
    if batch[columns[0]]:
        yield ("hub", batch)


def _short(e: Exception) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__
