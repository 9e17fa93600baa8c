"""Write and read zarr v3 shard files directly: the local tier's hot path for uncompressed data.

zarr's own write path assembles every shard in memory (a full copy), runs a
Python-level codec pipeline per inner chunk and hands us one big buffer; for
uncompressed data the format is simple enough to stream straight from the
array: per inner chunk its raw little-endian bytes plus a CRC32C, then the
shard index ((offset, nbytes) uint64 pairs, little-endian) plus its CRC32C
(sharding codec, ``index_location: end``, as zarr writes it).  The bytes move in
native code (``_native.ChunkWriter``: checksums, digests and writes in one pass,
GIL released).  ``zarr.json`` comes from a template made once per dtype from
zarr's own output (byte-identical to what zarr writes; every file written here
is read back by zarr in the tests).
"""
from __future__ import annotations

import copy
import functools
import json
import math
import os

import google_crc32c
import numpy as np

from flowcheck import _native
from flowcheck.digest import DATA_ALG
from flowcheck.errors import IntegrityError

FLUSH_EVERY = 64 << 20


def write_shard(path: str, arr: np.ndarray, chunk_rows: int) -> tuple[int, str]:
    """Write ``arr`` as one shard of inner chunks of ``chunk_rows`` rows; return (bytes, xxh3 of the file)."""
    if arr.ndim == 0 or arr.size == 0 or not arr.flags.c_contiguous or arr.dtype.byteorder == ">":
        raise ValueError("write_shard takes a non-empty, C-contiguous, little-endian array of rank >= 1")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        writer = _native.ChunkWriter(fd, chunk_rows * (arr.nbytes // arr.shape[0]), FLUSH_EVERY)
        writer.write(arr.reshape(-1).view(np.uint8))
        size, digest = writer.finish()
    finally:
        os.close(fd)
    return size, f"{DATA_ALG}:{digest}"


# ---- zarr.json from templates --------------------------------------------------------
@functools.lru_cache(maxsize=32)
def _array_template(storage: str) -> dict:
    """The metadata document zarr itself writes for a sharded array (codecs bytes + crc32c, index at the end)
    of this dtype, made once per dtype in memory; ``array_json`` fills in the sizes."""
    import zarr
    from zarr.codecs import Crc32cCodec
    from zarr.storage import MemoryStore

    store = MemoryStore()
    zarr.create_array(store, shape=(1,), dtype=storage, chunks=(1,), shards=(1,), compressors=[Crc32cCodec()],
                      fill_value=0)
    return json.loads(store._store_dict["zarr.json"].to_bytes())


def _indent() -> int | None:
    import zarr

    return zarr.config.get("json_indent")


def array_json(shape: tuple[int, ...], storage: str, chunk_shape: tuple[int, ...], shard_shape: tuple[int, ...],
               attributes: dict) -> bytes:
    """The ``zarr.json`` zarr writes for ``create_array(shape, dtype, chunks=chunk_shape, shards=shard_shape,
    compressors=[Crc32cCodec()], fill_value=0, attributes=...)``: a cached template with the sizes filled in."""
    doc = copy.deepcopy(_array_template(storage))
    doc["shape"] = list(shape)
    doc["chunk_grid"]["configuration"]["chunk_shape"] = list(shard_shape)
    doc["codecs"][0]["configuration"]["chunk_shape"] = list(chunk_shape)
    doc["attributes"] = attributes
    return json.dumps(doc, allow_nan=True, indent=_indent()).encode()


def group_json(attributes: dict) -> bytes:
    """The ``zarr.json`` of a group with these attributes, as zarr writes it."""
    return json.dumps({"attributes": attributes, "zarr_format": 3, "node_type": "group"},
                      allow_nan=True, indent=_indent()).encode()


_PLAIN = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
_PLAIN_BYTES = [{"name": "bytes"}, {"name": "crc32c"}]  # what zarr writes for one-byte dtypes (no endianness)
_MISSING = np.uint64(2**64 - 1)


def array_meta(path: str) -> dict:
    """An array's ``zarr.json``: a JSON object whose ``shape`` is a list of non-negative integers.

    Anything else (missing, not JSON, another type) is an IntegrityError naming the file: the
    metadata is read before any digest is checked, so it must never crash the reader.
    """
    where = os.path.join(path, "zarr.json")
    try:
        with open(where, "rb") as f:
            meta = json.loads(f.read())
    except FileNotFoundError:
        raise IntegrityError(f"local tier: {where} is missing") from None
    except (ValueError, RecursionError) as e:
        raise IntegrityError(f"local tier: {where} is not valid JSON ({e})") from e
    shape = meta.get("shape") if isinstance(meta, dict) else None
    if not (isinstance(shape, list) and all(_count(n) for n in shape)):
        raise IntegrityError(f"local tier: {where}: expected an object with 'shape': [non-negative integers], "
                             f"found {shape if isinstance(meta, dict) else type(meta).__name__!r:.60}")
    return meta


def _count(v: object, least: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def plain_layout(meta: dict) -> tuple[int, ...] | None:
    """The inner chunk shape if a zarr.json describes the layout ``write_shard`` produces, else None."""
    try:
        (codec,) = meta["codecs"]
        conf = codec["configuration"]
        shard_shape = meta["chunk_grid"]["configuration"]["chunk_shape"]
        shape = meta["shape"]
        chunk = conf["chunk_shape"]
        plain = (
            codec["name"] == "sharding_indexed" and conf["codecs"] in (_PLAIN, _PLAIN_BYTES)
            and conf["index_codecs"] == _PLAIN
            and conf.get("index_location", "end") == "end" and len(shape) >= 1
            and all(s >= n for s, n in zip(shard_shape, shape)) and list(chunk[1:]) == list(shape[1:])
            and len(chunk) == len(shape) and all(_count(n, 1) for n in chunk)
        )
    except (KeyError, TypeError, ValueError):
        return None
    return tuple(chunk) if plain else None


def read_rows(path: str, shape: tuple[int, ...], dtype: np.dtype, chunk_rows: int, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of a single-shard array in ``write_shard``'s layout, every chunk's CRC32C checked.

    Reads the index, then only the chunks covering the rows, straight into the result.
    """
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    n_chunks = -(-shape[0] // chunk_rows)
    with open(path, "rb") as f:
        # the size this layout must have, checked before allocating: a forged shape cannot make us allocate
        want = n_chunks * (chunk_rows * row_bytes + 4) + 16 * n_chunks + 4
        size = os.fstat(f.fileno()).st_size
        if size > want or size < 16 * n_chunks + 4:
            raise ValueError(f"{path}: {size} bytes, expected at most {want} for shape {list(shape)} in chunks of {chunk_rows} rows")
        out = np.empty((stop - start, *shape[1:]), dtype=dtype)
        flat = out.reshape(-1).view(np.uint8)
        index_bytes = 16 * n_chunks
        f.seek(-(index_bytes + 4), os.SEEK_END)
        raw = f.read(index_bytes + 4)
        if len(raw) != index_bytes + 4 or google_crc32c.value(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
            raise ValueError(f"{path}: shard index is truncated or fails its CRC32C")
        index = np.frombuffer(raw[:-4], dtype="<u8").reshape(n_chunks, 2)
        for c in range(start // chunk_rows, -(-stop // chunk_rows)):
            offset, nbytes = index[c]
            lo, hi = max(start, c * chunk_rows), min(stop, (c + 1) * chunk_rows)
            if offset == _MISSING:
                flat[(lo - start) * row_bytes:(hi - start) * row_bytes] = 0  # an all-fill chunk zarr did not store
                continue
            if nbytes != chunk_rows * row_bytes + 4:
                raise ValueError(f"{path}: chunk {c} is {nbytes} bytes in the index, expected {chunk_rows * row_bytes + 4}")
            f.seek(int(offset))
            whole = lo == c * chunk_rows and hi == (c + 1) * chunk_rows
            # a chunk wholly inside the rows asked for is read straight into the result
            body = flat[(lo - start) * row_bytes:(hi - start) * row_bytes] if whole else np.empty(chunk_rows * row_bytes, np.uint8)
            tail = bytearray(4)
            if f.readinto(body) != body.nbytes or f.readinto(tail) != 4:
                raise ValueError(f"{path}: chunk {c} is truncated")
            if google_crc32c.value(body) != int.from_bytes(tail, "little"):
                raise ValueError(f"{path}: chunk {c} fails its CRC32C")
            if not whole:
                first = (lo - c * chunk_rows) * row_bytes
                flat[(lo - start) * row_bytes:(hi - start) * row_bytes] = body[first:first + (hi - lo) * row_bytes]
    return out
