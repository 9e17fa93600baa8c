"""The object tier's read path: safetensors headers, then only the byte ranges asked for, with read-ahead.

A whole shard read while a reader walks a step in file order fetches the next shards with it (up to
READ_AHEAD bytes, few large concurrent requests), with the batch after it queued behind it, so the store never
waits for the reader (each shard's digest is computed by the thread that read it); a region of a shard reads only
its rows.  On S3, a file a read wants (nearly) all of and whose header is not known yet is read by one GET, its
header parsed and checked from the front of that body (moto reads a whole object for every ranged GET).
"""
from __future__ import annotations

import dataclasses
import math
import threading
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from flowcheck import dtypes
from flowcheck.digest import data_digest
from flowcheck.errors import FormatError, IntegrityError, TierError
from flowcheck.manifest import Manifest, Piece, ShardEntry
from flowcheck.state import Shard
from flowcheck.tiers import object_refs, range_reads
from flowcheck.tiers import safetensors_io as st
from flowcheck.tiers.base import Tier, full_region

READ_AHEAD = 256 << 20  # bytes of whole shards fetched together when a step is read shard by shard
HEAD_BYTES = 64 << 10  # a stored file's first bytes read for its header (a longer header costs one more request)
HEADERS_KEPT = 256  # parsed headers cached per tier
HEADER_READERS = 8  # files whose headers are fetched at once when a step is first read


