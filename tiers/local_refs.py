"""The local tier's references between steps (manifest v4): reusing the parent's unchanged shards, finding
referenced bytes, and keeping the bytes a kept step references when the step holding them is deleted.

A shard whose data digest equals the one the parent step stores for the same (tensor, offsets, shape, dtype) is
not written again: the new manifest's piece points at the step that holds the bytes (the *holder*: the parent,
or the step the parent itself references — references never chain).  Deleting a holder that a committed step
still references moves its folder, in one rename, to ``<branch folder>/retained/step-<N:09d>-<digest hex16>/``:
it leaves the listings at once and its bytes keep their place; GC then removes from it whatever no committed
manifest of the run (any branch) references, and the folder when nothing is left.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from flowcheck import _native, dtypes
from flowcheck.branches import BRANCHES, MAIN
from flowcheck.digest import DATA_ALG
from flowcheck.errors import FlowcheckError, TierError
from flowcheck.manifest import FileEntry, Manifest, ParentRef, Piece, ShardEntry, StepRef
from flowcheck.state import Shard, Snapshot
from flowcheck.tiers.base import MANIFEST, step_dir
from flowcheck.tiers.durable import fsync_dir
from flowcheck.tiers.zarr_pack import Reused

log = logging.getLogger(__name__)

RETAINED = "retained"
Key = tuple[str, tuple[int, ...], tuple[int, ...], str]  # tensor, offsets, shape, dtype


def branch_rel(branch: str) -> str:
    """A branch's folder relative to the run folder ('' for main)."""
    return "" if branch == MAIN else f"{BRANCHES}/{branch}"


def retained_dir(step: int, manifest_digest: str) -> str:
    """Where a deleted holder's referenced bytes stay, relative to its branch folder."""
    return f"{RETAINED}/{step_dir(step)}-{manifest_digest.partition(':')[2][:16]}"


def holder_files(files: Iterable[FileEntry], array: str) -> tuple[FileEntry, ...]:
    """A pack's files among a step's: its metadata and (unless it holds only empty shards) its shard file."""
    return tuple(f for f in files if f.path in (f"{array}/zarr.json", f"{array}/c/0"))


# ---- write: which shards the parent already holds ------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """What the parent stores for one shard key: its digest, and where the bytes lie (in the holder)."""

    digest: str
    holder: tuple[str, int, str]  # branch, step, manifest digest
    piece: Piece  # path relative to the holder's branch folder, start; no ref
    files: tuple[FileEntry, ...]


def candidates(parent: Manifest, branch: str) -> dict[Key, Candidate]:
    """Every packed shard of the parent, by key, with the step that holds its bytes."""
    out: dict[Key, Candidate] = {}
    own = (branch, parent.step, parent.digest())
    for name, t in parent.tensors.items():
        for e in t.shards:
            if len(e.location) != 1 or e.location[0].start is None:
                continue  # a compressed or multi-node step: its shards are not reused
            p = e.location[0]
            if p.ref is None:
                holder, files = own, holder_files(parent.files, p.path)
            else:
                r = parent.refs[p.ref]
                holder, files = (r.branch, r.step, r.manifest_digest), holder_files(r.files, p.path)
            if any(f.path.endswith("/zarr.json") for f in files):
                out[(name, e.offsets, e.shape, t.dtype)] = Candidate(e.digest, holder, Piece(p.path, start=p.start),
                                                                     files)
    return out


def reuse(snapshot: Snapshot, found: Mapping[Key, Candidate], here: str, workers: int,
          known_digests: Mapping[Shard, str] | None = None
          ) -> tuple[dict[Shard, Reused], dict[Shard, str], tuple[StepRef, ...]]:
    """(shards not to write again, digests computed for the others that had a candidate, the v4 refs).

    Only shards with a candidate are hashed here, once: the ones that changed are then written without hashing
    again (``known``).  A snapshot read back from a tier (``origin``) is compared by its manifest's digests,
    without reading its data.  ``here``: the new step's folder relative to the run folder.  ``known_digests``: digests
    of the snapshot's arrays its source vouches for (the memory tier's, of shards not written since it hashed them):
    those shards are not hashed again."""
    keyed = {s: (s.tensor, s.offsets, s.shape, snapshot.layout.spec(s.tensor).dtype) for s in snapshot.data}
    todo = [s for s, k in keyed.items() if k in found]
    if snapshot.origin is not None:
        stored = {(name, e.offsets, e.shape): e.digest for name, t in snapshot.origin.tensors.items() for e in t.shards}
        digests = {s: stored.get((s.tensor, s.offsets, s.shape)) for s in todo}
        known: dict[Shard, str] = {}  # written and hashed as usual: the write checks them against the origin
    else:
        given = {s: known_digests[s] for s in todo if known_digests and s in known_digests}
        digests = {**given, **_digests(snapshot, [s for s in todo if s not in given], workers)}
        known = {s: d for s, d in digests.items() if d != found[keyed[s]].digest}
    order: dict[tuple[str, int, str], int] = {}
    used: dict[tuple[str, int, str], dict[str, FileEntry]] = {}
    skip: dict[Shard, Reused] = {}
    folders: dict[tuple[str, int, str], str] = {}
    for s in todo:
        c = found[keyed[s]]
        if digests[s] != c.digest:
            continue
        i = order.setdefault(c.holder, len(order))
        if i == len(used):
            used[c.holder] = {}
            folders[c.holder] = os.path.relpath(os.path.join(branch_rel(c.holder[0]), step_dir(c.holder[1])), here)
        used[c.holder].update((f.path, f) for f in c.files)
        folder = folders[c.holder]
        skip[s] = Reused(Piece(c.piece.path, start=c.piece.start, ref=i), c.digest, folder)
    refs = tuple(StepRef(b, n, d, tuple(sorted(used[(b, n, d)].values(), key=lambda f: f.path)))
                 for (b, n, d) in order)
    return skip, known, refs


