"""Read the tensors of a PyTorch DCP checkpoint directory (Megatron's ``torch_dist``) without torch's reader.

torch's ``FileSystemReader.read_metadata`` is a bare ``pickle.load``; here the
``.metadata`` goes through the allow-listed Unpickler, is checked field by
field into small value objects, and each saved chunk (``torch.save`` of one
tensor at an offset of a ``.distcp`` file, as DCP's ``_write_item`` writes it)
is read by offset and length through the ``weights_only`` loader.  Non-tensor
entries (``BytesStorageMetadata``: pickled objects) are never unpickled here: ``read_bytes`` returns their raw
bytes, which ``flowcheck import --trust-pickle`` stores as they are (flowcheck/dcp/objects.py).
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flowcheck import dtypes
from flowcheck.errors import FormatError
from flowcheck.restore.unpickle import load_dcp_metadata, load_pt
from flowcheck.state import Scalars, Shard, Snapshot, StateLayout, TensorSpec

log = logging.getLogger(__name__)
METADATA = ".metadata"


@dataclass(frozen=True)
class Piece:
    """One saved chunk of a tensor: its box in the global tensor and where its bytes lie."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    length: int


@dataclass(frozen=True)
class StoredTensor:
    """A global tensor of the checkpoint and the pieces that cover it exactly once."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class DcpDirectory:
    """What a DCP directory's ``.metadata`` says, checked: its tensors, its bytes items (key -> file, start,
    length: never unpickled here) and the planner's key paths."""

    tensors: dict[str, StoredTensor]
    objects: dict[str, tuple[str, int, int]]
    planner_data: Any


def read_index(path: str, trust_pickle: bool = False) -> dict[str, StoredTensor]:
    """Every tensor a DCP directory holds, from its ``.metadata``, checked before any data is read."""
    return read_directory(path, trust_pickle).tensors


def read_directory(path: str, trust_pickle: bool = False) -> DcpDirectory:
    """The tensors and bytes items a DCP directory holds, from its ``.metadata``, checked before any data is read."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        TensorStorageMetadata,
    )

    where = os.path.join(path, METADATA)
    md = load_dcp_metadata(where, trust_pickle)
    entries, storage = getattr(md, "state_dict_metadata", None), getattr(md, "storage_data", None)
    if not (isinstance(md, Metadata) and isinstance(entries, dict) and isinstance(storage, dict)):
        raise FormatError(f"{where}: expected a DCP Metadata with state_dict_metadata and storage_data dicts, "
                          f"found {type(md).__name__}")
    places = _places(storage, where)
    tensors = {name: _stored_tensor(name, m, places, where)
               for name, m in entries.items() if isinstance(m, TensorStorageMetadata)}
    objects = {}
    for name, m in entries.items():
        if isinstance(m, BytesStorageMetadata):
            info = places.get((name, None))
            if info is None:
                raise FormatError(f"{where}: {name}: storage_data has no entry for this bytes item")
            objects[name] = _location(info, f"{where}: {name}")
    return DcpDirectory(tensors, objects, getattr(md, "planner_data", None))


def read_bytes(path: str, key: str, place: tuple[str, int, int]) -> bytes:
    """The raw bytes of a bytes item (a pickle DCP's planner wrote): read, never unpickled."""
    file = os.path.join(path, place[0])
    try:
        with open(file, "rb") as f:
            f.seek(place[1])
            raw = f.read(place[2])
    except OSError as e:
        raise FormatError(f"{file}: cannot read ({e}); the .metadata lists it for {key}") from e
    if len(raw) != place[2]:
        raise FormatError(f"{file} at byte {place[1]} ({key}): expected {place[2]} bytes, found {len(raw)}; truncated")
    return raw


def load_pieces(path: str, st: StoredTensor) -> list[tuple[Piece, torch.Tensor]]:
    """Each saved chunk of a tensor as it is stored (its box and its data), read by offset ``weights_only``."""
    out = []
    for piece in st.pieces:
        file = os.path.join(path, piece.file)
        try:
            with open(file, "rb") as f:
                out.append((piece, _read_piece(f, file, st, piece)))
        except OSError as e:
            raise FormatError(f"{file}: cannot read ({e}); the .metadata lists it for {st.name}") from e
    return out


def load_tensors(path: str, tensors: Iterable[StoredTensor]) -> dict[str, torch.Tensor]:
    """The global tensors asked for, assembled from their pieces (each file opened once, read in offset order)."""
    out: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[tuple[StoredTensor, Piece]]] = {}
    for st in tensors:
        out[st.name] = torch.empty(st.shape, dtype=st.dtype)
        for piece in st.pieces:
            by_file.setdefault(piece.file, []).append((st, piece))
    for name, items in sorted(by_file.items()):
        file = os.path.join(path, name)
        try:
            with open(file, "rb") as f:
                for st, piece in sorted(items, key=lambda it: it[1].start):
                    box = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.sizes))
                    out[st.name][box] = _read_piece(f, file, st, piece)
        except OSError as e:
            raise FormatError(f"{file}: cannot read ({e}); the .metadata lists it for {items[0][0].name}") from e
    return out


