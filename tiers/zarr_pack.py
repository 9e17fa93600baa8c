"""The local tier's packed layout: a step's shards in a few flat zarr arrays, written and read in one native pass.

A step of the packed layout (manifest ``format_version`` 3) is a zarr v3 group:

    zarr.json            group; ``attributes.flowcheck``: run, step, ``layout: "packed"`` and the tensor table
                         ``tensors: {name: [{array, start, shape, offsets, dtype}]}``
    packs/zarr.json      group
    packs/<i>/zarr.json  a 1-D array of one storage dtype; sharding codec, one shard file of CHUNK_BYTES inner
                         chunks, each followed by its CRC32C
    packs/<i>/c/0        that shard file

A shard is elements ``[start, start + prod(shape))`` of its pack in C order, so a plain zarr reader finds it with
``g[array][start:start + n].reshape(shape)`` (bf16 is stored as uint16: the entry's dtype says "bfloat16").
Per-tensor arrays cost a directory tree, two metadata files and a file sync each (~1,800 filesystem objects for
a 369-tensor state); packs cost a handful.  Chunks are small (64 KiB) so reading one shard reads at most one
partial chunk at each end.
"""
from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from types import MappingProxyType

import google_crc32c
import numpy as np

from flowcheck import _native, dtypes
from flowcheck.config import LocalConfig
from flowcheck.digest import DATA_ALG
from flowcheck.errors import IntegrityError
from flowcheck.manifest import FileEntry, Piece
from flowcheck.state import Shard, Snapshot
from flowcheck.tiers import durable, zarr_shard
from flowcheck.tiers.base import step_dir
from flowcheck.tiers.durable import StepFiles

LAYOUT = "packed"
PACKS = "packs"
CHUNK_BYTES = 64 << 10  # the CRC32C unit; a shard read over-reads at most a chunk at each end
PACK_MIN, PACK_MAX = 8 << 20, 512 << 20  # bytes per pack (a larger shard gets a pack of its own)
FLUSH_EVERY = 64 << 20


@dataclass(frozen=True)
class Member:
    shard: Shard
    start: int  # first element in the pack
    size: int  # elements


@dataclass(frozen=True)
class Pack:
    index: int
    storage: str  # numpy dtype of the array
    members: tuple[Member, ...]

    @property
    def path(self) -> str:
        return f"{PACKS}/{self.index}"

    @property
    def data_file(self) -> str:
        return f"{self.path}/c/0"

    @property
    def length(self) -> int:
        return self.members[-1].start + self.members[-1].size if self.members else 0

    @property
    def chunk(self) -> int:
        return CHUNK_BYTES // np.dtype(self.storage).itemsize

    def metadata(self) -> bytes:
        n = max(1, math.ceil(self.length / self.chunk))
        return zarr_shard.array_json((self.length,), self.storage, (self.chunk,), (n * self.chunk,),
                                     {"flowcheck": {"layout": LAYOUT}})


