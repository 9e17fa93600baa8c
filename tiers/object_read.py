"""The object tier's read path: safetensors headers, then only the byte ranges asked for, with read-ahead.

A whole shard read while a reader walks a step in manifest order fetches the next shards with it (up to
READ_AHEAD bytes, few large concurrent requests); a region of a shard reads only its rows.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict

import numpy as np

from flowcheck import dtypes
from flowcheck.errors import FormatError, IntegrityError, TierError
from flowcheck.manifest import Manifest, Piece, ShardEntry
from flowcheck.tiers import range_reads
from flowcheck.tiers import safetensors_io as st
from flowcheck.tiers.base import Tier

READ_AHEAD = 256 << 20  # bytes of whole shards fetched together when a step is read shard by shard


class ObjectReader:
    """The read half of ObjectTier (a mixin: it uses the tier's ``_call``, ``_retry`` and paths)."""

    def _init_reads(self) -> None:
        self._headers: OrderedDict[str, st.Header] = OrderedDict()
        self._window: dict[tuple, np.ndarray] = {}
        self._expected: tuple | None = None  # the shard a sequential reader asks for next
        self._window_lock = threading.Lock()

    def header(self, rel: str) -> st.Header:
        """The parsed safetensors header of a stored file (two small range reads, cached)."""
        if rel in self._headers:
            self._headers.move_to_end(rel)
            return self._headers[rel]
        path = self._p(rel)
        size = self._call(f"stat {rel}", self.fs.size, path)
        h = st.parse_header(lambda a, b: self._call(f"reading {rel}", self.fs.cat_file, path, start=a, end=b), size, f"{self.url}/{rel}")
        self._headers[rel] = h
        while len(self._headers) > 256:
            self._headers.popitem(last=False)
        return h

    def _piece_info(self, manifest: Manifest, tensor: str, shard: ShardEntry, piece: Piece):
        """(header entry, row range) of one stored piece, checked against the manifest."""
        dt = dtypes.dtype(manifest.tensors[tensor].dtype)
        rows = piece.rows or ((0, shard.shape[0]) if shard.shape else (0, 1))
        info = self.header(piece.path).tensors.get(piece.key or "")
        want_shape = shard.shape if piece.rows is None else (rows[1] - rows[0], *shard.shape[1:])
        if info is None or info.dtype != dt.name or info.shape != tuple(want_shape):
            raise FormatError(
                f"{self.url}/{piece.path}: tensor {piece.key!r}: expected {dt.name}{list(want_shape)}, "
                f"found {'nothing' if info is None else f'{info.dtype}{list(info.shape)}'}"
            )
        return info, rows

    def read_shard(self, manifest: Manifest, tensor: str, entry: ShardEntry, *, verify: bool = True) -> np.ndarray:
        # a body cut short or garbled in transit fails its length or digest check: read it again
        return self._retry.run(f"object tier {self.url}: step {manifest.step}: reading {tensor} {list(entry.offsets)}",
                               lambda: Tier.read_shard(self, manifest, tensor, entry, verify=verify),
                               retry_on=(TierError, IntegrityError))

    def _read_shard(self, manifest: Manifest, tensor: str, shard: ShardEntry, region) -> np.ndarray:
        return self._retry.run(f"object tier {self.url}: step {manifest.step}: reading {tensor} {list(shard.offsets)}",
                               lambda: self._read_shard_once(manifest, tensor, shard, region),
                               retry_on=(TierError, IntegrityError))

    def _read_shard_once(self, manifest: Manifest, tensor: str, shard: ShardEntry, region) -> np.ndarray:
        if all(r.start == 0 and r.stop == n for r, n in zip(region, shard.shape)):
            return self._whole_shard(manifest, tensor, shard)
        dt = dtypes.dtype(manifest.tensors[tensor].dtype)
        out = np.empty(tuple(s.stop - s.start for s in region), dtype=dt.storage)
        for piece in shard.location:
            info, rows = self._piece_info(manifest, tensor, shard, piece)
            self._read_piece(piece, info, rows, region, shard.shape, out, dt)
        return out

    def _whole_shard(self, manifest: Manifest, tensor: str, shard: ShardEntry) -> np.ndarray:
        """A whole shard, from a read-ahead window: this shard and the next ones of the manifest
        (up to READ_AHEAD bytes) are fetched together, so reading a step shard after shard costs a
        few large concurrent requests instead of one round trip per shard."""
        key = (manifest.step, manifest.created_at, tensor, shard.offsets)
        with self._window_lock:
            hit = self._window.pop(key, None)
        if hit is not None:
            return hit
        order = [(n, e) for n, t in manifest.tensors.items() for e in t.shards]
        first = next(i for i, (n, e) in enumerate(order) if n == tensor and e.offsets == shard.offsets)
        # read ahead only when the reader goes through the step in manifest order (like OS readahead):
        # a reader in another order would otherwise fetch a window per shard and use one entry of it
        sequential = key == self._expected
        batch, total = [], 0
        for n, e in order[first:] if sequential else order[first:first + 1]:
            size = math.prod(e.shape) * dtypes.dtype(manifest.tensors[n].dtype).itemsize
            if batch and total + size > READ_AHEAD:
                break
            batch.append((n, e))
            total += size
        arrays = self._fetch_whole(manifest, batch)
        nxt = first + len(batch)
        with self._window_lock:
            self._window = {(manifest.step, manifest.created_at, n, e.offsets): a for (n, e), a in zip(batch[1:], arrays[1:])}
            self._expected = (manifest.step, manifest.created_at, order[nxt][0], order[nxt][1].offsets) if nxt < len(order) else None
        return arrays[0]

    def _fetch_whole(self, manifest: Manifest, batch) -> list[np.ndarray]:
        wants, places, outs = [], [], []
        for name, entry in batch:
            out = np.empty(entry.shape, dtype=dtypes.dtype(manifest.tensors[name].dtype).storage)
            outs.append(out)
            flat = out.reshape(-1).view(np.uint8)
            for piece in entry.location:
                info, rows = self._piece_info(manifest, name, entry, piece)
                row_bytes = (info.end - info.begin) // max(1, rows[1] - rows[0])
                start = self.header(piece.path).data_start + info.begin
                wants.append(range_reads.Want(self._p(piece.path), start, start + info.end - info.begin))
                places.append((flat, rows[0] * row_bytes))
        blobs = self._call("reading shards", range_reads.fetch, self.fs, wants)
        for (flat, offset), blob in zip(places, blobs):
            flat[offset:offset + len(blob)] = np.frombuffer(blob, np.uint8)
        return outs

    def _read_piece(self, piece, info, rows, region, shape, out, dt) -> None:
        lo = region[0].start if region else 0
        hi = region[0].stop if region else 1
        r0, r1 = max(lo, rows[0]), min(hi, rows[1])
        row_bytes = (info.end - info.begin) // max(1, rows[1] - rows[0])
        if (r0 >= r1 and shape) or row_bytes == 0:
            return  # nothing to fetch (an empty range is refused by S3)
        start = self.header(piece.path).data_start + info.begin + (r0 - rows[0]) * row_bytes
        raw = self._call(f"reading {piece.path}", self.fs.cat_file, self._p(piece.path),
                         start=start, end=start + (r1 - r0) * row_bytes)
        if len(raw) != (r1 - r0) * row_bytes:
            raise IntegrityError(f"{self.url}/{piece.path}: short read ({len(raw)} of {(r1 - r0) * row_bytes} bytes); file truncated?")
        if not shape:
            out[...] = np.frombuffer(raw, dt.storage).reshape(())
            return
        block = np.frombuffer(raw, dt.storage).reshape((r1 - r0, *shape[1:]))
        out[(slice(r0 - lo, r1 - lo),)] = block[(slice(None), *region[1:])]