def _read_piece(f: Any, file: str, st: StoredTensor, piece: Piece) -> torch.Tensor:
    where = f"{file} at byte {piece.start} ({st.name} chunk at {list(piece.offsets)})"
    f.seek(piece.start)
    raw = f.read(piece.length)
    if len(raw) != piece.length:
        raise FormatError(f"{where}: expected {piece.length} bytes, found {len(raw)}; the file is truncated")
    t = load_pt(raw, where)  # never trusted: DCP's own reader loads these with weights_only=True too
    if not isinstance(t, torch.Tensor):
        raise FormatError(f"{where}: expected a saved tensor, found {type(t).__name__}")
    if tuple(t.shape) != piece.sizes or t.dtype != st.dtype:
        raise FormatError(f"{where}: expected {st.dtype} of shape {list(piece.sizes)}, "
                          f"found {t.dtype} of shape {list(t.shape)}")
    return t


# ---- a plain DCP directory as a step (flowcheck import) ---------------------------------------
def snapshot_of(path: str, run: str, step: int, *, trust_pickle: bool = False) -> Snapshot:
    """A plain DCP checkpoint directory (``.metadata`` + ``*.distcp``, as ``dcp.save`` writes it) as a step: every
    saved chunk a shard (DCP's chunks are boxes of the global tensors), keys recorded as ``flowcheck.dcp`` records
    them, so ``flowcheck.dcp.Reader`` loads the step back into DCP.  Bytes items (pickles) are stored, as raw bytes
    and never loaded, only with ``trust_pickle``; otherwise they are left out and named in a warning."""
    from flowcheck.dcp.index import KEY, DcpIndex, object_name, tensor_name
    from flowcheck.torch.state import to_numpy

    found = read_directory(path, trust_pickle)
    objects = found.objects if trust_pickle else {}
    if found.objects and not trust_pickle:
        log.warning("%s: %d non-tensor item(s) not imported (pickles: %s%s); pass --trust-pickle to store them as raw "
                    "bytes", path, len(found.objects), ", ".join(sorted(found.objects)[:3]),
                    ", ..." if len(found.objects) > 3 else "")
    specs, data = [], {}
    for key, st in sorted(found.tensors.items()):
        spec = TensorSpec(tensor_name(key), dtypes.from_torch(st.dtype).name, st.shape)
        specs.append(spec)
        for piece, t in load_pieces(path, st):
            data[Shard(spec.name, piece.offsets, piece.sizes)] = to_numpy(t)
    for key, place in sorted(objects.items()):
        spec = TensorSpec(object_name(key), "uint8", (place[2],))
        specs.append(spec)
        data[Shard.whole(spec)] = np.frombuffer(read_bytes(path, key, place), dtype=np.uint8)
    index = DcpIndex.of(sorted(found.tensors), sorted(objects), found.planner_data)
    return Snapshot(run, step, StateLayout(tuple(specs)), data, Scalars(extra={KEY: index.to_json()}), source="import")


