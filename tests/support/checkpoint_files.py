"""Damage done to a checkpoint's files on purpose, for the tests of what a load refuses."""
from pathlib import Path


def flip_one_byte(path: Path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
