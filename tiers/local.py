"""The local (NVMe) tier: one zarr v3 group per step.

Layout: ``<root>/<run>/step-<step:09d>/`` holds ``zarr.json``, the shards and ``manifest.json``.
Uncompressed steps (format_version 3) pack their shards into a few flat arrays ``packs/<i>``, written
natively in one pass per pack (tiers/zarr_pack.py); compressed codecs keep one sharded array per shard at
``<tensor>/<index>`` (tiers/local_zarr.py).  A step is written into ``step-….<id>.tmp``, every file and
directory fsync'd, the manifest written last, then the directory renamed into place — a step without its
final name does not exist.  Any zarr v3 reader opens the group (bf16 appears as uint16 with its dtype named
in the attributes).
"""
from __future__ import annotations

import contextlib
import errno
import glob
import logging
import math
import os
import shutil
import stat
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from flowcheck import dtypes
from flowcheck.config import LocalConfig
from flowcheck.branches import BRANCHES, MAIN
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
from flowcheck.manifest import INCREMENTAL_VERSION, PACKED_VERSION, Manifest, ParentRef, ShardEntry, StepRef
from flowcheck.progress import Progress, counter
from flowcheck.state import Shard, Snapshot
from flowcheck.tiers import cluster, local_refs, local_zarr, row_blocks, zarr_pack
from flowcheck.tiers.base import MANIFEST, Problem, Tier, full_region, make_manifest, parse_step_dir, step_dir
from flowcheck.tiers.durable import DurableStore, fsync_dir, make_tree_durable, replace_file, sync_paths
from flowcheck.tiers.read_ahead import ReadAhead
from flowcheck.tiers.step_manifest import check_digests

log = logging.getLogger(__name__)

READ_AHEAD = 256 << 20  # bytes of whole shards read ahead of a reader walking a step in storage order
PROBES_KEPT = 4  # steps whose probe digests a tier keeps (the parent of the next step is usually the last written)
SYNC_THREADS = 8  # fsyncs of a part's small files and folders in flight at once: the journal commits them together


