"""safetensors, streamed: write files tensor by tensor, read headers and byte ranges defensively.

The format is tiny (8-byte little-endian header length, JSON header, raw
bytes).  flowcheck writes it itself because it streams shards from zarr or RAM
into bounded files without holding a whole file in memory, and reads only a
header and the byte ranges it needs from object stores; the ``safetensors``
library reads every file flowcheck writes (a test pins that).
"""
from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from flowcheck import _native, dtypes
from flowcheck.digest import DataHasher
from flowcheck.errors import FormatError

MAX_HEADER = 100 << 20  # the safetensors library's own limit
ALIGN = 8


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # flowcheck dtype name
    shape: tuple[int, ...]
    begin: int  # offsets relative to the start of the data section
    end: int


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int  # absolute file offset of the data section


@dataclass(frozen=True)
class Entry:
    """One tensor to write: key, dtype name, shape, and a callable returning its C-contiguous bytes."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    data: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.dtype(self.dtype).itemsize


def encode_header(entries: Iterable[Entry], metadata: dict[str, str]) -> bytes:
    """The 8-byte length + JSON header (space-padded to 8 bytes), offsets in entry order."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for e in entries:
        header[e.key] = {
            "dtype": dtypes.dtype(e.dtype).safetensors,
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def write(path: str, entries: list[Entry], metadata: dict[str, str]) -> tuple[int, str]:
    """Write a safetensors file tensor by tensor; return (bytes, xxh3-128 of the file)."""
    hasher = DataHasher()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offset = 0
        for buf in pieces(path, encode_header(entries, metadata), entries):
            offset += _native.pwrite_all(fd, buf, offset, 64 << 20)
            hasher.update(buf)
    finally:
        os.close(fd)
    return offset, hasher.hexdigest()


def pieces(where: str, head: bytes, entries: list[Entry]) -> Iterator[bytes | np.ndarray]:
    """A file's bytes in order: ``head`` (``encode_header`` of ``entries``), then each tensor's bytes (a flat uint8
    view, read when reached); a tensor of another size than its entry says is a FormatError naming ``where``."""
    yield head
    for e in entries:
        arr = e.data()
        if arr.nbytes != e.nbytes:
            raise FormatError(f"{where}: tensor {e.key}: expected {e.nbytes} bytes, got {arr.nbytes}")
        yield arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)


def parse_header(read: Callable[[int, int], bytes], file_size: int, where: str) -> Header:
    """Read and validate a header through ``read(start, end)``; every bound is checked before use (``file_size``
    may be what a manifest says: a stored file found shorter than that is a FormatError too)."""
    if file_size < 8:
        raise FormatError(f"{where}: {file_size} bytes is too short for a safetensors file (8-byte header length)")

    def exact(start: int, end: int) -> bytes:
        got = read(start, end)
        if len(got) != end - start:
            raise FormatError(f"{where}: expected {file_size} bytes, found it ends after {start + len(got)} (reading "
                              f"the header's bytes {start}-{end}); the file is truncated")
        return got

    (n,) = struct.unpack("<Q", exact(0, 8))
    if n > MAX_HEADER or n > file_size - 8:
        raise FormatError(
            f"{where}: header length {n} exceeds {'the 100 MiB limit' if n > MAX_HEADER else f'the file ({file_size} bytes)'};"
            " the file is truncated or not safetensors"
        )
    raw = exact(8, 8 + n)
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise FormatError(f"{where}: header is not valid JSON ({type(e).__name__})") from e
    if not isinstance(obj, dict):
        raise FormatError(f"{where}: header: expected a JSON object, found {type(obj).__name__}")
    meta = obj.pop("__metadata__", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise FormatError(f"{where}: __metadata__: expected a string-to-string map")
    data_size = file_size - 8 - n
    tensors = {key: _tensor_info(key, info, data_size, where) for key, info in obj.items()}
    spans = sorted((t.begin, t.end, k) for k, t in tensors.items() if t.end > t.begin)
    for (_b0, e0, k0), (b1, _e1, k1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise FormatError(f"{where}: tensors {k0!r} and {k1!r} overlap in the data section")
    return Header(tensors, meta, 8 + n)


def _tensor_info(key: str, info: object, data_size: int, where: str) -> TensorInfo:
    if not isinstance(info, dict):
        raise FormatError(f"{where}: tensor {key!r}: expected an object, found {info!r:.60}")
    try:
        dt = dtypes.from_safetensors(str(info.get("dtype")))
    except FormatError as e:
        raise FormatError(f"{where}: tensor {key!r}: {e}") from e
    shape, offs = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(_count(s) for s in shape)):
        raise FormatError(f"{where}: tensor {key!r}: shape: expected a list of non-negative integers, found {shape!r:.60}")
    if not (isinstance(offs, list) and len(offs) == 2 and all(_count(o) for o in offs) and offs[0] <= offs[1]):
        raise FormatError(f"{where}: tensor {key!r}: data_offsets: expected [begin, end], found {offs!r:.60}")
    if offs[1] > data_size:
        raise FormatError(f"{where}: tensor {key!r}: data_offsets end {offs[1]} beyond the data section ({data_size} bytes); file truncated?")
    want = math.prod(shape) * dt.itemsize
    if offs[1] - offs[0] != want:
        raise FormatError(f"{where}: tensor {key!r}: {offs[1] - offs[0]} bytes for {dt.name}{shape} (expected {want})")
    return TensorInfo(dt.name, tuple(shape), offs[0], offs[1])


def _count(v: object) -> bool:
    """A non-negative JSON integer (JSON booleans are not numbers here)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
