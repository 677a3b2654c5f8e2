"""The output folder: what is finished, what may be resumed, what must be refused.

A run keeps `<output>/.progress/state.json`: the settings that decide the output (its `config`)
and one record per checkpoint (a finished train shard and the small validation piece collected
alongside it, plus where in the input the next document starts). A shard is finished only once
its record is in state.json, which is replaced atomically after the shard files are renamed into
place; anything else found with our names (a `.tmp`, a shard renamed just before a kill) is deleted
on resume and redone. The finished run replaces state.json with manifest.json.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from megatron_kappa.data_prep import DataPrepError

STATE_DIR = ".progress"
OURS = re.compile(r"(train|valid)_\d{5}\.(bin|idx)(\.tmp)?|manifest\.json(\.tmp)?|tokenizer\.model(\.tmp)?")


def write_json(path: Path, obj) -> None:
    """Atomic: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fingerprint(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def _difference(old: dict, new: dict) -> str:
    """One line naming the first setting that differs."""
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            a, b = old.get(key), new.get(key)
            if key == "tokenizer":
                return (f"made with another tokenizer ({_brief(a)}), not this run's ({_brief(b)})")
            return f"made with other settings ({key}: {_brief(a)} there, {_brief(b)} now)"
    return "made with other settings"


def _brief(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 100 else text[:97] + "..."


def remove_ours(out: Path) -> None:
    """--overwrite: delete only files this tool writes (never anything else in the folder)."""
    shutil.rmtree(out / STATE_DIR, ignore_errors=True)
    for path in out.iterdir():
        if path.is_file() and OURS.fullmatch(path.name):
            path.unlink()


def open_output(out: Path, config: dict, run: dict, overwrite: bool) -> tuple[dict | None, dict | None]:
    """(state to resume or start, None) or (None, manifest of an identical finished run).

    Refuses, before any work, a folder holding another run's output or shards of unknown origin.
    """
    out.mkdir(parents=True, exist_ok=True)
    if overwrite:
        remove_ours(out)
    manifest_path, state_path = out / "manifest.json", out / STATE_DIR / "state.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("config") != config:
            raise DataPrepError(f"{out}: holds shards {_difference(manifest.get('config', {}), config)}"
                                "; use another --output or --overwrite")
        check_finished(out, manifest["shards"])
        shutil.rmtree(out / STATE_DIR, ignore_errors=True)  # killed after the manifest was written
        return None, manifest
    if state_path.exists():
        state = json.loads(state_path.read_text())
        if state["config"] != config:
            raise DataPrepError(f"{out}: holds an unfinished run {_difference(state['config'], config)}"
                                "; use another --output or --overwrite")
        if state["run"] != run:
            raise DataPrepError(f"{out}: unfinished run used {_difference(state['run'], run)}; "
                                "resume with the same arguments or use --overwrite")
        return state, None
    strays = sorted(p.name for p in out.iterdir() if OURS.fullmatch(p.name))
    if strays:
        raise DataPrepError(f"{out}: holds {strays[0]} not made by a run of this tool (no manifest.json "
                            "or progress record); use another --output or --overwrite")
    (out / STATE_DIR).mkdir(exist_ok=True)
    state = {"config": config, "run": run, "tokenizer_sha256": None, "checkpoints": [], "done": False}
    save(out, state)
    return state, None


def save(out: Path, state: dict) -> None:
    write_json(out / STATE_DIR / "state.json", state)


def check_finished(folder: Path, entries: list[dict]) -> None:
    """Finished shards must still be there with their recorded sizes."""
    for entry in entries:
        bin_path = folder / (entry["prefix"] + ".bin")
        idx_path = folder / (entry["prefix"] + ".idx")
        if not idx_path.exists() or not bin_path.exists() or bin_path.stat().st_size != entry["bin_bytes"]:
            raise DataPrepError(f"{bin_path}: finished shard is missing or changed size; "
                                "use --overwrite to start again")


def clean_unrecorded(out: Path, state: dict) -> None:
    """Delete partial files and shards renamed into place but never recorded (killed runs)."""
    recorded = {c["train"]["prefix"] for c in state["checkpoints"] if c["train"]}
    for path in out.iterdir():
        if OURS.fullmatch(path.name) and path.name.startswith(("train_", "valid_")):
            if path.name.endswith(".tmp") or path.name.split(".")[0] not in recorded:
                path.unlink()
        elif path.name.endswith(".tmp") and OURS.fullmatch(path.name):
            path.unlink()
    pieces = {c["valid"]["prefix"] for c in state["checkpoints"] if c["valid"]}
    for path in (out / STATE_DIR).iterdir():
        if path.name.startswith("valid_") and (path.name.endswith(".tmp")
                                               or path.name.split(".")[0] not in pieces):
            path.unlink()