# ---- metadata checks ------------------------------------------------------------------------
def _places(storage: dict, where: str) -> dict[tuple[str, tuple[int, ...] | None], Any]:
    """(key, chunk offsets; None for a bytes item) -> its _StorageInfo, for every entry of ``storage_data``."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    out = {}
    for key, info in storage.items():
        if not isinstance(key, MetadataIndex) or not isinstance(key.fqn, str):
            raise FormatError(f"{where}: storage_data: expected MetadataIndex keys, found {type(key).__name__}")
        offset = None if key.offset is None else _ints(key.offset, where, f"storage_data[{key.fqn!r}].offset")
        out[key.fqn, offset] = info  # a bytes item's key has no offset
    return out


def _stored_tensor(name: str, m: Any, places: dict, where: str) -> StoredTensor:
    field = f"{where}: {name}"
    props = getattr(m, "properties", None)
    dtype = getattr(props, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"{field}: expected properties.dtype to be a torch dtype, found {type(dtype).__name__}")
    shape = _ints(getattr(m, "size", None), where, f"{name}.size")
    chunks = getattr(m, "chunks", None)
    if not isinstance(chunks, list):
        raise FormatError(f"{field}: expected chunks to be a list, found {type(chunks).__name__}")
    pieces = []
    for c in chunks:
        offsets = _ints(getattr(c, "offsets", None), where, f"{name} chunk offsets")
        sizes = _ints(getattr(c, "sizes", None), where, f"{name} chunk sizes")
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o + n > d for o, n, d in zip(offsets, sizes, shape)):
            raise FormatError(f"{field}: chunk at {list(offsets)} of size {list(sizes)} "
                              f"lies outside shape {list(shape)}")
        info = places.get((name, offsets))
        if info is None:
            raise FormatError(f"{field}: storage_data has no entry for the chunk at {list(offsets)}")
        pieces.append(Piece(offsets, sizes, *_location(info, f"{field} chunk at {list(offsets)}")))
    _check_cover(shape, pieces, field)
    return StoredTensor(name, shape, dtype, tuple(pieces))


def _location(info: Any, field: str) -> tuple[str, int, int]:
    """(file name, start, length) of a _StorageInfo: a plain file name of the directory, never a path out of it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if not isinstance(info, _StorageInfo):
        raise FormatError(f"{field}: expected a _StorageInfo, found {type(info).__name__}")
    rel = info.relative_path
    if not isinstance(rel, str) or rel in ("", ".", "..") or any(c in rel for c in "/\\\0"):
        raise FormatError(f"{field}: relative_path {rel!r:.80} is not a file name inside the checkpoint directory")
    start = _ints((info.offset,), field, "offset")[0]
    length = _ints((info.length,), field, "length")[0]
    if getattr(info, "transform_descriptors", None):
        raise FormatError(f"{field}: stored through DCP stream transforms {list(info.transform_descriptors)!r:.80}, "
                          "which flowcheck import does not read; save without storage-writer extensions")
    return rel, start, length


def _ints(v: Any, where: str, field: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or not all(type(n) is int and n >= 0 for n in v):  # bool is not a count
        raise FormatError(f"{where}: {field}: expected non-negative integers, found {v!r:.80}")
    return tuple(v)


def _check_cover(shape: tuple[int, ...], pieces: list[Piece], field: str) -> None:
    """The pieces tile the tensor: no two overlap and their volumes add up to its size."""
    covered = sum(math.prod(p.sizes) for p in pieces)
    boxes = sorted((p for p in pieces if math.prod(p.sizes)), key=lambda p: p.offsets[:1])
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if shape and b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                break  # sorted by the first offset: no later box reaches back into this one
            if all(bo < ao + an and ao < bo + bn for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                raise FormatError(f"{field}: chunks at {list(a.offsets)} and {list(b.offsets)} overlap")
    if covered != math.prod(shape):
        raise FormatError(f"{field}: chunks cover {covered} of {math.prod(shape)} elements; "
                          "the checkpoint is incomplete")
