"""The local (NVMe) tier: one zarr v3 group per step, one sharded array per shard.

Layout: ``<root>/<run>/step-<step:09d>/`` holds ``zarr.json``, one array per
shard at ``<tensor>/<index>`` (sharding codec, one whole-shard write, CRC32C
per inner chunk) and ``manifest.json``.  A step is written into
``step-….<id>.tmp``, every file and directory fsync'd, the manifest written
last, then the directory renamed into place — a step without its final name
does not exist.  Any zarr v3 reader opens the group (bf16 appears as uint16
with ``attributes["dtype"] == "bfloat16"``).
"""
from __future__ import annotations

import errno
import logging
import math
import os
import shutil
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from flowcheck import dtypes
from flowcheck.config import LocalConfig
from flowcheck.digest import file_digest
from flowcheck.errors import (
    FlowcheckError,
    FormatError,
    IntegrityError,
    StepExistsError,
    StepNotFoundError,
    TierError,
    TierMissingError,
)
from flowcheck.manifest import FileEntry, Manifest, ParentRef, Piece, ShardEntry
from flowcheck.progress import Progress, counter
from flowcheck.state import Shard, Snapshot
from flowcheck.tiers import zarr_shard
from flowcheck.tiers.base import Problem, Tier, make_manifest, parse_step_dir, shard_digests, step_dir
from flowcheck.tiers.durable import DurableStore, fsync_dir, make_tree_durable, replace_file

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def _codecs(codec: str, itemsize: int) -> list:
    from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

    # CRC32C last: it checks every inner chunk as stored, whatever the compressor
    if codec == "lz4":
        return [BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle", typesize=itemsize), Crc32cCodec()]
    if codec == "zstd":
        return [ZstdCodec(level=3), Crc32cCodec()]
    return [Crc32cCodec()]


def _chunking(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(inner chunk shape, shard shape) cutting along dim 0; one shard covers the whole array."""
    if not shape or 0 in shape:
        return shape or (), None
    row = itemsize * math.prod(shape[1:])
    rows = max(1, min(shape[0], chunk_bytes // max(row, 1)))
    return (rows, *shape[1:]), (math.ceil(shape[0] / rows) * rows, *shape[1:])


class LocalTier(Tier):
    name = "local"

    def __init__(self, config: LocalConfig, run: str, **kw) -> None:
        super().__init__(run, **kw)
        self.config = config
        self.root = os.path.join(config.root, self.rel)
        self._chunks_by_manifest: OrderedDict[int, tuple[Manifest, dict[str, list[str]]]] = OrderedDict()

    def at_branch(self, branch: str) -> LocalTier:
        return LocalTier(self.config, self.run, branch=branch, **self._same_kw())

    def exists(self) -> bool:
        """Whether ``tiers.local.root`` exists. A missing root is a store not created yet (False): the first
        snapshot creates it, and reading it finds nothing. A file where the folder should be: TierMissingError."""
        root = self.config.root
        if os.path.exists(root) and not os.path.isdir(root):
            raise TierMissingError(f"local tier: expected a folder at {root} (tiers.local.root), found a file; "
                                   "point tiers.local.root at a folder")
        return os.path.isdir(root)

    # ---- listing / manifests ---------------------------------------------
    def _committed_steps(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        steps = []
        for n in names:
            s = parse_step_dir(n)
            if s is not None and os.path.exists(os.path.join(self.root, n, MANIFEST)):
                steps.append(s)
        return sorted(steps)

    def _manifest_token(self, step: int) -> object | None:
        try:
            st = os.stat(os.path.join(self.root, step_dir(step), MANIFEST))
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _manifest_bytes(self, step: int) -> bytes:
        try:
            with open(os.path.join(self.root, step_dir(step), MANIFEST), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise StepNotFoundError(f"local tier {self.root}: step {step} is not committed") from None

    # ---- write -------------------------------------------------------------
    def _write(self, snapshot: Snapshot, parent: ParentRef | None, progress: Progress | None = None) -> Manifest:
        final = os.path.join(self.root, step_dir(snapshot.step))
        if os.path.exists(os.path.join(final, MANIFEST)):
            return self._already_committed(snapshot, final)
        try:
            if not os.path.isdir(self.root):
                os.makedirs(self.root, exist_ok=True)
                if self.config.fsync:
                    fsync_dir(os.path.dirname(self.root))  # the run folder itself survives a power loss
        except OSError as e:
            raise TierError(f"local tier: cannot create {self.root}: {e.strerror}; check the path and permissions") from e
        tmp = os.path.join(self.root, f"{step_dir(snapshot.step)}.{uuid.uuid4().hex[:8]}.tmp")
        store = DurableStore(tmp)
        try:
            manifest = self._write_tmp(snapshot, parent, store, counter(progress, snapshot.nbytes))
            self._commit(tmp, final, manifest)
        except BaseException as e:
            store.abandon()  # no write still in flight may recreate the folder removed next
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError) and not isinstance(e, FlowcheckError):
                raise self._write_failed(snapshot, tmp, e, os.path.exists(os.path.join(final, MANIFEST))) from e
            raise
        self._publish_latest(snapshot.step)
        return manifest

    def _write_failed(self, snapshot: Snapshot, tmp: str, e: OSError, renamed: bool) -> TierError:
        """A disk error while writing a step, said plainly: what was written where, what the disk said, what to do."""
        try:
            free = f", {shutil.disk_usage(self.root).free / 2**20:.1f} MiB free"
        except OSError:
            free = ""
        hint = {
            errno.ENOSPC: "free space (lower policy.local.keep_last, run `flowcheck gc`) and snapshot again",
            errno.EDQUOT: "raise the quota or free space, and snapshot again",
            errno.EROFS: "the filesystem is read-only: remount it read-write or point tiers.local.root elsewhere",
            errno.EACCES: "check the permissions of tiers.local.root",
            errno.EPERM: "check the permissions of tiers.local.root",
        }.get(e.errno, "check the disk")
        msg = (f"local tier: cannot write step {snapshot.step} ({snapshot.nbytes / 2**20:.1f} MiB{free}) into {self.root}: "
               f"{e.strerror or e} ({e.filename or tmp}); {hint}; "
               + ("the step was renamed into place but its folder entry may not be durable: audit it"
                  if renamed else "nothing was committed and older steps are intact"))
        return TierError(e.errno, msg) if e.errno is not None else TierError(msg)

    def _write_tmp(self, snapshot: Snapshot, parent: ParentRef | None, store: DurableStore,
                   on_bytes: Callable[[int], None]) -> Manifest:
        import zarr

        group = zarr.create_group(store, attributes={"flowcheck": {"run": snapshot.run, "step": snapshot.step}})
        shards = list(snapshot.data)
        index = _shard_indices(shards)
        with ThreadPoolExecutor(self.config.workers) as pool:
            digests = dict(pool.map(lambda s: self._write_shard(group, snapshot, s, index[s], on_bytes), shards))
        locations = {s: (Piece(f"{step_dir(snapshot.step)}/{s.tensor}/{index[s]}"),) for s in shards}
        files = [
            FileEntry(f"{step_dir(snapshot.step)}/{key}", size, digest) for key, (size, digest) in store.written.items()
        ]
        m = make_manifest(snapshot, node=self.node, parent=parent, digests=digests, locations=locations, files=files)
        return self._sign(m)

    def _write_shard(self, group, snapshot: Snapshot, shard: Shard, index: int,
                     on_bytes: Callable[[int], None]) -> tuple[Shard, str]:
        spec = snapshot.layout.spec(shard.tensor)
        dt = dtypes.dtype(spec.dtype)
        arr = snapshot.array(shard)
        digest = shard_digests(snapshot, {shard: arr})[shard]
        chunks, shards = _chunking(shard.shape, dt.itemsize, self.config.chunk_mib << 20)
        z = group.create_array(
            f"{shard.tensor}/{index}",
            shape=shard.shape,
            dtype=dt.storage,
            chunks=chunks,
            shards=shards,
            compressors=_codecs(self.config.codec, dt.itemsize),
            fill_value=0,
            attributes={"tensor": shard.tensor, "dtype": dt.name, "offsets": list(shard.offsets), "digest": digest},
        )
        if arr.size and shards is not None and self.config.codec == "none":
            # hot path: stream the shard file from the array (same bytes zarr would write, one copy fewer)
            key = z.metadata.encode_chunk_key((0,) * arr.ndim)
            group.store.put_shard(f"{z.path}/{key}", arr, chunks[0])
        elif arr.size:
            z[...] = arr  # one call: the sharding codec writes the whole shard file once
        written = getattr(snapshot, "_on_shard_written", None)
        if written is not None:
            written(shard)  # the bytes are in the file (page cache): the source may change from now on
        on_bytes(arr.nbytes)
        return shard, digest

    def _commit(self, tmp: str, final: str, manifest: Manifest) -> None:
        if self.config.fsync:
            make_tree_durable(tmp, self.config.sync_mode)  # data and zarr metadata durable before the manifest exists
        replace_file(os.path.join(tmp, MANIFEST), manifest.to_bytes(), fsync=self.config.fsync)
        try:
            os.rename(tmp, final)  # fails if another writer committed the step meanwhile
        except OSError as e:
            if os.path.exists(os.path.join(final, MANIFEST)):
                raise StepExistsError(f"local tier: step {manifest.step} was committed by another writer") from e
            raise
        if self.config.fsync:
            fsync_dir(self.root)

    def _already_committed(self, snapshot: Snapshot, final: str) -> Manifest:
        existing = self.manifest(snapshot.step)
        if snapshot.origin is not None and snapshot.origin.digest() == existing.digest():
            return existing  # the same step again (e.g. a retried promotion): nothing to do
        raise StepExistsError(
            f"local tier: step {snapshot.step} is already committed at {final} with different content; "
            "delete it first or write a new step"
        )

    # ---- read --------------------------------------------------------------
    def _read_shard(self, manifest: Manifest, tensor: str, shard: ShardEntry, region) -> np.ndarray:
        import zarr

        if len(shard.location) != 1:
            raise FormatError(f"local tier step {manifest.step} {tensor}: expected one zarr array per shard")
        rel = shard.location[0].path
        path = os.path.join(self.root, rel)
        listed = self._chunk_files(manifest).get(rel, ())
        for f in (f"{rel}/zarr.json", *listed):
            self._check_inside(f)
        meta = zarr_shard.array_meta(path)
        if tuple(meta["shape"]) != shard.shape:
            raise FormatError(f"{path}: zarr array shape {meta.get('shape')} != manifest shard shape {list(shard.shape)}")
        chunk = zarr_shard.plain_layout(meta)
        dt = np.dtype(dtypes.dtype(manifest.tensors[tensor].dtype).storage)
        try:
            whole_rows = all(r.start == 0 and r.stop == n for r, n in zip(region[1:], shard.shape[1:]))
            if chunk is not None and whole_rows and meta.get("data_type") == dt.name:
                # hot path: uncompressed single-shard array, read the rows asked for directly
                key = "/".join([rel, "c", *(["0"] * len(shard.shape))])
                if key not in listed:
                    return np.zeros(tuple(r.stop - r.start for r in region), dt)  # zarr stored no chunk: all fill
                try:
                    return zarr_shard.read_rows(os.path.join(self.root, key), shard.shape, dt, chunk[0],
                                                region[0].start, region[0].stop)
                except FileNotFoundError:
                    raise IntegrityError(f"local tier: {os.path.join(self.root, key)} is missing (listed in the manifest)") from None
            for f in listed:
                # zarr reads a missing chunk as fill values: a lost file must not look like zeros
                if not os.path.exists(os.path.join(self.root, f)):
                    raise IntegrityError(f"local tier: {os.path.join(self.root, f)} is missing (listed in the manifest)")
            arr = zarr.open_array(path, mode="r")
            return np.asarray(arr[region]) if shard.shape else np.asarray(arr[...])
        except MemoryError:
            raise  # not damage: the base turns it into a TooLargeError naming the tensor
        except Exception as e:  # zarr raises plain ValueError/RuntimeError on a bad CRC or metadata
            raise IntegrityError(f"local tier: cannot read {path}: {e}") from e

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

    # ---- delete / verify / clean -------------------------------------------
    def _delete(self, step: int) -> None:
        path = os.path.join(self.root, step_dir(step))
        trash = f"{path}.{uuid.uuid4().hex[:8]}.deleting.tmp"
        os.rename(path, trash)  # the step vanishes atomically; the data follows
        fsync_dir(self.root)
        shutil.rmtree(trash, ignore_errors=True)

    def _verify_files(self, manifest: Manifest, on_bytes: Callable[[int], None] = lambda n: None) -> list[Problem]:
        problems = []
        listed = set()
        for f in manifest.files:
            listed.add(f.path)
            on_bytes(f.bytes)  # before the check: a missing or damaged file still moves the count on
            path = os.path.join(self.root, f.path)
            real = self._outside(f.path)
            if real is not None:
                problems.append(Problem(self.name, manifest.step, f"symlink out of the store root (to {real})", path))
                continue
            try:
                size, digest = file_digest(path)
            except FileNotFoundError:
                problems.append(Problem(self.name, manifest.step, "file listed in the manifest is missing", path))
                continue
            if size != f.bytes:
                problems.append(Problem(self.name, manifest.step, f"size {size} != manifest {f.bytes}", path))
            elif digest != f.digest:
                problems.append(Problem(self.name, manifest.step, f"digest {digest} != manifest {f.digest}", path))
        sd = step_dir(manifest.step)
        for dirpath, _dirs, files in os.walk(os.path.join(self.root, sd)):
            for name in files:
                rel = os.path.relpath(os.path.join(dirpath, name), self.root)
                real = self._outside(rel) if rel not in listed else None
                if real is not None:
                    problems.append(Problem(self.name, manifest.step, f"symlink out of the store root (to {real})", rel))
                elif rel not in listed and rel != f"{sd}/{MANIFEST}":
                    problems.append(Problem(self.name, manifest.step, "file not listed in the manifest", rel, "warning"))
        return problems

    def clean_incomplete(self, older_than_s: float, dry_run: bool = False) -> list[str]:
        removed = []
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return removed
        cutoff = self._disk_now(dry_run) - older_than_s
        for n in names:
            path = os.path.join(self.root, n)
            if n.endswith(".tmp") and n.startswith("step-") and os.path.getmtime(path) < cutoff:
                removed.append(path)
                if not dry_run:
                    shutil.rmtree(path, ignore_errors=True)
        return removed

    def _disk_now(self, dry_run: bool) -> float:
        """Now, never later than the disk's clock: the earlier of this host's time and the time the disk stamps
        on a file written now (+50 ms: file times tick coarsely). Another writer's .tmp is judged on the clock
        that stamped it (a shared disk's server), not on this host's, which may run ahead."""
        if dry_run:
            return time.time()
        probe = os.path.join(self.root, ".clock")
        try:
            with open(probe, "wb"):
                pass
            return min(time.time(), os.stat(probe).st_mtime + 0.05)
        except OSError as e:
            log.info("local tier %s: cannot probe the disk's clock (%s); using this host's", self.root, e)
            return time.time()

    def incomplete(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.root) if n.endswith(".tmp"))
        except FileNotFoundError:
            return []

    # ---- records -------------------------------------------------------------
    def _put_record(self, name: str, data: bytes) -> None:
        path = os.path.join(self.root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        replace_file(path, data, fsync=self.config.fsync)

    def _get_record(self, name: str) -> bytes | None:
        try:
            with open(os.path.join(self.root, name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _list_records(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(os.path.join(self.root, prefix)))
        except FileNotFoundError:
            return []

    def size(self, step: int) -> int:
        return self.manifest(step).nbytes


def _shard_indices(shards: list[Shard]) -> dict[Shard, int]:
    """Shards of one tensor are numbered 0, 1, ... in snapshot order (their zarr array names)."""
    seen: dict[str, int] = {}
    out = {}
    for s in shards:
        out[s] = seen.get(s.tensor, 0)
        seen[s.tensor] = out[s] + 1
    return out


__all__ = ["LocalTier"]
