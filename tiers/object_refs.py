"""The object tier's references between steps (manifest v4): a write (a promotion) uploads only the shards the
parent's object copy does not hold; reads, audit, deletion and GC follow the references.

Same pointer form as the local tier (tiers/local_refs.py, docs/format.md "Incremental steps"): a reused shard's pieces
keep the holder's path (``step-<N>/attempt-<hex>/shard-….safetensors``, relative to the holder's branch folder),
key and rows, and name the holder by index into ``refs``.  Deleting a holder that a kept manifest (any branch)
references removes its manifest first (the step leaves the listings at once), then only the files nobody
references: the referenced files stay at their place (``step-<N>/attempt-<hex>/`` never names another state) and
a later delete or GC removes them once the count of references finds them unused.  Files are only ever removed
after a count that found them unreferenced, so a delete or GC killed at any point leaves every kept step readable.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from flowcheck.branches import branch_root
from flowcheck.manifest import FileEntry, Manifest, Piece, StepRef
from flowcheck.state import Shard, Snapshot
from flowcheck.tiers.base import Tier, step_dir
from flowcheck.tiers.local_refs import Key, find_parent, references


__all__ = ["Candidate", "candidates", "reuse", "reusable", "holder_path", "held_files", "find_parent"]


@dataclass(frozen=True)
class Candidate:
    """What the parent's object copy stores for one shard key: its digest and where its pieces lie (in the holder)."""

    digest: str
    holder: tuple[str, int, str]  # branch, step, manifest digest
    pieces: tuple[Piece, ...]  # paths relative to the holder's branch folder; no ref
    files: tuple[FileEntry, ...]


def candidates(parent: Manifest, branch: str) -> dict[Key, Candidate]:
    """Every safetensors-stored shard of the parent (on ``branch``), by key, with the step that holds its bytes.
    A multi-node parent's shards are not reused (its files belong to node parts)."""
    if parent.nodes:
        return {}
    own = (branch, parent.step, parent.digest())
    pools: dict[int | None, dict[str, FileEntry]] = {None: {f.path: f for f in parent.files}}
    out: dict[Key, Candidate] = {}
    for name, t in parent.tensors.items():
        for e in t.shards:
            held = {p.ref for p in e.location}
            if not e.location or len(held) != 1 or any(p.key is None or p.start is not None for p in e.location):
                continue
            ref = held.pop()
            if ref not in pools:
                pools[ref] = {f.path: f for f in parent.refs[ref].files}
            paths = sorted({p.path for p in e.location})
            if any(p not in pools[ref] for p in paths):
                continue  # a file the manifest does not vouch for is never a source of reused bytes
            r = parent.refs[ref] if ref is not None else None
            holder = own if r is None else (r.branch, r.step, r.manifest_digest)
            out[(name, e.offsets, e.shape, t.dtype)] = Candidate(
                e.digest, holder, tuple(replace(p, ref=None) for p in e.location), tuple(pools[ref][p] for p in paths))
    return out


def reuse(found: Mapping[Key, Candidate], snapshot: Snapshot, digests: Mapping[Shard, str]
          ) -> tuple[dict[Shard, tuple[Piece, ...]], tuple[StepRef, ...]]:
    """(the locations of the shards not uploaded again, the v4 refs): a shard is reused when the parent holds the
    same key with the same data digest.  References never chain: a candidate already names the holder."""
    order: dict[tuple[str, int, str], int] = {}
    used: dict[tuple[str, int, str], dict[str, FileEntry]] = {}
    skip: dict[Shard, tuple[Piece, ...]] = {}
    for s in snapshot.data:
        c = found.get((s.tensor, s.offsets, s.shape, snapshot.layout.spec(s.tensor).dtype))
        if c is None or digests.get(s) != c.digest:
            continue
        i = order.setdefault(c.holder, len(order))
        used.setdefault(c.holder, {}).update((f.path, f) for f in c.files)
        skip[s] = tuple(replace(p, ref=i) for p in c.pieces)
    refs = tuple(StepRef(b, n, d, tuple(sorted(used[(b, n, d)].values(), key=lambda f: f.path)))
                 for (b, n, d) in order)
    return skip, refs


def reusable(tier: Tier, snapshot: Snapshot, parent, digests: Mapping[Shard, str]
             ) -> tuple[dict[Shard, tuple[Piece, ...]], tuple[StepRef, ...]]:
    """What a write of ``snapshot`` need not upload: the shards its parent's committed object copy (any branch,
    same manifest digest) holds.  No parent copy: nothing (the step is uploaded in full)."""
    if parent is None or (snapshot.origin is not None and snapshot.origin.nodes):
        return {}, ()
    found = find_parent(tier.search_order(), parent)
    if found is None:
        return {}, ()
    return reuse(candidates(found[1], found[0]), snapshot, digests)


def holder_path(tier: Tier, ref: StepRef, rel: str) -> str:
    """The store path of a holder's file: under the run's prefix always (the branch name and the relative path
    were checked when the manifest was parsed)."""
    return f"{tier.base}/{branch_root(tier.run, ref.branch)}/{rel}"


def held_files(tier: Tier, exclude: int | None = None) -> dict[int, set[str]] | None:
    """This branch's steps whose files committed manifests of the run (every branch; less step ``exclude`` of
    this branch, the one being deleted) reference -> those files, relative to the branch folder; None when some
    manifest cannot be read (nothing can be ruled unreferenced then)."""
    refs = references(tier.search_order(), None if exclude is None else (tier.branch, exclude))
    if refs is None:
        return None
    out: dict[int, set[str]] = {}
    for (b, n, _), files in refs.items():
        if b == tier.branch:
            out.setdefault(n, set()).update(f"{step_dir(n)}/{f}" for f in files)
    return out


def holds(unit: str, held: Iterable[str]) -> bool:
    """Whether a file or folder (relative to the branch folder) is, or contains, a referenced file."""
    return any(h == unit or h.startswith(unit.rstrip("/") + "/") for h in held)
