"""The local tier's per-shard layout: one sharded zarr array per shard, written through zarr.

The layout of every step before format_version 3, kept for what the packed layout does not take: compressed
codecs (lz4, zstd: zarr's codec pipeline) and multi-node (v2) states copied into the local tier.  An
uncompressed shard file is still streamed natively (``DurableStore.put_shard``), the same bytes zarr writes.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from flowcheck import dtypes
from flowcheck.config import LocalConfig
from flowcheck.errors import FlowcheckError, FormatError, IntegrityError
from flowcheck.manifest import FileEntry, Piece
from flowcheck.state import Shard, Snapshot
from flowcheck.tiers import zarr_shard
from flowcheck.tiers.base import shard_digests, step_dir
from flowcheck.tiers.durable import DurableStore


def _codecs(codec: str, itemsize: int) -> list:
    from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

    # CRC32C last: it checks every inner chunk as stored, whatever the compressor
    if codec == "lz4":
        return [BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle", typesize=itemsize), Crc32cCodec()]
    if codec == "zstd":
        return [ZstdCodec(level=3), Crc32cCodec()]
    return [Crc32cCodec()]


def chunking(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(inner chunk shape, shard shape) cutting along dim 0; one shard covers the whole array.

    The rows of a chunk divide the row count where a divisor is near the target, so the last chunk is not
    padded (zarr stores it full size)."""
    if not shape or 0 in shape:
        return shape or (), None
    row = itemsize * math.prod(shape[1:])
    rows = max(1, min(shape[0], chunk_bytes // max(row, 1)))
    n = math.ceil(shape[0] / rows)
    rows = math.ceil(shape[0] / n)  # the same number of chunks, as even as they go: padding < n rows
    return (rows, *shape[1:]), (n * rows, *shape[1:])


def write_arrays(config: LocalConfig, snapshot: Snapshot, store: DurableStore,
                 written: Callable[[Shard, int], None]) -> tuple[dict[Shard, str], dict[Shard, tuple[Piece, ...]], list[FileEntry]]:
    """Every shard as its own zarr array under ``<tensor>/<index>``; (digests, locations, files)."""
    import zarr

    group = zarr.create_group(store, attributes={"flowcheck": {"run": snapshot.run, "step": snapshot.step}})
    shards = list(snapshot.data)
    index = shard_indices(shards)

    def one(shard: Shard) -> tuple[Shard, str]:
        digest = _write_array(config, group, snapshot, shard, index[shard])
        written(shard, math.prod(shard.shape) * dtypes.dtype(snapshot.layout.spec(shard.tensor).dtype).itemsize)
        return shard, digest

    with ThreadPoolExecutor(config.workers) as pool:
        digests = dict(pool.map(one, shards))
    sd = step_dir(snapshot.step)
    locations = {s: (Piece(f"{sd}/{s.tensor}/{index[s]}"),) for s in shards}
    files = [FileEntry(f"{sd}/{key}", size, digest) for key, (size, digest) in store.written.items()]
    return digests, locations, files


def _write_array(config: LocalConfig, group, snapshot: Snapshot, shard: Shard, index: int) -> str:
    spec = snapshot.layout.spec(shard.tensor)
    dt = dtypes.dtype(spec.dtype)
    arr = snapshot.array(shard)
    digest = shard_digests(snapshot, {shard: arr})[shard]
    chunks, shards = chunking(shard.shape, dt.itemsize, config.chunk_mib << 20)
    z = group.create_array(
        f"{shard.tensor}/{index}",
        shape=shard.shape,
        dtype=dt.storage,
        chunks=chunks,
        shards=shards,
        compressors=_codecs(config.codec, dt.itemsize),
        fill_value=0,
        attributes={"tensor": shard.tensor, "dtype": dt.name, "offsets": list(shard.offsets), "digest": digest},
    )
    if arr.size and shards is not None and config.codec == "none":
        # stream the shard file from the array (same bytes zarr would write, one copy fewer)
        key = z.metadata.encode_chunk_key((0,) * arr.ndim)
        group.store.put_shard(f"{z.path}/{key}", arr, chunks[0])
    elif arr.size:
        z[...] = arr  # one call: the sharding codec writes the whole shard file once
    return digest


def shard_indices(shards: list[Shard]) -> dict[Shard, int]:
    """Shards of one tensor are numbered 0, 1, ... in snapshot order (their zarr array names)."""
    seen: dict[str, int] = {}
    out = {}
    for s in shards:
        out[s] = seen.get(s.tensor, 0)
        seen[s.tensor] = out[s] + 1
    return out


def read_array(root: str, rel: str, listed: list[str] | tuple[str, ...], shape: tuple[int, ...], dt: np.dtype,
               region: tuple[slice, ...]) -> np.ndarray:
    """A region of the array at ``rel`` (its chunk files as the manifest lists them), every chunk's CRC32C checked."""
    import zarr

    path = os.path.join(root, rel)
    meta = zarr_shard.array_meta(path)
    if tuple(meta["shape"]) != shape:
        raise FormatError(f"{path}: zarr array shape {meta.get('shape')} != manifest shard shape {list(shape)}")
    chunk = zarr_shard.plain_layout(meta)
    try:
        whole_rows = all(r.start == 0 and r.stop == n for r, n in zip(region[1:], shape[1:]))
        if chunk is not None and whole_rows and meta.get("data_type") == dt.name:
            # uncompressed single-shard array: read the rows asked for directly
            key = "/".join([rel, "c", *(["0"] * len(shape))])
            if key not in listed:
                return np.zeros(tuple(r.stop - r.start for r in region), dt)  # zarr stored no chunk: all fill
            try:
                return zarr_shard.read_rows(os.path.join(root, key), shape, dt, chunk[0], region[0].start, region[0].stop)
            except FileNotFoundError:
                raise IntegrityError(f"local tier: {os.path.join(root, key)} is missing (listed in the manifest)") from None
        for f in listed:
            # zarr reads a missing chunk as fill values: a lost file must not look like zeros
            if not os.path.exists(os.path.join(root, f)):
                raise IntegrityError(f"local tier: {os.path.join(root, f)} is missing (listed in the manifest)")
        arr = zarr.open_array(path, mode="r")
        return np.asarray(arr[region]) if shape else np.asarray(arr[...])
    except MemoryError:
        raise  # not damage: the base turns it into a TooLargeError naming the tensor
    except FlowcheckError:
        raise
    except Exception as e:  # zarr raises plain ValueError/RuntimeError on a bad CRC or metadata
        raise IntegrityError(f"local tier: cannot read {path}: {e}") from e
