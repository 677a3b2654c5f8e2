"""The local lm-eval tasks' data, read wherever lm_eval runs: a relative `data_files` path is taken
from the repository root (the folder above eval/), not from the working directory."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load(data_files: dict, **_):
    """lm-eval's `custom_dataset`: the task's json lines as a DatasetDict, its relative paths made
    absolute from the repository root."""
    import datasets
    files = {split: str(path if Path(path).is_absolute() else ROOT / path) for split, path in data_files.items()}
    return datasets.load_dataset("json", data_files=files)