PROBE_MIN = 4 << 20  # shards at least this large are probed before they are hashed
PROBE_BYTES = 64 << 10
INLINE_HASH_BYTES = 16 << 20  # fewer bytes (elements x 8, an upper bound) to hash than this: on the calling thread


def probe_rows(shape: tuple[int, ...], dtype: str) -> tuple[slice, ...] | None:
    """The first rows (about PROBE_BYTES) a shard of ``shape`` is probed by; None below PROBE_MIN (it is hashed)."""
    itemsize = dtypes.dtype(dtype).itemsize
    if not shape or math.prod(shape) * itemsize < PROBE_MIN:
        return None
    row = math.prod(shape[1:]) * itemsize
    return (slice(0, min(shape[0], max(1, PROBE_BYTES // max(1, row)))), *(slice(0, n) for n in shape[1:]))


def probe_digests(snapshot: Snapshot) -> dict[Key, str]:
    """Digests of the probed first rows of the snapshot's large shards (~64 KiB each: microseconds).  The tier keeps
    them with the step it writes, so the check of that step's child compares digests instead of reading the step's
    files.  A read-back snapshot is compared by its manifest's digests: none."""
    if snapshot.origin is not None:
        return {}
    out: dict[Key, str] = {}
    for s in snapshot.data:
        dtype = snapshot.layout.spec(s.tensor).dtype
        rows = probe_rows(s.shape, dtype)
        if rows is not None:
            out[(s.tensor, s.offsets, s.shape, dtype)] = _digest(np.asarray(snapshot.array(s))[rows[0]])
    return out


def probe_changed(snapshot: Snapshot, parent: Manifest, found: Mapping[Key, Candidate],
                  read: Callable[[str, ShardEntry, tuple[slice, ...]], np.ndarray],
                  ours: Mapping[Key, str], theirs: Mapping[Key, str] | None = None) -> set[Key]:
    """Keys of large shards whose first rows differ from the parent's: changed for sure, without hashing them.

    In full training every shard changes, and one hash pass over the whole state before the write (instead of
    the writer's, overlapped with its I/O) is most of the dedup check's cost; the first rows settle almost all of
    them.  ``ours``: this snapshot's probe digests (``probe_digests``); ``theirs``: the parent's, when this tier
    wrote it and kept them — different digests are different bytes, so no file is opened; otherwise ~64 KiB of the
    parent's copy of each large shard is read and compared.  Equal first rows prove nothing (the shard is hashed as
    before); a probe that cannot read the parent settles nothing."""
    if theirs is not None:
        return {k for k, d in ours.items() if k in found and k in theirs and theirs[k] != d}
    entries = {(name, e.offsets, e.shape, t.dtype): e for name, t in parent.tensors.items() for e in t.shards}
    out: set[Key] = set()
    for s in snapshot.data:
        key = (s.tensor, s.offsets, s.shape, snapshot.layout.spec(s.tensor).dtype)
        rows = probe_rows(s.shape, key[3])
        if key not in found or key not in ours or rows is None:
            continue
        try:
            stored = read(s.tensor, entries[key], rows)
        except (FlowcheckError, OSError, KeyError) as e:
            log.debug("local tier: dedup probe of %s %s skipped: %s", s.tensor, s.offsets, e)
            continue
        if np.asarray(snapshot.array(s))[rows[0]].tobytes() != np.ascontiguousarray(stored).tobytes():
            out.add(key)
    return out


def _digests(snapshot: Snapshot, shards: list[Shard], workers: int) -> dict[Shard, str]:
    """The shards' data digests, on ``workers`` threads (the native hash releases the GIL), in batches of about
    equal bytes: one task per shard would cost more than hashing thousands of small row blocks."""
    if not shards:
        return {}
    size = {s: math.prod(s.shape) for s in shards}
    if workers <= 1 or sum(size.values()) * 8 < INLINE_HASH_BYTES:  # starting threads costs more than hashing these
        return {s: _digest(snapshot.array(s)) for s in shards}
    per = max(1, sum(size.values()) // (4 * max(1, workers)))
    batches: list[list[Shard]] = [[]]
    filled = 0
    for s in shards:
        if filled >= per:
            batches.append([])
            filled = 0
        batches[-1].append(s)
        filled += size[s]

    def run(batch: list[Shard]) -> list[str]:
        return [_digest(snapshot.array(s)) for s in batch]

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="flowcheck-local-hash") as pool:
        return dict(zip(shards, (d for ds in pool.map(run, batches) for d in ds)))


def _digest(arr: np.ndarray) -> str:
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return f"{DATA_ALG}:{_native.xxh3_128(arr.reshape(-1).view(np.uint8))}"


def find_parent(tiers: Iterable, parent: ParentRef) -> tuple[str, Manifest] | None:
    """The parent's committed manifest in this tier (any branch, ``tiers`` in search order), or None."""
    for t in tiers:
        if parent.step not in t.steps():
            continue
        try:
            m = t.manifest(parent.step)
        except FlowcheckError:
            continue  # unreadable or badly signed: never a source of reused bytes
        if m.digest() == parent.manifest_digest:
            return t.branch, m
    return None


# ---- delete: what committed manifests still reference -------------------------------------------
def references(tiers: Iterable, exclude: tuple[str, int] | None = None
               ) -> dict[tuple[str, int, str], set[str]] | None:
    """(branch, step, manifest digest) of every referenced holder -> the files (relative to its step folder)
    the run's committed manifests (every branch; less ``exclude``, the step being deleted) use; None when some
    manifest cannot be read (nothing can be ruled unreferenced then)."""
    out: dict[tuple[str, int, str], set[str]] = {}
    for t in tiers:
        for n in t.steps():
            if (t.branch, n) == exclude:
                continue
            try:
                m = t.manifest(n, check_signature=False)
            except FlowcheckError as e:
                log.warning("local tier %s: step %d unreadable (%s); keeping every referenced file", t.root, n, e)
                return None
            for r in m.refs:
                files = out.setdefault((r.branch, r.step, r.manifest_digest), set())
                files.update(f.path.partition("/")[2] for f in r.files)
    return out


def retain(root: str, step: int, manifest_digest: str, needed: set[str] | None, fsync: bool) -> str:
    """Move a deleted holder's folder to its retained place (one rename: it leaves the listings at once), then
    drop what no kept step needs (``needed`` None: keep all).  A crash after the rename leaves extra files, which
    the next GC sweep removes; never a missing one."""
    dst = os.path.join(root, retained_dir(step, manifest_digest))
    parent = os.path.dirname(dst)
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
        if fsync:
            fsync_dir(root)
    if os.path.exists(dst):
        # the same state was committed again after an earlier copy of it was deleted and retained: two copies
        # with one identity cannot both be referenced unambiguously, so this one stays (a later GC retries)
        raise TierError(f"local tier {root}: cannot delete step {step}: {dst} already holds the retained bytes of "
                        "an earlier copy of the same state that committed steps reference; delete those steps first")
    os.rename(os.path.join(root, step_dir(step)), dst)
    if fsync:
        fsync_dir(root)
        fsync_dir(parent)
    if needed is not None:
        prune_folder(dst, needed)
    return dst


def prune_folder(folder: str, needed: set[str]) -> None:
    """Remove what of a retained folder no kept step needs, whatever its layout (a pack holder's ``packs/<i>``, a DCP
    step's ``nodes/<part>/packs/<i>``): an array folder holding a needed file stays whole, and so does the path to it
    with its metadata (every ``zarr.json``, the manifest: small, and a plain zarr reader opens what is left).  A
    symlink is removed, never followed."""
    keep = {f.rpartition("/c/")[0] if "/c/" in f else f.rpartition("/")[0] for f in needed}
    _prune(folder, "", keep)


def _prune(folder: str, rel: str, keep: set[str]) -> None:
    path = os.path.join(folder, rel) if rel else folder
    for name in sorted(os.listdir(path)):
        sub = f"{rel}/{name}" if rel else name
        full = os.path.join(path, name)
        if sub in keep and not os.path.islink(full):
            continue  # an array folder (or a file) a kept step reads: whole
        if os.path.isdir(full) and not os.path.islink(full) and any(k.startswith(sub + "/") for k in keep):
            _prune(folder, sub, keep)  # on the way to one
        elif name not in ("zarr.json", MANIFEST) or os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True) if os.path.isdir(full) and not os.path.islink(full) \
                else os.unlink(full)


def sweep(root: str, branch: str, refs: dict[tuple[str, int, str], set[str]] | None, dry_run: bool) -> list[str]:
    """GC of a branch folder's retained holders: each loses what no committed manifest references, and goes
    when nothing is referenced.  ``refs`` None (an unreadable manifest): nothing is touched."""
    base = os.path.join(root, RETAINED)
    if refs is None or not os.path.isdir(base):
        return []
    by_name = {retained_dir(n, d).partition("/")[2]: files for (b, n, d), files in refs.items() if b == branch}
    removed = []
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name)
        needed = by_name.get(name)
        if needed:
            if not dry_run:
                prune_folder(path, needed)
            continue
        removed.append(path)
        if not dry_run:
            shutil.rmtree(path, ignore_errors=True)
    return removed