class ObjectReader:
    """The read half of ObjectTier (a mixin: it uses the tier's ``call``, ``_retry`` and paths)."""

    def _init_reads(self) -> None:
        self._headers: OrderedDict[str, st.Header] = OrderedDict()
        self._window: dict[tuple, tuple[np.ndarray, str]] = {}  # fetched shards and their digests
        self._expected: tuple | None = None  # the shard a sequential reader asks for next
        self._ahead: tuple[tuple, list, Future] | None = None  # (first key, batch, fetch) of the next batch
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._order_cache: tuple[Manifest, list] | None = None
        self._window_lock = threading.Lock()

    def header(self, rel: str, path: str | None = None, size: int | None = None) -> st.Header:
        """The parsed safetensors header of a stored file (one small range read, cached); ``path``: its store
        path when it is not ``rel`` under this branch's folder (a referenced step's file, see ``piece_path``);
        ``size``: the file's size as its manifest lists it (else asked of the store)."""
        path = path or self._p(rel)
        if path in self._headers:
            self._headers.move_to_end(path)
            return self._headers[path]
        if size is None:
            size = self.call(f"stat {rel}", self.fs.size, path)
        head: list[bytes] = []  # the file's first HEAD_BYTES: one request serves the length and the JSON of most headers

        def read(a: int, b: int) -> bytes:
            if not head:
                head.append(self.call(f"reading {rel}", self.fs.cat_file, path, start=0, end=min(size, HEAD_BYTES)))
            if b <= len(head[0]):
                return head[0][a:b]
            return self.call(f"reading {rel}", self.fs.cat_file, path, start=a, end=b)

        h = st.parse_header(read, size, f"{self.url}/{rel}")
        self._keep_header(path, h)
        return h

    def _keep_header(self, path: str, h: st.Header) -> None:
        self._headers[path] = h
        while len(self._headers) > HEADERS_KEPT:
            self._headers.popitem(last=False)

    def piece_path(self, manifest: Manifest, piece: Piece) -> str:
        """The store path of a piece's file: under this branch's folder, or (manifest v4) under the referenced
        step's branch folder, inside the run's prefix (tiers/object_refs.py)."""
        if piece.ref is None:
            return self._p(piece.path)
        return object_refs.holder_path(self, manifest.refs[piece.ref], piece.path)

    def _piece_header(self, manifest: Manifest, piece: Piece) -> st.Header:
        return self.header(piece.path, self.piece_path(manifest, piece))

    def _piece_info(self, manifest: Manifest, tensor: str, shard: ShardEntry, piece: Piece):
        """(header entry, row range) of one stored piece, checked against the manifest."""
        dt = dtypes.dtype(manifest.tensors[tensor].dtype)
        rows = piece.rows or ((0, shard.shape[0]) if shard.shape else (0, 1))
        info = self._piece_header(manifest, piece).tensors.get(piece.key or "")
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

    def _read_whole(self, manifest: Manifest, tensor: str, entry: ShardEntry) -> tuple[np.ndarray, str | None]:
        # no retry here: read_shard retries the whole read and its digest check
        return self._read_stored(manifest, tensor, entry, full_region(entry.shape),
                                 lambda: self._whole_shard(manifest, tensor, entry))

    def _read_shard_once(self, manifest: Manifest, tensor: str, shard: ShardEntry, region) -> np.ndarray:
        if all(r.start == 0 and r.stop == n for r, n in zip(region, shard.shape)):
            return self._whole_shard(manifest, tensor, shard)[0]
        dt = dtypes.dtype(manifest.tensors[tensor].dtype)
        out = np.empty(tuple(s.stop - s.start for s in region), dtype=dt.storage)
        for piece in shard.location:
            info, rows = self._piece_info(manifest, tensor, shard, piece)
            self._read_piece(manifest, piece, info, rows, region, shard.shape, out, dt)
        return out

    def _whole_shard(self, manifest: Manifest, tensor: str, shard: ShardEntry) -> tuple[np.ndarray, str]:
        """A whole shard and its digest, from a read-ahead window: this shard and the next ones in file order
        (up to READ_AHEAD bytes) are fetched together, so reading a step shard after shard costs a few large
        concurrent requests instead of one round trip per shard; the batch after it is queued behind it."""
        key = _key(manifest, tensor, shard)
        with self._window_lock:
            hit = self._window.pop(key, None)
            ahead = self._ahead if self._ahead is not None and self._ahead[0] == key else None
            if ahead is not None:
                self._ahead = None
        if hit is not None:
            return hit
        order = self._file_order(manifest)
        first = next(i for i, (n, e) in enumerate(order) if n == tensor and e.offsets == shard.offsets)
        # read ahead only when the reader goes through the step in file order (like OS readahead):
        # a reader in another order would otherwise fetch a window per shard and use one entry of it
        sequential = ahead is not None or key == self._expected
        batch = ahead[1] if ahead is not None else _batch(manifest, order, first, sequential)
        fetch = ahead[2] if ahead is not None else None
        nxt = first + len(batch)
        if sequential and nxt < len(order):
            # the next batch is queued before this one is waited for: the disk stays busy meanwhile
            with self._window_lock:
                if self._ahead_pool is None:
                    self._ahead_pool = ThreadPoolExecutor(2, thread_name_prefix="flowcheck-object-ahead")
                if fetch is None:
                    fetch = self._ahead_pool.submit(self._fetch_whole, manifest, batch)
                following = _batch(manifest, order, nxt, True)
                self._ahead = (_key(manifest, *order[nxt]), following,
                               self._ahead_pool.submit(self._fetch_whole, manifest, following))
        results = fetch.result() if fetch is not None else self._fetch_whole(manifest, batch)
        with self._window_lock:
            self._window = {_key(manifest, n, e): r for (n, e), r in zip(batch[1:], results[1:])}
            self._expected = _key(manifest, *order[nxt]) if nxt < len(order) else None
        return results[0]

    def load(self, step: int, *, verify: bool = True):
        """A lazy snapshot whose shards come in the order they lie in the stored files: a consumer walking it
        reads each file front to back, with the next shards fetched ahead."""
        snap = Tier.load(self, step, verify=verify)
        order = {}
        walk = self._file_order(snap.origin)
        for name, e in walk:
            shard = Shard(name, e.offsets, e.shape)
            order[shard] = snap.data[shard]
        if walk:  # the walk starts at its first shard: read ahead from there, not from the second one on
            with self._window_lock:
                self._expected = _key(snap.origin, *walk[0])
        return dataclasses.replace(snap, data=order)

    def _file_order(self, manifest: Manifest) -> list[tuple[str, ShardEntry]]:
        """A step's shards by where their (first) piece lies: file, then offset in it (the manifest's order is by
        name; files hold shards in the order they were written).  Kept for the last manifest asked about."""
        cached = self._order_cache
        if cached is not None and cached[0] is manifest:
            return cached[1]
        self._fetch_headers(manifest)

        def place(item: tuple[str, ShardEntry]) -> tuple:
            piece = item[1].location[0] if item[1].location else None
            if piece is None or piece.key is None:
                return ("", 0)
            path = self.piece_path(manifest, piece)
            info = self.header(piece.path, path).tensors.get(piece.key)
            return (path, info.begin if info is not None else 0)

        order = sorted(((n, e) for n, t in manifest.tensors.items() for e in t.shards), key=place)
        self._order_cache = (manifest, order)
        return order

    def _fetch_headers(self, manifest: Manifest, entries: list[ShardEntry] | None = None, skip=()) -> None:
        """The header of every file the pieces of ``entries`` (default: the whole step) lie in, but those of
        ``skip``, fetched concurrently (a stat and a read each: one file after another, they were most of the
        wait before a step's first byte)."""
        if entries is None:
            entries = [e for t in manifest.tensors.values() for e in t.shards]
        sizes = _file_sizes(manifest)
        files = {self.piece_path(manifest, piece): (piece.path, sizes.get((piece.ref, piece.path)))
                 for e in entries for piece in e.location
                 if piece.key is not None and self.piece_path(manifest, piece) not in skip}
        missing = [(path, *known) for path, known in files.items() if path not in self._headers][:HEADERS_KEPT]
        if len(missing) > 1:
            with ThreadPoolExecutor(min(HEADER_READERS, len(missing)), thread_name_prefix="flowcheck-object-header") as pool:
                list(pool.map(lambda item: self.header(item[1], item[0], item[2]), missing))
        elif missing:
            self.header(missing[0][1], missing[0][0], missing[0][2])

    def read_shards_into(self, manifest: Manifest, items: list[tuple[str, ShardEntry]], into: list[np.ndarray]) -> None:
        """Whole shards read by ranged reads straight into the caller's arrays (writable, contiguous, of each
        shard's byte size: e.g. the destination tensors of a DCP load), each shard's digest computed over its
        destination as its last bytes land and checked against the manifest's.  A body cut short or garbled in
        transit is read again (the tier's retry); a shard still wrong raises IntegrityError naming it, and its
        array then holds bytes that must not be used (read it through ``read_shard``: another tier's copy)."""
        for (name, entry), dest in zip(items, into, strict=True):
            want = math.prod(entry.shape) * dtypes.dtype(manifest.tensors[name].dtype).itemsize
            if dest.nbytes != want or not dest.flags.c_contiguous or not dest.flags.writeable:
                raise ValueError(f"read_shards_into: {name} {list(entry.offsets)}: expected a writable contiguous "
                                 f"array of {want} bytes, found {dest.nbytes} bytes")

        self._fetch_headers(manifest, [entry for _, entry in items], skip=self._whole_files(manifest, items))

        def once() -> None:
            digests = self._fetch_into(manifest, items, into)
            for (name, entry), dest, got in zip(items, into, digests):
                got = got if got is not None else data_digest(dest)
                if got != entry.digest:
                    raise IntegrityError(f"object tier {self.url} step {manifest.step} tensor {name} shard "
                                         f"{list(entry.offsets)} ({entry.location[0].path if entry.location else '?'})"
                                         f": data digest {got} != manifest {entry.digest}; this copy is damaged — "
                                         "read the step from another tier")

        self._retry.run(f"object tier {self.url}: step {manifest.step}: reading {len(items)} shards into place", once,
                        retry_on=(TierError, IntegrityError))

    def _fetch_whole(self, manifest: Manifest, batch) -> list[tuple[np.ndarray, str]]:
        outs = [np.empty(entry.shape, dtype=dtypes.dtype(manifest.tensors[name].dtype).storage) for name, entry in batch]
        digests = self._fetch_into(manifest, batch, outs)
        return [(out, d if d is not None else data_digest(out)) for out, d in zip(outs, digests)]

    def _fetch_into(self, manifest: Manifest, batch, outs: list[np.ndarray]) -> list[str | None]:
        """Each whole shard of ``batch`` read into its array of ``outs`` (its pieces' byte ranges straight into
        place; a file read (nearly) whole with its header not yet known by one request, see ``_whole_files``),
        and its digest (None where no piece was read: an empty shard)."""
        whole = self._whole_files(manifest, batch)
        wants, dests, owner = [], [], []
        later: dict[str, list] = {path: [] for path in whole}  # a whole file's pieces, placed once its header came
        for k, ((name, entry), out) in enumerate(zip(batch, outs)):
            flat = out.reshape(-1).view(np.uint8)
            for piece in entry.location:
                path = self.piece_path(manifest, piece)
                if path in whole:
                    later[path].append((k, name, entry, piece, flat))
                    continue
                info, rows = self._piece_info(manifest, name, entry, piece)
                start = self._piece_header(manifest, piece).data_start + info.begin
                wants.append(range_reads.Want(path, start, start + info.end - info.begin))
                dests.append(_piece_dest(flat, info, rows))
                owner.append(k)
        files = []
        for path, pieces in later.items():
            indices = list(range(len(owner), len(owner) + len(pieces)))
            owner.extend(p[0] for p in pieces)
            rel, size = whole[path]
            files.append((path, size, indices, self._placer(manifest, path, rel, size, indices, pieces)))

        def fetch() -> list[str | None]:
            # each shard is hashed by the thread that read its last bytes, while the others still read
            digests: list[str | None] = [None] * len(outs)
            left = Counter(owner)  # pieces of each shard not read yet
            lock = threading.Lock()

            def done(i: int) -> None:
                with lock:
                    left[owner[i]] -= 1
                    last = left[owner[i]] == 0
                if last:
                    digests[owner[i]] = data_digest(outs[owner[i]])

            if files:
                self.backend.fetch_into(wants, dests, done, files=files)
            else:
                self.backend.fetch_into(wants, dests, done)
            return digests

        return self.call("reading shards", fetch)

    def _whole_files(self, manifest: Manifest, batch) -> dict[str, tuple[str, int]]:
        """``{store path: (rel, size)}`` of the files of ``batch``'s pieces read by one request each, header
        included: those whose header is not known yet and whose bytes the batch wants all of but at most
        max(HEAD_BYTES, a tenth) (a store that reads a whole object per ranged GET, as moto does, then reads each
        file once, not once for its header and again for its data).  Empty where the backend cannot."""
        if not self.backend.reads_whole_files():
            return {}
        sizes = _file_sizes(manifest)
        wanted: Counter = Counter()
        rels, seen, twice = {}, set(), set()
        for name, entry in batch:
            itemsize = dtypes.dtype(manifest.tensors[name].dtype).itemsize
            for piece in entry.location:
                path = self.piece_path(manifest, piece)
                if piece.key is None or path in self._headers or (piece.ref, piece.path) not in sizes:
                    twice.add(path)  # read as ranges
                    continue
                if (path, piece.key) in seen:
                    twice.add(path)
                seen.add((path, piece.key))
                rows = piece.rows or ((0, entry.shape[0]) if entry.shape else (0, 1))
                wanted[path] += (rows[1] - rows[0]) * math.prod(entry.shape[1:]) * itemsize
                rels[path] = (piece.path, sizes[(piece.ref, piece.path)])
        return {path: rels[path] for path, n in wanted.items() if path not in twice and rels[path][1] >= 8
                and rels[path][1] - n <= max(HEAD_BYTES, rels[path][1] // 10)}

    def _placer(self, manifest: Manifest, path: str, rel: str, size: int, indices: list[int], pieces: list):
        """``place(read)`` of ``range_reads.get_file``: the file's header parsed and checked as ``header`` does
        (against the manifest's size of the file), kept, each piece checked against the manifest, and the pieces
        as ``(index, file offset, destination view)``."""
        def place(read) -> list[tuple[int, int, memoryview]]:
            h = st.parse_header(read, size, f"{self.url}/{rel}")
            self._keep_header(path, h)
            out = []
            for i, (_, name, entry, piece, flat) in zip(indices, pieces):
                info, rows = self._piece_info(manifest, name, entry, piece)
                out.append((i, h.data_start + info.begin, memoryview(_piece_dest(flat, info, rows)).cast("B")))
            return out

        return place

    def _read_piece(self, manifest, piece, info, rows, region, shape, out, dt) -> None:
        lo = region[0].start if region else 0
        hi = region[0].stop if region else 1
        r0, r1 = max(lo, rows[0]), min(hi, rows[1])
        row_bytes = (info.end - info.begin) // max(1, rows[1] - rows[0])
        if (r0 >= r1 and shape) or row_bytes == 0:
            return  # nothing to fetch (an empty range is refused by S3)
        start = self._piece_header(manifest, piece).data_start + info.begin + (r0 - rows[0]) * row_bytes
        raw = self.call(f"reading {piece.path}", self.fs.cat_file, self.piece_path(manifest, piece),
                         start=start, end=start + (r1 - r0) * row_bytes)
        if len(raw) != (r1 - r0) * row_bytes:
            raise IntegrityError(f"{self.url}/{piece.path}: short read ({len(raw)} of {(r1 - r0) * row_bytes} bytes); file truncated?")
        if not shape:
            out[...] = np.frombuffer(raw, dt.storage).reshape(())
            return
        block = np.frombuffer(raw, dt.storage).reshape((r1 - r0, *shape[1:]))
        out[(slice(r0 - lo, r1 - lo),)] = block[(slice(None), *region[1:])]


def _file_sizes(manifest: Manifest) -> dict[tuple[int | None, str], int]:
    """``{(piece.ref, piece.path): bytes}`` of every stored file the manifest lists (its own and, manifest v4, the
    referenced steps')."""
    sizes: dict[tuple[int | None, str], int] = {(None, f.path): f.bytes for f in manifest.files}
    sizes.update(((k, f.path), f.bytes) for k, ref in enumerate(manifest.refs) for f in ref.files)
    return sizes


def _piece_dest(flat: np.ndarray, info, rows: tuple[int, int]) -> np.ndarray:
    """The bytes of a shard's flat byte view that one stored piece (header entry ``info``, rows ``rows``) fills."""
    row_bytes = (info.end - info.begin) // max(1, rows[1] - rows[0])
    return flat[rows[0] * row_bytes:rows[0] * row_bytes + info.end - info.begin]


def _key(manifest: Manifest, tensor: str, shard: ShardEntry) -> tuple:
    return (manifest.step, manifest.created_at, tensor, shard.offsets)


def _batch(manifest: Manifest, order: list, first: int, sequential: bool) -> list:
    """The shards fetched together from ``first`` on: up to READ_AHEAD bytes for a sequential reader, else one."""
    batch, total = [], 0
    for n, e in order[first:] if sequential else order[first:first + 1]:
        size = math.prod(e.shape) * dtypes.dtype(manifest.tensors[n].dtype).itemsize
        if batch and total + size > READ_AHEAD:
            break
        batch.append((n, e))
        total += size
    return batch