def pack_bytes(total: int, workers: int) -> int:
    """Bytes per pack: enough packs to keep every writer busy, few enough that syncs and metadata stay negligible."""
    return min(PACK_MAX, max(PACK_MIN, total // max(1, 2 * workers)))


@dataclass(frozen=True)
class Reused:
    """A shard not written again: where an earlier step holds it (``piece.ref`` set), its digest, and that step's
    folder relative to this one (for readers without flowcheck, in the tensor table)."""

    piece: Piece
    digest: str
    folder: str


def plan(snapshot: Snapshot, workers: int, skip: Mapping[Shard, Reused] = MappingProxyType({})) -> list[Pack]:
    """Shards (less ``skip``) grouped by storage dtype, in snapshot order, cut into packs of about ``pack_bytes``."""
    by_dtype: dict[str, list[Shard]] = {}
    nbytes = 0
    for shard in snapshot.data:
        if shard in skip:
            continue
        storage = dtypes.dtype(snapshot.layout.spec(shard.tensor).dtype).storage
        by_dtype.setdefault(storage, []).append(shard)
        nbytes += math.prod(shard.shape) * np.dtype(storage).itemsize
    target = pack_bytes(nbytes, workers)
    packs: list[Pack] = []
    for storage, shards in by_dtype.items():
        itemsize = np.dtype(storage).itemsize
        members: list[Member] = []
        length = 0
        for shard in shards:
            size = math.prod(shard.shape)
            if members and (length + size) * itemsize > target:
                packs.append(Pack(len(packs), storage, tuple(members)))
                members, length = [], 0
            members.append(Member(shard, length, size))
            length += size
        packs.append(Pack(len(packs), storage, tuple(members)))
    return packs


def table(snapshot: Snapshot, packs: list[Pack], skip: Mapping[Shard, Reused] = MappingProxyType({})) -> dict:
    """The step group's attributes: where every shard lies, for readers without flowcheck.  A shard an earlier
    step holds names that step's folder relative to this one (``"in": "../step-000000010"``); its ``array`` is
    relative to that folder."""
    tensors: dict[str, list[dict]] = {}
    for pack in packs:
        for m in pack.members:
            tensors.setdefault(m.shard.tensor, []).append({
                "array": pack.path, "start": m.start, "shape": list(m.shard.shape), "offsets": list(m.shard.offsets),
                "dtype": snapshot.layout.spec(m.shard.tensor).dtype,
            })
    for shard, r in skip.items():
        tensors.setdefault(shard.tensor, []).append({
            "array": r.piece.path.partition("/")[2], "in": r.folder, "start": r.piece.start,
            "shape": list(shard.shape), "offsets": list(shard.offsets), "dtype": snapshot.layout.spec(shard.tensor).dtype,
        })
    return {"flowcheck": {"run": snapshot.run, "step": snapshot.step, "layout": LAYOUT, "tensors": tensors}}


def write_step(config: LocalConfig, snapshot: Snapshot, tmp: str, written: Callable[[Shard, int], None],
               skip: Mapping[Shard, Reused] = MappingProxyType({}), known: Mapping[Shard, str] = MappingProxyType({})
               ) -> tuple[dict[Shard, str], dict[Shard, tuple[Piece, ...]], list[FileEntry], list[str] | None]:
    """A step's files in the packed layout under ``tmp``: (shard digests, locations, files, the paths still to
    fsync before the manifest, or None when ``make_tree_durable`` does it all).

    ``skip``: shards an earlier step holds (not written; their location is the reference); ``known``: digests
    already computed (those shards are written without hashing them again)."""
    packs = plan(snapshot, config.workers, skip)
    files = StepFiles(tmp)
    files.put("zarr.json", zarr_shard.group_json(table(snapshot, packs, skip)))
    files.put(f"{PACKS}/zarr.json", zarr_shard.group_json({}))
    for p in packs:
        files.put(f"{p.path}/zarr.json", p.metadata())
        files.makedirs(os.path.dirname(p.data_file))
    per_file = config.fsync and config.sync_mode == "fsync"
    digests: dict[Shard, str] = {}
    for p, (stored, shard_digests) in zip(packs, _write_packs(config.workers, tmp, packs, snapshot, written, per_file,
                                                               known)):
        if stored is not None:
            files.add(p.data_file, *stored)
        digests.update(shard_digests)
    sd = step_dir(snapshot.step)
    locations = {m.shard: (Piece(f"{sd}/{p.path}", start=m.start),) for p in packs for m in p.members}
    for shard, r in skip.items():
        digests[shard], locations[shard] = r.digest, (r.piece,)
    entries = [FileEntry(f"{sd}/{rel}", size, digest) for rel, (size, digest) in files.written.items()]
    return digests, locations, entries, (files.unsynced() if per_file else None)


def _write_packs(workers: int, tmp: str, packs: list[Pack], snapshot: Snapshot,
                 written: Callable[[Shard, int], None], fsync: bool, known: Mapping[Shard, str]) -> list:
    """Every pack's file on writer threads (native, GIL released); none is still writing when this returns.

    A step of more than twice what the kernel lets be dirty at once (write-back drains the rest while it is written)
    is streamed: each writer waits for the write-back of its previous 64 MiB before going on. Measured at 12 GB on
    this project's 2-core VM: writers stalled together in the kernel's dirty throttling wrote 0.28-0.35 GB/s where
    one sequential file wrote 0.46; at 4 GB, where the page cache absorbs the step, waiting cost 5-10%."""
    bound = sum(p.length * np.dtype(p.storage).itemsize for p in packs) > 2 * durable.dirty_limit()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="flowcheck-local-write")
    futures = [pool.submit(write_pack, os.path.join(tmp, p.data_file), p, snapshot.array, written, fsync, known,
                           bound) for p in packs]
    try:
        wait(futures, return_when="FIRST_EXCEPTION")
        return [f.result() for f in futures]
    finally:
        for f in futures:
            f.cancel()
        pool.shutdown(wait=True)


def write_pack(path: str, pack: Pack, array: Callable[[Shard], np.ndarray], written: Callable[[Shard, int], None],
               fsync: bool, known: Mapping[Shard, str] = MappingProxyType({}), bound_dirty: bool = False
               ) -> tuple[tuple[int, str] | None, dict[Shard, str]]:
    """Write a pack's shard file (its folder exists) from its shards' arrays: ((file bytes, file digest) or None
    for a pack of empty shards, which has no file; the data digest of every shard).

    ``written(shard, nbytes)`` runs as soon as a shard's bytes are in the file (the source may change from then).
    """
    if pack.length == 0:
        for m in pack.members:
            written(m.shard, array(m.shard).nbytes)
        return None, {m.shard: f"{DATA_ALG}:{_native.xxh3_128(b'')}" for m in pack.members}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        writer = _native.ChunkWriter(fd, CHUNK_BYTES, FLUSH_EVERY, bound_dirty)
        digests = {}
        for m in pack.members:
            arr = array(m.shard)
            if m.shard in known:  # hashed already (to compare with the parent's): written without hashing again
                writer.write(_bytes_of(arr), False)
                digests[m.shard] = known[m.shard]
            else:
                digests[m.shard] = f"{DATA_ALG}:{writer.write(_bytes_of(arr))}"
            written(m.shard, arr.nbytes)
        size, digest = writer.finish()
        if fsync:
            os.fsync(fd)  # here, on this writer's thread: the packs' syncs overlap each other and the writes
    finally:
        os.close(fd)
    return (size, f"{DATA_ALG}:{digest}"), digests


def _bytes_of(arr: np.ndarray) -> np.ndarray:
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr.reshape(-1).view(np.uint8)


# ---- reading ------------------------------------------------------------------------
@dataclass(frozen=True)
class PackInfo:
    """A pack's array as its metadata and shard index describe it, checked to be the layout written here."""

    storage: str
    length: int
    chunk_bytes: int


@dataclass(frozen=True)
class PackFile:
    """A checked pack: where its shard file is and what it holds.  Files are opened per read, not held: an
    open file would keep a deleted step's space in use and its volume from being unmounted."""

    path: str
    info: PackInfo


def open_pack(array_dir: str, data_file: str | None) -> PackFile:
    """Check a pack's ``zarr.json`` and its shard file's size and index (``data_file`` None: the manifest lists
    none, right only for a pack of empty shards); IntegrityError names what is wrong."""
    meta = zarr_shard.array_meta(array_dir)
    chunk = zarr_shard.plain_layout(meta)
    storage = meta.get("data_type")
    if chunk is None or len(chunk) != 1 or len(meta["shape"]) != 1 or not isinstance(storage, str):
        raise IntegrityError(f"local tier: {array_dir}/zarr.json does not describe a flat uncompressed pack")
    try:
        itemsize = np.dtype(storage).itemsize
    except TypeError as e:
        raise IntegrityError(f"local tier: {array_dir}/zarr.json: unknown data_type {storage!r}") from e
    info = PackInfo(storage, meta["shape"][0], chunk[0] * itemsize)
    if info.chunk_bytes != CHUNK_BYTES:  # checked before any chunk is read: a read allocates whole chunks
        raise IntegrityError(f"local tier: {array_dir}/zarr.json: chunks of {info.chunk_bytes} bytes, expected the "
                             f"{CHUNK_BYTES} flowcheck writes; the file was altered or not written by flowcheck")
    n = math.ceil(info.length / chunk[0])
    if n and data_file is None:
        raise IntegrityError(f"local tier: {array_dir} holds {info.length} elements but the manifest lists no data file")
    if n:
        with open(data_file, "rb", buffering=0) as f:
            _check_index(f, data_file, n, info.chunk_bytes)
    return PackFile(data_file or array_dir, info)


def _check_index(f: io.FileIO, path: str, n: int, chunk_bytes: int) -> None:
    """The shard file holds n dense chunks (chunk i at i * (chunk_bytes + 4)) and a matching index."""
    want = n * (chunk_bytes + 4) + 16 * n + 4
    size = os.fstat(f.fileno()).st_size
    if size != want:
        raise IntegrityError(f"local tier: {path}: {size} bytes, expected {want} for {n} chunks of {chunk_bytes} "
                             "bytes; the file is truncated or not written by flowcheck")
    raw = os.pread(f.fileno(), 16 * n + 4, want - 16 * n - 4)
    if len(raw) != 16 * n + 4 or google_crc32c.value(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
        raise IntegrityError(f"local tier: {path}: the shard index fails its CRC32C")
    index = np.frombuffer(raw[:-4], "<u8").reshape(n, 2)
    dense = np.stack([np.arange(n, dtype="<u8") * (chunk_bytes + 4), np.full(n, chunk_bytes + 4, "<u8")], axis=1)
    if not np.array_equal(index, dense):
        raise IntegrityError(f"local tier: {path}: the shard index is not the dense layout flowcheck writes")


def read_elements(pack: PackFile, start: int, count: int, shape: tuple[int, ...],
                  threads: int = 1) -> tuple[np.ndarray, str]:
    """Elements [start, start + count) of a checked pack as an array of ``shape``, every chunk's CRC32C checked,
    and their xxh3-128 digest (computed in the same pass; a large range is read on up to ``threads`` threads)."""
    info = pack.info
    if start + count > info.length:
        raise IntegrityError(f"local tier: {pack.path}: elements {start}..{start + count} lie past the pack's "
                             f"{info.length}")
    out = np.empty(count, dtype=info.storage)
    if count == 0:
        return out.reshape(shape), f"{DATA_ALG}:{_native.xxh3_128(out)}"
    fd = os.open(pack.path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger readahead window for this reader
        digest = _native.read_chunks(fd, out.view(np.uint8), start * out.dtype.itemsize, info.chunk_bytes, threads)
    except ValueError as e:
        raise IntegrityError(f"local tier: {pack.path}: {e}") from e
    finally:
        os.close(fd)
    return out.reshape(shape), f"{DATA_ALG}:{digest}"


def read_ranges(pack: PackFile, ranges: list[tuple[int, int]], threads: int = 1,
                into: list[np.ndarray | None] | None = None) -> tuple[np.ndarray, list[str]]:
    """Element ranges ``(start, count)`` of a checked pack through one open file: each range read in its own native
    pass (every chunk it touches CRC32C-checked) that also gives its xxh3-128 digest — shards read together, each
    checked on its own, with no second pass over the bytes.  A range whose ``into`` entry is a writable contiguous
    array of its byte size is read straight into it (a caller's destination: no copy after); the others land back
    to back in the flat array returned."""
    info = pack.info
    itemsize = np.dtype(info.storage).itemsize
    into = list(into) if into is not None else [None] * len(ranges)
    if len(into) != len(ranges):
        raise ValueError(f"read_ranges: {len(ranges)} ranges but {len(into)} destinations")
    for (start, count), dest in zip(ranges, into):
        if start + count > info.length:
            raise IntegrityError(f"local tier: {pack.path}: elements {start}..{start + count} lie past the pack's "
                                 f"{info.length}")
        if dest is not None and dest.nbytes != count * itemsize:
            raise ValueError(f"read_ranges: a destination of {dest.nbytes} bytes for {count} elements of "
                             f"{info.storage} ({count * itemsize} bytes)")
    out = np.empty(sum(count for (_, count), dest in zip(ranges, into) if dest is None), dtype=info.storage)
    digests, at = [], 0
    fd = os.open(pack.path, os.O_RDONLY) if any(count for _, count in ranges) else -1
    try:
        if fd >= 0:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for (start, count), dest in zip(ranges, into):
            if dest is None:
                part = out[at:at + count].view(np.uint8)
                at += count
            else:
                part = dest.reshape(-1).view(np.uint8)
            digest = (_native.read_chunks(fd, part, start * itemsize, info.chunk_bytes, threads)
                      if count else _native.xxh3_128(part))
            digests.append(f"{DATA_ALG}:{digest}")
    except ValueError as e:
        raise IntegrityError(f"local tier: {pack.path}: {e}") from e
    finally:
        if fd >= 0:
            os.close(fd)
    return out, digests
