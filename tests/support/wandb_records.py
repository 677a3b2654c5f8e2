"""The records of a W&B run's transaction log (<run dir>/run-<id>.wandb), read without a server.

wandb 0.31 writes it from its Go core and ships no Python reader; the format is LevelDB's log
(a 7-byte header ":W&B", 0xBEE1, version 0; then 32 KiB blocks of chunks, each with a CRC-32 of its
type byte and data, a length and a type: full, first, middle, last), each record one of wandb's own
protobuf `Record`s (wandb.proto.wandb_internal_pb2), parsed with wandb's own classes.
"""
import json
import struct
import zlib
from pathlib import Path

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb
    data = Path(path).read_bytes()
    ident, magic, version = data[:4], *struct.unpack("<HB", data[4:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a W&B transaction log"
    out, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (crc, length, kind) == (0, 0, 0):
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: checksum mismatch at byte {pos}"
        pending += chunk
        pos += 7 + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def run_summary(path: str | Path) -> dict:
    """{"id", "config" (the last value of each top-level key), "history" (one dict per logged row,
    W&B's own _step/_runtime/_timestamp left out)} of one run file."""
    run_id, config, history = None, {}, []
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run_id = r.run.run_id
            config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            history.append({k: v for k, v in row.items() if not k.startswith("_")})
    config.pop("_wandb", None)
    return {"id": run_id, "config": config, "history": history}


def run_files(run_dir: str | Path) -> list[Path]:
    """The offline runs' transaction logs under <run.dir>/wandb, oldest first."""
    return sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
