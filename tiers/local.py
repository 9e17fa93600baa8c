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

import errno
import logging
import math
import os
import shutil
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace


from flowcheck import dtypes
from flowcheck.config import LocalConfig
from flowcheck.branches import BRANCHES, MAIN
from flowcheck.errors import (
    FlowcheckError,
    StepExistsError,
    StepNotFoundError,
    TierError,
    TierMissingError,
)
from flowcheck.manifest import INCREMENTAL_VERSION, PACKED_VERSION, Manifest, ParentRef, StepRef
from flowcheck.progress import Progress, counter
from flowcheck.state import Shard, Snapshot
from flowcheck.tiers import local_refs, local_zarr, row_blocks, zarr_pack
from flowcheck.tiers.base import MANIFEST, Tier, make_manifest, parse_step_dir, step_dir
from flowcheck.tiers.durable import DurableStore, fsync_dir, make_tree_durable, replace_file, sync_paths
from flowcheck.tiers.local_read import READ_AHEAD, LocalReader, packed_runs  # noqa: F401 - packed_runs: read plans (dcp)
from flowcheck.tiers.local_verify import LocalChecks
from flowcheck.tiers.read_ahead import ReadAhead
from flowcheck.tiers.step_manifest import check_digests

log = logging.getLogger(__name__)

PROBES_KEPT = 4  # steps whose probe digests a tier keeps (the parent of the next step is usually the last written)
SYNC_THREADS = 8  # fsyncs of a part's small files and folders in flight at once: the journal commits them together


class LocalTier(LocalReader, LocalChecks, Tier):
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
