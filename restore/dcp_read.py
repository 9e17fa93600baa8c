"""Read the tensors of a PyTorch DCP checkpoint directory (Megatron's ``torch_dist``) without torch's reader.

torch's ``FileSystemReader.read_metadata`` is a bare ``pickle.load``; here the
``.metadata`` goes through the allow-listed Unpickler, is checked field by
field into small value objects, and each saved chunk (``torch.save`` of one
tensor at an offset of a ``.distcp`` file, as DCP's ``_write_item`` writes it)
is read by offset and length through the ``weights_only`` loader.  Non-tensor
entries (``BytesStorageMetadata``: pickled objects) are never read.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from flowcheck.errors import FormatError
from flowcheck.restore.unpickle import load_dcp_metadata, load_pt

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


def read_index(path: str, trust_pickle: bool = False) -> dict[str, StoredTensor]:
    """Every tensor a DCP directory holds, from its ``.metadata``, checked before any data is read."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    where = os.path.join(path, METADATA)
    md = load_dcp_metadata(where, trust_pickle)
    entries, storage = getattr(md, "state_dict_metadata", None), getattr(md, "storage_data", None)
    if not (isinstance(md, Metadata) and isinstance(entries, dict) and isinstance(storage, dict)):
        raise FormatError(f"{where}: expected a DCP Metadata with state_dict_metadata and storage_data dicts, "
                          f"found {type(md).__name__}")
    places = _places(storage, where)
    return {name: _stored_tensor(name, m, places, where)
            for name, m in entries.items() if isinstance(m, TensorStorageMetadata)}


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


# ---- metadata checks ------------------------------------------------------------------------
def _places(storage: dict, where: str) -> dict[tuple[str, tuple[int, ...]], Any]:
    """(tensor name, chunk offsets) -> its _StorageInfo, for the tensor entries of ``storage_data``."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    out = {}
    for key, info in storage.items():
        if not isinstance(key, MetadataIndex) or not isinstance(key.fqn, str):
            raise FormatError(f"{where}: storage_data: expected MetadataIndex keys, found {type(key).__name__}")
        if key.offset is not None:
            out[key.fqn, _ints(key.offset, where, f"storage_data[{key.fqn!r}].offset")] = info
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
