"""Write one zarr v3 shard file directly: the local tier's hot path for uncompressed shards.

zarr's own write path assembles every shard in memory (a full copy), runs a
Python-level codec pipeline per inner chunk and hands us one big buffer; for
uncompressed data the format is simple enough to stream straight from the
array: per inner chunk its raw little-endian bytes plus a CRC32C, then the
shard index ((offset, nbytes) uint64 pairs, little-endian) plus its CRC32C
(sharding codec, ``index_location: end``, as zarr writes it).  The metadata
(``zarr.json``) still comes from zarr, and every file written here is read back
by zarr in the tests.
"""
from __future__ import annotations

import math
import os

import google_crc32c
import numpy as np

from flowcheck import _native
from flowcheck.digest import DataHasher

FLUSH_EVERY = 64 << 20


def write_shard(path: str, arr: np.ndarray, chunk_rows: int) -> tuple[int, str]:
    """Write ``arr`` as one shard of inner chunks of ``chunk_rows`` rows; return (bytes, xxh3 of the file)."""
    if arr.ndim == 0 or arr.size == 0 or not arr.flags.c_contiguous or arr.dtype.byteorder == ">":
        raise ValueError("write_shard takes a non-empty, C-contiguous, little-endian array of rank >= 1")
    rows = arr.shape[0]
    row_bytes = arr.nbytes // rows
    n_chunks = math.ceil(rows / chunk_rows)
    chunk_bytes = chunk_rows * row_bytes
    flat = arr.reshape(-1).view(np.uint8)
    hasher = DataHasher()
    index = np.empty((n_chunks, 2), dtype="<u8")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offset = 0
        for i in range(n_chunks):
            piece = flat[i * chunk_bytes:min((i + 1) * chunk_bytes, flat.nbytes)]
            pad = np.zeros(chunk_bytes - piece.nbytes, np.uint8)  # the last chunk is stored full-size
            crc = google_crc32c.extend(google_crc32c.value(piece), pad) if pad.size else google_crc32c.value(piece)
            tail = np.concatenate([pad, np.array([crc], dtype="<u4").view(np.uint8)])
            for part in (piece, tail):
                offset += _native.pwrite_all(fd, part, offset, FLUSH_EVERY)
                hasher.update(part)
            index[i] = (offset - chunk_bytes - 4, chunk_bytes + 4)
        raw_index = index.reshape(-1).view(np.uint8)
        footer = np.concatenate([raw_index, np.array([google_crc32c.value(raw_index)], dtype="<u4").view(np.uint8)])
        offset += _native.pwrite_all(fd, footer, offset)
        hasher.update(footer)
    finally:
        os.close(fd)
    return offset, hasher.hexdigest()
