"""The read half of the local tier (a mixin of LocalTier): whole steps, shards and regions from packs or per-shard
arrays, references into earlier steps' packs, read-ahead, and the checks that nothing is read through a symlink
out of the store or from something that is not a regular file."""
from __future__ import annotations

import glob
import logging
import math
import os
import stat
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from flowcheck import dtypes
from flowcheck.errors import FlowcheckError, FormatError, IntegrityError
from flowcheck.manifest import Manifest, ShardEntry, StepRef
from flowcheck.state import Shard, Snapshot
from flowcheck.tiers import cluster, local_refs, local_zarr, zarr_pack
from flowcheck.tiers.base import full_region, step_dir

log = logging.getLogger(__name__)

READ_AHEAD = 256 << 20  # bytes of whole shards read ahead of a reader walking a step in storage order


class LocalReader:
    """The read half of LocalTier (a mixin: it uses the tier's root, config, manifests and pack cache)."""

    def load(self, step: int, *, verify: bool = True) -> Snapshot:
        """A lazy snapshot whose shards come in the order they lie on disk (a packed step): a consumer walking it
        reads the packs front to back, with the next shards read ahead."""
        snap = super().load(step, verify=verify)
        first = [Shard(name, e.offsets, e.shape) for (name, e), _ in _walk(snap.origin)]
        if not first:
            return snap
        order = {s: snap.data[s] for s in first}
        order.update((s, src) for s, src in snap.data.items() if s not in order)
        return replace(snap, data=order)

    def _read_shard(self, manifest: Manifest, tensor: str, shard: ShardEntry, region) -> np.ndarray:
        if _packed(shard):
            return self._read_packed(manifest, tensor, shard, region)[0]
        if len(shard.location) != 1:
            raise FormatError(f"local tier step {manifest.step} {tensor}: expected one zarr array per shard")
        rel = shard.location[0].path
        listed = self._chunk_files(manifest).get(rel, ())
        for f in (f"{rel}/zarr.json", *listed):
            self._check_inside(f)
        dt = np.dtype(dtypes.dtype(manifest.tensors[tensor].dtype).storage)
        return local_zarr.read_array(self.root, rel, listed, shard.shape, dt, region)

    def _read_whole(self, manifest: Manifest, tensor: str, entry: ShardEntry) -> tuple[np.ndarray, str | None]:
        if not _packed(entry):
            return super()._read_whole(manifest, tensor, entry)
        # a reader walking the step in storage order (load, promotion, audit) gets the next shards read ahead
        read = lambda: self._ahead.get(manifest, lambda: _walk(manifest), (tensor, entry))
        return self._read_stored(manifest, tensor, entry, full_region(entry.shape), read)

    def _read_packed_whole(self, manifest: Manifest, key: tuple[str, ShardEntry]) -> tuple[np.ndarray, str]:
        return self._read_packed(manifest, key[0], key[1], None)

    def _read_packed(self, manifest: Manifest, tensor: str, entry: ShardEntry, region) -> tuple[np.ndarray, str]:
        """Rows of a shard in a pack (``region`` None: all of it) and the digest of the elements read."""
        piece = entry.location[0]
        if piece.ref is None:
            return self._read_in(self._pack(manifest, piece.path), manifest, tensor, entry, region)
        try:
            return self._read_in(self._ref_pack(manifest, piece), manifest, tensor, entry, region)
        except (FileNotFoundError, IntegrityError):
            pass  # the holder may have been deleted (its folder moved to retained/) between finding and reading it
        ref = manifest.refs[piece.ref]
        try:
            return self._read_in(self._ref_pack(manifest, piece), manifest, tensor, entry, region)
        except (FileNotFoundError, IntegrityError) as e:
            raise IntegrityError(
                f"local tier step {manifest.step} tensor {tensor} shard {list(entry.offsets)}: the bytes it references "
                f"in step {ref.step} of branch {ref.branch} ({ref.manifest_digest[:19]}) are missing or damaged: {e}"
            ) from e

    def read_packed_run(self, manifest: Manifest, items: list[tuple[str, ShardEntry]], threads: int = 1,
                        into: list[np.ndarray | None] | None = None) -> list[np.ndarray]:
        """Whole shards of one pack of this step (``packed_runs`` groups them), read through one open file, each in
        one native pass that checks every chunk's CRC32C and computes the digest checked against the shard's own:
        flat arrays in the order given — the shard's ``into`` entry (a writable contiguous array of the shard's byte
        size, e.g. the caller's destination tensor: read straight into it) or a view of one buffer.  A shard found
        damaged raises IntegrityError; its ``into`` array then holds bytes that must not be used."""
        rel = items[0][1].location[0].path
        if any(entry.location[0].path != rel or entry.location[0].ref is not None for _, entry in items):
            raise ValueError("read_packed_run: shards of several packs, or held by an earlier step, given as one run")
        pack = self._pack(manifest, rel)
        for tensor, _ in items:
            storage = dtypes.dtype(manifest.tensors[tensor].dtype).storage
            if pack.info.storage != storage:
                raise IntegrityError(f"local tier: {pack.path}: the pack holds {pack.info.storage}, tensor {tensor} is "
                                     f"{storage}")
        sizes = [math.prod(entry.shape) for _, entry in items]
        into = list(into) if into is not None else [None] * len(items)
        flat, digests = zarr_pack.read_ranges(pack, [(e.location[0].start, n) for (_, e), n in zip(items, sizes)],
                                              threads, into)
        out, at = [], 0
        for (tensor, entry), n, got, dest in zip(items, sizes, digests, into):
            if got != entry.digest:
                raise IntegrityError(f"local tier step {manifest.step} tensor {tensor} shard {list(entry.offsets)} "
                                     f"(stored in {pack.path}): data digest {got} != manifest {entry.digest}; this "
                                     "copy is damaged — read the step from another tier")
            if dest is None:
                out.append(flat[at:at + n])
                at += n
            else:
                out.append(dest.reshape(-1).view(pack.info.storage))
        return out

    def will_need(self, step: int, folder: str, most: int) -> None:
        """Start the kernel reading the packs under ``folder`` of the step's folder (``nodes/rank-00001``, or "" for
        all) into the page cache, in the order ``packed_runs`` reads them, up to ``most`` bytes: for a reader that
        knows what it will read before it may read it, and before it has parsed the manifest (a DCP rank: its reads
        start only after DCP plans the load).  Only the kernel reads here; nothing is trusted: the reads check."""
        base = os.path.join(self.root, step_dir(step))
        pack = os.path.join(zarr_pack.PACKS, "*", "c", "0")  # the layout's own places: no recursive walk
        wheres = [os.path.join(glob.escape(os.path.join(base, folder)), pack)] if folder else \
            [os.path.join(glob.escape(base), pack), os.path.join(glob.escape(base), cluster.NODES, "*", pack)]
        found = [p for where in wheres for p in glob.glob(where)]
        for path in sorted(found, key=lambda p: os.path.relpath(p, base)):  # a pack's piece path, as packed_runs sorts
            if most <= 0:
                return
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # never waits on something that is not a file
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    continue
                n = min(st.st_size, most)
                os.posix_fadvise(fd, 0, n, os.POSIX_FADV_WILLNEED)  # queues the reads and returns
            finally:
                os.close(fd)
            most -= n

    def _read_in(self, pack: zarr_pack.PackFile, manifest: Manifest, tensor: str, entry: ShardEntry, region
                 ) -> tuple[np.ndarray, str]:
        piece = entry.location[0]
        storage = dtypes.dtype(manifest.tensors[tensor].dtype).storage
        if pack.info.storage != storage:
            raise IntegrityError(f"local tier: {pack.path}: the pack holds {pack.info.storage}, tensor {tensor} is {storage}")
        shape = entry.shape
        row = math.prod(shape[1:]) if shape else 1
        r0, r1 = (0, shape[0] if shape else 1) if region is None or not shape else (region[0].start, region[0].stop)
        arr, digest = zarr_pack.read_elements(pack, piece.start + r0 * row, (r1 - r0) * row,
                                              (r1 - r0, *shape[1:]) if shape else (), self.config.workers)
        if region is not None and shape and region[1:] != full_region(shape)[1:]:
            arr = arr[(slice(None), *region[1:])]
        return arr, digest

    def _pack(self, manifest: Manifest, rel: str) -> zarr_pack.PackFile:
        """A pack of this step, checked (metadata and index) once per file version."""
        listed = f"{rel}/c/0" in self._chunk_files(manifest).get(rel, ())
        return self._pack_at(self.root, rel, listed, self._check_inside)

    def _ref_pack(self, manifest: Manifest, piece) -> zarr_pack.PackFile:
        """A pack of the earlier step a piece references: in that step's folder while it is committed with the
        referenced digest, else in its retained folder; never outside the run folder."""
        ref = manifest.refs[piece.ref]
        folder = os.path.join(local_refs.branch_rel(ref.branch), self._holder_dir(ref))
        rel = os.path.join(folder, piece.path.partition("/")[2])
        listed = any(f.path == f"{piece.path}/c/0" for f in ref.files)
        return self._pack_at(self._run_root(), rel, listed, self._check_inside_run)

    def _holder_dir(self, ref: StepRef) -> str:
        """The referenced step's folder (relative to its branch folder): its own while it is committed with the
        referenced digest and the referenced files (the same state can be committed again at its step number with
        its shards packed otherwise: then the bytes referenced are the retained copy's), else its retained one.
        Decided once per version of its manifest file."""
        holder = self._at(ref.branch)
        token = holder._manifest_token(ref.step)
        key = (ref.branch, ref.step, ref.manifest_digest)
        hit = self._holders.get(key)
        if hit is None or token is None or hit[0] != token:
            try:
                committed = holder.manifest(ref.step, check_signature=False) if token is not None else None
                own = {f.path: (f.bytes, f.digest) for f in committed.files} if committed is not None else {}
                live = (committed is not None and committed.digest() == ref.manifest_digest
                        and all(own.get(f.path) == (f.bytes, f.digest) for f in ref.files))
            except FlowcheckError:
                live = False
            hit = (token, live)
            with self._holders_lock:  # read-ahead threads resolve references too
                self._holders[key] = hit
                while len(self._holders) > 256:
                    self._holders.pop(next(iter(self._holders)))
        return step_dir(ref.step) if hit[1] else local_refs.retained_dir(ref.step, ref.manifest_digest)

    def _run_root(self) -> str:
        return os.path.join(self.config.root, self.run)

    def _check_inside_run(self, rel: str) -> None:
        """A referenced file lies in the run folder (another branch's folder is fine, a symlink out is not)."""
        root = os.path.realpath(self._run_root())
        real = os.path.realpath(os.path.join(root, rel))
        if not real.startswith(root + os.sep):
            raise IntegrityError(f"local tier: {os.path.join(self._run_root(), rel)} resolves outside the run folder "
                                 f"{root} (to {real}); refusing to read it")
        check_regular(real)

    def _pack_at(self, base: str, rel: str, listed: bool, check: Callable[[str], None]) -> zarr_pack.PackFile:
        data_rel = f"{rel}/c/0"
        data_path = os.path.join(base, data_rel)
        try:
            st = os.stat(data_path) if listed else None
        except FileNotFoundError:
            raise IntegrityError(f"local tier: {data_path} is missing (listed in the manifest)") from None
        key = (data_path, None if st is None else (st.st_ino, st.st_size, st.st_mtime_ns))
        pack = self._packs.get(key)
        if pack is None:  # first read of this file version (a link swapped in is another inode: checked again)
            for f in (f"{rel}/zarr.json", *([data_rel] if listed else [])):
                check(f)
            pack = zarr_pack.open_pack(os.path.join(base, rel), data_path if listed else None)
            self._packs[key] = pack
            while len(self._packs) > 256:
                self._packs.popitem(last=False)
        return pack

    def _chunk_files(self, manifest: Manifest) -> dict[str, list[str]]:
        """Array path -> its chunk files, once per manifest (not a scan of every file per shard)."""
        hit = self._chunks_by_manifest.get(id(manifest))
        found = hit[1] if hit is not None and hit[0] is manifest else None
        if found is None:
            found = {}
            for f in manifest.files:
                head, sep, _ = f.path.partition("/c/")
                if not sep and f.path.endswith("/c"):
                    head, sep = f.path[:-2], "/c"
                if sep:
                    found.setdefault(head, []).append(f.path)
            self._chunks_by_manifest[id(manifest)] = (manifest, found)  # holding it keeps the id unique
            while len(self._chunks_by_manifest) > 8:
                self._chunks_by_manifest.popitem(last=False)
        return found

    def _outside(self, rel: str) -> str | None:
        """Where a step file really is, when that is outside the store's run folder (a symlink out of it); else None."""
        root = os.path.realpath(self.root)
        real = os.path.realpath(os.path.join(self.root, rel))
        return None if real == root or real.startswith(root + os.sep) else real

    def _check_inside(self, rel: str) -> None:
        # even a link to an identical copy is refused: the copy outside the root is not the tier's to vouch for
        real = self._outside(rel)
        if real is not None:
            raise IntegrityError(
                f"local tier: {os.path.join(self.root, rel)} is a symlink out of the store root {self.root} (to {real}); "
                "refusing to read it — replace the link with the file (or read the step from another tier)"
            )
        check_regular(os.path.join(self.root, rel))


