"""Row-block chunks: a large tensor's shard cut into boxes of whole rows before a local write, so that the
shard-level dedup of incremental steps (tiers/local_refs.py) stores only the blocks that changed — an embedding
whose step touches a few rows writes those rows' blocks, not the whole table.

Each block is an ordinary shard (a box with offsets in the tensor's global index space), so manifests, restore,
export, DCP and plain zarr / safetensors readers see a tensor stored as several boxes, which they all read
already.  Off by default (``tiers.local.row_block_bytes: 0``); BENCHMARKS.md measures what it costs when every
row changes.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from flowcheck import dtypes
from flowcheck.state import Shard, Snapshot



def blocks(shard: Shard, itemsize: int, block_bytes: int) -> list[Shard]:
    """``shard`` cut along its first dimension into boxes of at most ``block_bytes`` (at least one row each);
    ``[shard]`` when it is not a 2-D+ shard larger than one block."""
    if len(shard.shape) < 2 or math.prod(shard.shape) * itemsize <= block_bytes:
        return [shard]
    row = math.prod(shard.shape[1:]) * itemsize
    rows = max(1, block_bytes // max(1, row))
    if rows >= shard.shape[0]:
        return [shard]
    head, rest = shard.offsets[0], shard.offsets[1:]
    return [Shard(shard.tensor, (head + r, *rest), (min(rows, shard.shape[0] - r), *shard.shape[1:]))
            for r in range(0, shard.shape[0], rows)]


def split(snapshot: Snapshot, block_bytes: int) -> Snapshot:
    """The snapshot with every large in-memory shard replaced by its row blocks (views, no copy).

    Left whole: a snapshot read back from a tier (``origin``: its manifest's boxes are its identity), and shards
    whose source is a loader (splitting would load it once per block).  The memory tier's per-shard release
    follows: a shard is released once all its blocks are written."""
    if block_bytes <= 0 or snapshot.origin is not None:
        return snapshot
    data: dict[Shard, object] = {}
    parts: dict[Shard, Shard] = {}  # block -> the shard it was cut from
    for shard, src in snapshot.data.items():
        cut = [shard] if callable(src) else blocks(
            shard, dtypes.dtype(snapshot.layout.spec(shard.tensor).dtype).itemsize, block_bytes)
        if len(cut) == 1:
            data[shard] = src
            continue
        for b in cut:
            r0 = b.offsets[0] - shard.offsets[0]
            data[b] = np.asarray(src)[r0:r0 + b.shape[0]]
            parts[b] = shard
    if not parts:
        return snapshot
    pin = snapshot.pin
    if pin is not None:
        pin = replace(pin, on_shard_written=_release_whole(pin.on_shard_written, parts))
    return replace(snapshot, data=data, pin=pin)


def _release_whole(release: Callable[[Shard], None], parts: dict[Shard, Shard]) -> Callable[[Shard], None]:
    left: dict[Shard, int] = {}
    for whole in parts.values():
        left[whole] = left.get(whole, 0) + 1
    lock = threading.Lock()  # blocks are written by several threads; the last one releases the shard, once

    def written(shard: Shard) -> None:
        whole = parts.get(shard)
        if whole is None:
            release(shard)
            return
        with lock:
            left[whole] -= 1
            done = left[whole] == 0
        if done:
            release(whole)
    return written
