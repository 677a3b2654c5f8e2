"""A checkpoint whose bytes changed at the right size (a zeroed block, a flipped bit) is found by
its files' checksums and treated as damaged: resume, evaluation, export and consolidation take the
checkpoint before it, with one line naming the file."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_kappa.checkpoint.listing import CheckpointDir, file_checksum
from megatron_kappa.config import load_config
from tests.support.checkpoint_files import flip_one_byte

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["data.mock=true", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=2",
         "log.tensorboard=false", "eval.valid_every=0", "checkpoint.interval=1", "checkpoint.keep=3"]


def zero_block(path: Path, offset: int, size: int = 65536):
    """64 KB zeroed inside the file: its size stays what meta.json recorded."""
    data = bytearray(path.read_bytes())
    assert len(data) > offset + size
    data[offset:offset + size] = bytes(size)
    path.write_bytes(bytes(data))


def test_the_checksum_is_zlibs_crc32_of_the_bytes(tmp_path):
    import zlib
    f = tmp_path / "x.bin"
    f.write_bytes(b"kappa" * 1000)
    assert file_checksum(f) == f"crc32:{zlib.crc32(b'kappa' * 1000):08x}"
    flip_one_byte(f)  # the same size, another sum (and the cache does not hide the change)
    assert file_checksum(f) != f"crc32:{zlib.crc32(b'kappa' * 1000):08x}"


@pytest.mark.slow
def test_a_damaged_checkpoint_of_the_right_size_is_skipped_everywhere(world1, tmp_path, capsys):
    from megatron_kappa.evaluation.loading import consolidated_state, load_model_for_eval
    from megatron_kappa.train import loop
    sets = TRAIN + [f"run.dir={tmp_path}"]
    loop.run(load_config("configs/tiny.yaml", [*sets, "train.steps=2"]), log=lambda *a: None)
    listing = CheckpointDir(tmp_path)
    meta = listing.meta(2)
    assert set(meta["checksums"]) == set(meta["files"]) == {"rank_0.pt"}
    victim = tmp_path / "checkpoints/step_2/rank_0.pt"
    size = victim.stat().st_size
    zero_block(victim, size // 3)
    assert victim.stat().st_size == size == meta["files"]["rank_0.pt"]
    # negative control: the sizes alone, as before, take the damaged checkpoint
    assert listing.verify(2, content=False) is None and listing.latest(content=False) == 2
    warnings = []
    assert listing.latest(warn=warnings.append) == 1
    assert len(warnings) == 1 and str(victim) in warnings[0] and "checksum" in warnings[0], warnings
    from megatron_kappa.checkpoint.store import Checkpoints
    step1 = Checkpoints(tmp_path).weights(1)
    capsys.readouterr()
    state = consolidated_state(tmp_path)  # consolidation: step 1's weights
    assert state.keys() == step1.keys() and all((state[k] == step1[k]).all() for k in state)
    load_model_for_eval(tmp_path)  # evaluation: step 1, no error
    lines = []
    loop.run(load_config("configs/tiny.yaml", [*sets, "train.steps=3", "train.allow_schedule_change=true"]),
             log=lines.append)  # resume: step 1
    assert any("resumed from" in line and "step_1" in line for line in lines), lines
    err = capsys.readouterr().err  # one line for the process (a warning is printed once per process)
    assert sum("is damaged" in line for line in err.splitlines()) == 1, err
    assert listing.complete() == [1, 2, 3] and listing.verify(2) is None  # step 2 trained and saved again
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss"] == r["loss"] for r in records)  # finite: the zeroed weights were never loaded


@pytest.mark.slow
def test_export_takes_the_checkpoint_before_a_damaged_one(world1, tmp_path):
    from megatron_kappa.train import loop
    sets = TRAIN + [f"run.dir={tmp_path / 'run'}"]
    loop.run(load_config("configs/tiny.yaml", [*sets, "train.steps=2"]), log=lambda *a: None)
    flip_one_byte(tmp_path / "run/checkpoints/step_2/rank_0.pt")
    done = subprocess.run([sys.executable, "-m", "megatron_kappa.export", "--checkpoint", str(tmp_path / "run"),
                           "--output", str(tmp_path / "hf")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step_2 is damaged" in done.stderr and "checksum" in done.stderr, done.stderr
    assert sum("is damaged" in line for line in done.stderr.splitlines()) == 1