def _packed(entry: ShardEntry) -> bool:
    return len(entry.location) == 1 and entry.location[0].start is not None

def check_regular(path: str) -> None:
    """A step file the tier reads must be a regular file: a FIFO or a device where one belongs (a damaged or hostile
    store) would block the reader or stream without end.  A missing file is left to the read, which names it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a device or socket"
        raise IntegrityError(f"local tier: {path} is {kind}, not a regular file; refusing to read it (a step's files "
                             "are regular files: restore it from another tier)")

def packed_runs(items: list[tuple[str, ShardEntry]], most: int
                ) -> tuple[list[list[tuple[str, ShardEntry]]], list[tuple[str, ShardEntry]]]:
    """Whole shards to read, as runs for ``LocalTier.read_packed_run`` — shards of one pack of the step itself, in
    order, each starting within a chunk's worth of elements of where the one before ends, spanning at most ``most``
    elements (a larger shard is a run of its own) — and the rest (not packed, or held by an earlier step: read
    them one by one)."""
    own = [item for item in items if _packed(item[1]) and item[1].location[0].ref is None]
    rest = [item for item in items if not (_packed(item[1]) and item[1].location[0].ref is None)]
    runs: list[list[tuple[str, ShardEntry]]] = []
    end = 0
    for item in sorted(own, key=lambda item: (item[1].location[0].path, item[1].location[0].start)):
        piece, n = item[1].location[0], math.prod(item[1].shape)
        head = runs[-1][0][1].location[0] if runs else None
        if (head is not None and head.path == piece.path and end <= piece.start <= end + zarr_pack.CHUNK_BYTES // 8
                and piece.start + n - head.start <= most):
            runs[-1].append(item)
        else:
            runs.append([item])
        end = piece.start + n
    return runs, rest

def _walk(manifest: Manifest) -> list[tuple[tuple[str, ShardEntry], int]]:
    """The packed shards of a step in the order they lie on disk, with their sizes: what a sequential reader
    asks for (``load`` hands shards out in this order; the manifest's own order is by name)."""
    def place(item: tuple[str, ShardEntry]) -> tuple:
        piece = item[1].location[0]
        head, _, index = piece.path.rpartition("/")
        return (head, int(index) if index.isdigit() else -1, index, piece.start)

    shards = sorted(((name, e) for name, t in manifest.tensors.items() for e in t.shards if _packed(e)), key=place)
    return [((name, e), math.prod(e.shape) * dtypes.dtype(manifest.tensors[name].dtype).itemsize) for name, e in shards]