class LocalTier(Tier):
    name = "local"

    def __init__(self, config: LocalConfig, run: str, **kw) -> None:
        super().__init__(run, **kw)
        self.config = config
        self.root = os.path.join(config.root, self.rel)
        self._chunks_by_manifest: OrderedDict[int, tuple[Manifest, dict[str, list[str]]]] = OrderedDict()
        self._packs: OrderedDict[tuple, zarr_pack.PackFile] = OrderedDict()  # checked packs by file identity
        self._holders: dict[tuple, tuple[object, bool]] = {}  # referenced step -> (its manifest token, committed)
        self._holders_lock = threading.Lock()
        self._ahead: ReadAhead = ReadAhead(self._read_packed_whole, config.workers, READ_AHEAD)
        # probe digests of the steps this tier wrote last, by manifest digest: the next step's dedup check compares
        # with them instead of opening the parent's packs (tiers/local_refs.py probe_changed)
        self._probes: OrderedDict[str, dict[local_refs.Key, str]] = OrderedDict()

    def at_branch(self, branch: str) -> LocalTier:
        return LocalTier(self.config, self.run, branch=branch, **self._same_kw())

    def linked_branches(self) -> list[str]:
        """Entries of the branches folder that are symlinks (or the folder itself, if it is one): never branches —
        a link to ``..`` would list main twice, one to another run's folder would let a delete or GC act there."""
        top = os.path.join(self.config.root, self.run, BRANCHES)
        if os.path.islink(top):
            return [BRANCHES]
        try:
            return sorted(n for n in os.listdir(top) if os.path.islink(os.path.join(top, n)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _refuse_linked_branch(self) -> None:
        if self.branch != MAIN and (os.path.islink(os.path.dirname(self.root)) or os.path.islink(self.root)):
            raise TierError(f"local tier: the folder of branch {self.branch!r} ({self.root}) is a symlink; a branch "
                            "folder must be a real folder under the store root (flowcheck never follows a link "
                            "there): remove the link")

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
        self._refuse_linked_branch()
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
            return self._already_committed(snapshot, f"local tier: step {snapshot.step} at {final}")
        if self._packable(snapshot):
            snapshot = row_blocks.split(snapshot, self.config.row_block_bytes)
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
            manifest, unsynced = self._write_tmp(snapshot, parent, tmp, store, counter(progress, snapshot.nbytes))
            self._commit(tmp, final, manifest, unsynced)
        except BaseException as e:
            store.abandon()  # no write still in flight may recreate the folder removed next
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError) and not isinstance(e, FlowcheckError):
                raise self._write_failed(snapshot, tmp, e, os.path.exists(os.path.join(final, MANIFEST))) from e
            raise
        self.publish_latest(snapshot.step)
        return manifest

    def write_part(self, snapshot: Snapshot, parent: ParentRef | None, dest: str) -> Manifest:
        """Write ``snapshot``'s files into the new folder ``dest`` (its parent exists) and make them durable,
        committing nothing: no manifest file, no rename.  The manifest returned (paths as for a step of its own,
        ``step-…/``; unsigned) is for a caller whose own commit lists the folder — a rank's part of a DCP step
        (flowcheck/dcp/parts.py): that commit syncs ``dest``'s entry in its parent before its manifest exists.
        The small files and folders are synced on threads (fsync waits on the disk, not on a core)."""
        if self._packable(snapshot):
            snapshot = row_blocks.split(snapshot, self.config.row_block_bytes)
        store = DurableStore(dest)
        try:
            # unsigned and not parsed back: no file of it is written; the commit listing the part signs and checks
            manifest, unsynced = self._write_tmp(snapshot, parent, dest, store, lambda n: None, sign=False)
            if self.config.fsync:
                if unsynced is not None:
                    sync_paths(unsynced, SYNC_THREADS)
                else:
                    make_tree_durable(dest, self.config.sync_mode, SYNC_THREADS)
        except BaseException as e:
            store.abandon()
            shutil.rmtree(dest, ignore_errors=True)
            if isinstance(e, OSError) and not isinstance(e, FlowcheckError):
                raise self._write_failed(snapshot, dest, e, False) from e
            raise
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

    def _write_tmp(self, snapshot: Snapshot, parent: ParentRef | None, tmp: str, store: DurableStore,
                   on_bytes: Callable[[int], None], sign: bool = True) -> tuple[Manifest, list[str] | None]:
        """Write the step's files into ``tmp``; (the manifest to commit, the paths still to fsync or None: all).
        ``sign=False``: the manifest is not signed nor checked here (a part's: the commit that lists it does both)."""
        finish = self.sign if sign else (lambda m: m)
        def written(shard: Shard, nbytes: int) -> None:
            if snapshot.pin is not None:
                snapshot.pin.on_shard_written(shard)  # the bytes are in the file (page cache): the source may change from now on
            on_bytes(nbytes)

        if self._packable(snapshot):
            probes = local_refs.probe_digests(snapshot)
            skip, known, refs = self._reusable(snapshot, parent, probes)
            for shard in skip:
                written(shard, math.prod(shard.shape) * dtypes.dtype(snapshot.layout.spec(shard.tensor).dtype).itemsize)
            digests, locations, files, unsynced = zarr_pack.write_step(self.config, snapshot, tmp, written, skip, known)
            check_digests(snapshot, digests)
            m = make_manifest(snapshot, node=self.node, parent=parent, digests=digests, locations=locations, files=files)
            m = finish(replace(m, format_version=INCREMENTAL_VERSION if refs else PACKED_VERSION, refs=refs))
            self._remember_probes(m.digest(), probes)
            return m, unsynced
        digests, locations, files = local_zarr.write_arrays(self.config, snapshot, store, written)
        m = make_manifest(snapshot, node=self.node, parent=parent, digests=digests, locations=locations, files=files)
        return finish(m), None

    def _reusable(self, snapshot: Snapshot, parent: ParentRef | None,
                  probes: dict[local_refs.Key, str] | None = None
                  ) -> tuple[dict[Shard, zarr_pack.Reused], dict[Shard, str], tuple[StepRef, ...]]:
        """The shards the parent (in this tier, on any branch) already holds, which are not written again.
        ``probes``: the snapshot's probe digests (computed here when not given)."""
        found = None if parent is None else local_refs.find_parent(self.search_order(), parent)
        if found is None:
            return {}, {}, ()
        here = os.path.join(local_refs.branch_rel(self.branch), step_dir(snapshot.step))
        cands = local_refs.candidates(found[1], found[0])
        holder = self._at(found[0])
        changed = local_refs.probe_changed(
            snapshot, found[1], cands,
            lambda tensor, entry, rows: holder._read_packed(found[1], tensor, entry, rows)[0],
            local_refs.probe_digests(snapshot) if probes is None else probes, self._probes.get(parent.manifest_digest))
        cands = {k: c for k, c in cands.items() if k not in changed}  # written (and hashed) as any new shard
        return local_refs.reuse(snapshot, cands, here, self.config.workers,
                                snapshot.pin.known_digests if snapshot.pin is not None else None)

    def _remember_probes(self, manifest_digest: str, probes: dict[local_refs.Key, str]) -> None:
        with self._holders_lock:
            self._probes[manifest_digest] = probes
            while len(self._probes) > PROBES_KEPT:
                self._probes.popitem(last=False)

    def _packable(self, snapshot: Snapshot) -> bool:
        """Packs hold uncompressed data of a single-node state (a v2 step keeps v2, whose pieces have no start)."""
        return self.config.codec == "none" and not (snapshot.origin is not None and snapshot.origin.nodes)

    def _commit(self, tmp: str, final: str, manifest: Manifest, unsynced: list[str] | None = None) -> None:
        if self.config.fsync:
            # data and zarr metadata durable before the manifest exists
            if unsynced is not None:
                sync_paths(unsynced, self.config.workers)
            else:
                make_tree_durable(tmp, self.config.sync_mode)
        replace_file(os.path.join(tmp, MANIFEST), manifest.to_bytes(), fsync=self.config.fsync)
        try:
            os.rename(tmp, final)  # fails if another writer committed the step meanwhile
        except OSError as e:
            if os.path.exists(os.path.join(final, MANIFEST)):
                raise StepExistsError(f"local tier: step {manifest.step} was committed by another writer") from e
            raise
        if self.config.fsync:
            fsync_dir(self.root)

    # ---- read --------------------------------------------------------------
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
        _check_regular(real)

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
        _check_regular(os.path.join(self.root, rel))

    # ---- delete / verify / clean -------------------------------------------
    def _delete(self, step: int) -> None:
        """Delete a step; the bytes of it a committed step of the run references stay (tiers/local_refs.py)."""
        self._refuse_linked_branch()
        path = os.path.join(self.root, step_dir(step))
        if os.path.islink(path):  # never deleted through: the link goes, what it points at stays
            log.warning("local tier %s: step folder %s is a symlink; removing the link only", self.root, step_dir(step))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        if _holds_packs(path):
            refs = local_refs.references(self.search_order(), exclude=(self.branch, step))
            try:
                digest: str | None = self.manifest(step, check_signature=False).digest()
            except FlowcheckError:  # damaged since it was referenced: the references still name its identity
                digest = next((d for (b, n, d) in refs or {} if (b, n) == (self.branch, step)), None)
            needed = None if refs is None else refs.get((self.branch, step, digest))
            if digest is not None and (refs is None or needed):  # None: a manifest unreadable, keep all packs
                local_refs.retain(self.root, step, digest, needed, self.config.fsync)
                return
        trash = f"{path}.{uuid.uuid4().hex[:8]}.deleting.tmp"
        try:
            os.rename(path, trash)  # the step vanishes atomically; the data follows
        except FileNotFoundError:
            return  # another gc or delete took it meanwhile
        fsync_dir(self.root)
        _remove_tree(trash)

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
                _check_regular(path)
                size, digest = file_digest(path)
            except FileNotFoundError:
                problems.append(Problem(self.name, manifest.step, "file listed in the manifest is missing", path))
                continue
            except IntegrityError as e:
                problems.append(Problem(self.name, manifest.step, str(e), path))
                continue
            if size != f.bytes:
                problems.append(Problem(self.name, manifest.step, f"size {size} != manifest {f.bytes}", path))
            elif digest != f.digest:
                problems.append(Problem(self.name, manifest.step, f"digest {digest} != manifest {f.digest}", path))
        problems += self._verify_refs(manifest)
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

    def _verify_refs(self, manifest: Manifest) -> list[Problem]:
        """Every file of an earlier step this step references: there (in the run folder), with the size and digest
        recorded when the reference was made.  A finding names both steps."""
        problems = []
        for ref in manifest.refs:
            held = (f"step {ref.step} of branch {ref.branch} ({ref.manifest_digest[:19]}), which step "
                    f"{manifest.step} references")
            folder = os.path.join(local_refs.branch_rel(ref.branch), self._holder_dir(ref))
            for f in ref.files:
                rel = os.path.join(folder, f.path.partition("/")[2])
                path = os.path.join(self._run_root(), rel)
                try:
                    self._check_inside_run(rel)
                    size, digest = file_digest(path)
                except IntegrityError as e:
                    problems.append(Problem(self.name, manifest.step, f"{held}: {e}", path))
                    continue
                except FileNotFoundError:
                    problems.append(Problem(self.name, manifest.step, f"file of {held} is missing", path))
                    continue
                if (size, digest) != (f.bytes, f.digest):
                    problems.append(Problem(self.name, manifest.step, f"file of {held}: size {size}, digest {digest} "
                                            f"!= recorded {f.bytes}, {f.digest}", path))
        return problems

    def clean_incomplete(self, older_than_s: float, dry_run: bool = False) -> list[str]:
        """Abandoned ``.tmp`` folders, and retained bytes of deleted steps that no committed step references."""
        removed = []
        if os.path.isdir(os.path.join(self.root, local_refs.RETAINED)):  # the run's references counted only then
            removed = local_refs.sweep(self.root, self.branch, local_refs.references(self.search_order()), dry_run)
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return removed
        cutoff = self._disk_now(dry_run) - older_than_s
        for n in names:
            path = os.path.join(self.root, n)
            if not (n.endswith(".tmp") and n.startswith("step-")):
                continue
            try:
                old = os.lstat(path).st_mtime < cutoff  # a link's own time: never followed
            except FileNotFoundError:
                continue  # removed meanwhile by another gc
            if old:
                removed.append(path)
                if not dry_run:
                    _remove_tree(path)
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
        if prefix == BRANCHES and self.branch == MAIN:
            linked = set(self.linked_branches())
            if BRANCHES in linked:
                return []
        else:
            linked = set()
        try:
            return sorted(n for n in os.listdir(os.path.join(self.root, prefix)) if n not in linked)
        except FileNotFoundError:
            return []

    def size(self, step: int) -> int:
        return self.manifest(step).nbytes


def _remove_tree(path: str) -> None:
    """Remove a folder being deleted; a symlink is unlinked, never followed (rmtree refuses links, which would
    leave one behind for every GC to report cleaned)."""
    if os.path.islink(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _holds_packs(folder: str) -> bool:
    """Whether a step folder holds packs a later step may reference: its own, or a DCP step's per part
    (``nodes/<part>/packs``)."""
    if os.path.isdir(os.path.join(folder, zarr_pack.PACKS)):
        return True
    nodes = os.path.join(folder, "nodes")
    return os.path.isdir(nodes) and not os.path.islink(nodes) and any(
        os.path.isdir(os.path.join(nodes, part, zarr_pack.PACKS)) for part in os.listdir(nodes))


def _packed(entry: ShardEntry) -> bool:
    return len(entry.location) == 1 and entry.location[0].start is not None


def _check_regular(path: str) -> None:
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


__all__ = ["LocalTier"]
