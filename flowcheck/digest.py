"""Data digests (xxh3-128, fast) and manifest digests (sha256), as prefixed strings."""
from __future__ import annotations

import hashlib

import numpy as np
import xxhash

DATA_ALG = "xxh3-128"


def data_digest(buf) -> str:
    """xxh3-128 of a buffer's bytes (xxhash releases the GIL, so threads hash in parallel)."""
    if isinstance(buf, np.ndarray):
        buf = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    return f"{DATA_ALG}:{xxhash.xxh3_128(buf).hexdigest()}"


class DataHasher:
    """Incremental xxh3-128 for bytes that arrive in pieces (streamed files)."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def update(self, buf) -> None:
        if isinstance(buf, np.ndarray):
            buf = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
        self._h.update(buf)

    def hexdigest(self) -> str:
        return f"{DATA_ALG}:{self._h.hexdigest()}"


def file_digest(path: str, block: int = 8 << 20) -> tuple[int, str]:
    """(size, xxh3-128) of a local file, read in blocks."""
    h = DataHasher()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def sha256(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()
