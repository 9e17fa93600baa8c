"""Multi-node steps on the object tier: every node commits its part, a node that sees all parts commits the step.

Layout, relative to ``<url>/<run>``::

    step-<step:09d>/nodes/<node>/attempt-<hex>/shard-00000-of-000NN.safetensors   one node's files
    step-<step:09d>/nodes/<node>/manifest.json             its part manifest (v1), committed last
    step-<step:09d>/manifest.json                          the step manifest (v2): the commit

Each write of a part uploads into its own attempt folder: two writers with the same node name
never overwrite each other's files; the part manifest's create picks the winner and the loser
removes its own folder.

The protocol has no coordinator; the object store's exclusive create (S3 ``If-None-Match``, a
hard link on local disks) is the only coordination:

1. a node uploads its files, then creates its part manifest exclusively;
2. it lists the step's parts; once every node of ``cluster.nodes`` has one, it merges them and
   creates ``manifest.json`` exclusively. The merge is a function of the parts alone, so every
   node computes the same manifest: exactly one create wins, the others read the winner's and
   check it is the one they computed;
3. while parts are missing it polls for up to ``cluster.commit_wait_s``: normally the node
   whose part lands last commits the step, and the pollers cover for it if it dies first.

A step whose parts never all arrive has no ``manifest.json``: ``steps()``, restore and ls never
see it, and GC removes its prefix (``ObjectTier.clean_incomplete``) after the grace period.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from flowcheck.tiers.base import MANIFEST, Problem, step_dir

from flowcheck.errors import (
    ClusterError,
    FlowcheckError,
    StepExistsError,
    StepIncompleteError,
    StepNotFoundError,
)
from flowcheck.manifest import (
    MULTI_NODE_VERSION,
    Manifest,
    NodeRef,
    ParentRef,
    Producer,
    ShardEntry,
    TensorEntry,
    parse,
)
from flowcheck.state import Snapshot

if TYPE_CHECKING:
    from flowcheck.tiers.object import ObjectTier

    from flowcheck.config import ClusterConfig

log = logging.getLogger(__name__)

NODES = "nodes"
POLL_MAX_S = 2.0


def part_dir(step: int, node: str) -> str:
    return f"{step_dir(step)}/{NODES}/{node}"


def part_manifest(step: int, node: str) -> str:
    return f"{part_dir(step, node)}/{MANIFEST}"


def node_of(path: str) -> str | None:
    """The node whose part holds a stored file (``step-…/nodes/<node>/…``), else None."""
    parts = path.split("/")
    return parts[2] if len(parts) > 3 and parts[1] == NODES else None


# ---- writing -----------------------------------------------------------------------
def write(tier: ObjectTier, snapshot: Snapshot, parent: ParentRef | None) -> Manifest:
    """Commit this node's part of a step, then the step once every node's part is in.

    Returns the committed step manifest; StepIncompleteError if other nodes' parts are still
    missing after ``commit_wait_s`` (this node's part stays; the step commits when the last part
    lands, or GC removes it).
    """
    committed = _committed(tier, snapshot.step)
    if committed is not None:
        return _check_member(tier, committed, snapshot, parent)
    write_part(tier, snapshot, parent)
    return wait_and_commit(tier, snapshot.step)


def write_part(tier: ObjectTier, snapshot: Snapshot, parent: ParentRef | None) -> Manifest | None:
    """Upload this node's files and commit its part manifest (exclusive create); the step itself is not committed
    here (``wait_and_commit`` does that here; a DCP save's coordinator commits it, flowcheck/dcp/parts.py).
    Returns the committed part (None in the odd case that a racing writer's create won and its part then vanished)."""
    step, node = snapshot.step, tier.node
    existing = _read_part(tier, step, node)  # a retry after this node's commit of the step failed
    if existing is None:
        from flowcheck.tiers.object import attempt_dir

        attempt = attempt_dir(part_dir(step, node))
        part = tier.store_files(snapshot, parent, attempt)
        try:
            tier.create_exclusive(part_manifest(step, node), part.to_bytes(), f"committing node {node}'s part")
            log.info("object tier: node %s committed its part of step %d", node, step)
            return part
        except FileExistsError:
            existing = _read_part(tier, step, node)  # another writer with this node's name raced us
            if existing is not None and existing.files != part.files:  # equal: our own create, its answer lost
                tier.discard(attempt)  # the part that won names other files: ours are nobody's
    if existing is not None and not _same_part(tier, existing, snapshot, parent):
        raise StepExistsError(
            f"object tier {tier.url}: node {node}'s part of step {step} is already committed with other content "
            f"({part_manifest(step, node)}); a node writes each step once"
        )
    return existing


def wait_and_commit(tier: ObjectTier, step: int) -> Manifest:
    """Commit the step as soon as every node's part is in, polling up to ``commit_wait_s``."""
    deadline = time.monotonic() + tier.cluster.commit_wait_s
    delay = 0.05
    while True:
        m, missing = try_commit(tier, step)
        if m is not None:
            tier._publish_latest(step)
            return m
        left = deadline - time.monotonic()
        if left <= 0:
            raise StepIncompleteError(
                f"object tier {tier.url}: step {step}: expected the parts of nodes {tier.cluster.nodes}, "
                f"still missing {missing} after {tier.cluster.commit_wait_s:g}s; the step stays uncommitted "
                "(the last node to commit its part commits it; otherwise GC removes it)"
            )
        time.sleep(min(delay, left))
        delay = min(delay * 2, POLL_MAX_S)


def try_commit(tier: ObjectTier, step: int) -> tuple[Manifest | None, list[str]]:
    """(the committed step manifest, []) — or (None, nodes whose parts are missing)."""
    committed = _committed(tier, step)
    if committed is not None:
        return committed, []
    expected = list(tier.cluster.nodes)
    present = _present(tier, step)
    stray = sorted(present - set(expected))
    if stray:
        raise ClusterError(
            f"object tier {tier.url}: step {step}: found parts of nodes {stray} that cluster.nodes {expected} does "
            "not list; every node of a cluster must have the same cluster.nodes"
        )
    missing = [n for n in expected if n not in present]
    if missing:
        return None, missing
    parts = {n: _read_part(tier, step, n) for n in expected}
    later = [s for s in tier.steps() if s > step]
    if later:
        raise StepIncompleteError(
            f"object tier {tier.url}: step {step}: every part is in, but later step {later[0]} is already "
            "committed; committing this one now would fork the lineage, so it stays uncommitted (GC removes it)"
        )
    m = tier._sign(merge(parts, cluster=tier.cluster, parent=_parent(tier, step)))
    try:
        tier.create_exclusive(f"{step_dir(step)}/{MANIFEST}", m.to_bytes(), "committing the step manifest")
        log.info("object tier: node %s committed step %d (%d nodes)", tier.node, step, len(parts))
        return m, []
    except FileExistsError:
        winner = _await_winner(tier, step)
        return (_check_winner(tier, step, winner, m) if winner else None), []


def _await_winner(tier: ObjectTier, step: int, timeout_s: float = 10.0) -> Manifest | None:
    """The manifest that beat ours: a store may refuse a conditional create (a concurrent one is in
    flight) a moment before the winner's object is readable. None if it never appears: the caller
    tries again, since the concurrent create may have failed."""
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while True:
        try:
            return tier.manifest(step, fresh=True)
        except StepNotFoundError:
            if time.monotonic() >= deadline:
                log.warning("object tier: step %d: the create was refused but no manifest appeared in %gs; retrying",
                            step, timeout_s)
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def _forget_listings(tier: ObjectTier, step: int) -> None:
    """Drop every cached listing under the step (fsspec's invalidate_cache(path) keeps the children's,
    so a part committed after ``nodes/<n>/`` was first listed would stay invisible)."""
    prefix = tier._p(step_dir(step))
    tier.fs.invalidate_cache(prefix)
    cache = getattr(tier.fs, "dircache", None)
    if cache is not None:
        stripped = tier.fs._strip_protocol(prefix).rstrip("/")
        for key in [k for k in list(cache) if k == stripped or k.startswith(stripped + "/")]:
            cache.pop(key, None)


def _committed(tier: ObjectTier, step: int) -> Manifest | None:
    _forget_listings(tier, step)
    if not tier._exists(f"{step_dir(step)}/{MANIFEST}"):
        return None
    return tier.manifest(step, fresh=True)


def _present(tier: ObjectTier, step: int) -> set[str]:
    """Nodes whose part manifest of ``step`` is committed (one listing)."""
    pattern = tier._p(f"{step_dir(step)}/{NODES}/*/{MANIFEST}")
    _forget_listings(tier, step)
    try:
        found = tier._call("listing node parts", tier.fs.glob, pattern)
    except FileNotFoundError:
        return set()
    return {p.rstrip("/").split("/")[-2] for p in found}


def _read_part(tier: ObjectTier, step: int, node: str) -> Manifest | None:
    rel = part_manifest(step, node)
    try:
        raw = tier.read_bytes(rel, f"reading node {node}'s part manifest")
    except FileNotFoundError:
        return None
    m = parse(raw, f"object tier {tier.url}/{rel}")
    tier._check_signature(m)
    if (m.run, m.step, m.producer.node) != (tier.run, step, node):
        raise ClusterError(
            f"object tier {tier.url}/{rel}: expected node {node}'s part of {tier.run} step {step}, "
            f"found node {m.producer.node!r}'s part of {m.run} step {m.step}"
        )
    return m


def _parent(tier: ObjectTier, step: int) -> ParentRef | None:
    """The step chain: a step's parent is the newest committed step before it on its branch in this tier,
    or, for a branch's first step, this tier's state at the branch's fork point."""
    earlier = [s for s in tier.steps() if s < step]
    if earlier:
        return tier.manifest(earlier[-1], check_signature=False).parent_ref()
    record = tier.branch_record()
    if record is None or record.fork is None:
        return None
    fork = record.fork
    if fork.branch is not None:
        holder = tier if fork.branch == tier.branch else tier.at_branch(fork.branch)
        if fork.step in holder.steps():
            return holder.manifest(fork.step, check_signature=False).parent_ref()
    return ParentRef(fork.step, fork.manifest_digest)


def _body(m: Manifest) -> dict:
    body = m.to_json(integrity=False)
    body.pop("signature", None)
    body.pop("parent")
    return body


def _check_winner(tier: ObjectTier, step: int, winner: Manifest, ours: Manifest) -> Manifest:
    """Another node created the step manifest first: it must be the manifest we computed."""
    if _body(winner) != _body(ours):
        raise ClusterError(
            f"object tier {tier.url}: step {step} was committed by another node with a manifest other than the one "
            f"node {tier.node} computed from the same parts (digest {winner.digest()} vs {ours.digest()}); "
            "check that every node runs the same flowcheck and cluster config, then run `flowcheck audit`"
        )
    if winner.parent != ours.parent:  # a step before this one committed between the two attempts
        log.warning("object tier: step %d: the committed parent %s differs from node %s's view %s",
                    step, winner.parent, tier.node, ours.parent)
    return winner


def _same_part(tier: ObjectTier, part: Manifest, snapshot: Snapshot, parent: ParentRef | None) -> bool:
    """Whether a stored part holds this snapshot (a fresh write differs from it only in its time)."""
    ours = tier.identity(snapshot, parent)[1]
    return dataclasses.replace(ours, created_at=part.created_at).digest() == part.digest()


def _check_member(tier: ObjectTier, committed: Manifest, snapshot: Snapshot, parent: ParentRef | None) -> Manifest:
    """The step is already committed (a retry): it must list this node's part, holding this snapshot."""
    listed = {n.node: n.manifest_digest for n in committed.nodes}
    part = _read_part(tier, snapshot.step, tier.node) if tier.node in listed else None
    if part is None or part.digest() != listed[tier.node] or not _same_part(tier, part, snapshot, parent):
        raise StepExistsError(
            f"object tier {tier.url}: step {snapshot.step} is already committed "
            f"{'without a part of' if tier.node not in listed else 'with another part of'} node {tier.node}"
        )
    return committed


# ---- merging -------------------------------------------------------------------------
AGREE = ("run", "step", "layout_digest", "scalars")


def merge(parts: Mapping[str, Manifest], *, cluster: ClusterConfig, parent: ParentRef | None) -> Manifest:
    """The step manifest of a set of node parts — a function of the parts alone, so every node gets the same.

    Refuses parts that disagree on what step they hold, that place a shard outside their own
    files, or whose shards overlap or leave part of a tensor uncovered.
    """
    names = sorted(parts)
    first = parts[names[0]]
    for field_ in AGREE:
        values = {n: getattr(parts[n], field_) for n in names}
        other = next((n for n in names if values[n] != values[names[0]]), None)
        if other is not None:
            raise ClusterError(
                f"step {first.step}: node parts disagree on '{field_}': node {names[0]} has {_short(values[names[0]])}, "
                f"node {other} has {_short(values[other])}; every node must store the same step of the same state"
            )
    for n in names:
        _check_own_files(parts[n], n)
    tensors = {}
    for tname, t in first.tensors.items():
        owned = [(n, s) for n in names for s in parts[n].tensors[tname].shards]
        check_cover(first.step, tname, t.global_shape, owned)
        shards = tuple(s for _, s in sorted(owned, key=lambda o: o[1].offsets))
        tensors[tname] = TensorEntry(t.dtype, t.global_shape, t.role, shards)
    versions = sorted({parts[n].producer.version for n in names})
    return Manifest(
        run=first.run,
        step=first.step,
        created_at=max(parts[n].created_at for n in names),
        producer=Producer(cluster.name, ",".join(versions), first.producer.source),
        parent=parent,
        layout_digest=first.layout_digest,
        source_layout=first.source_layout,
        tensors=tensors,
        files=tuple(sorted((f for n in names for f in parts[n].files), key=lambda f: f.path)),
        scalars=first.scalars,
        buckets=first.buckets,
        format_version=MULTI_NODE_VERSION,
        nodes=tuple(NodeRef(n, parts[n].digest()) for n in names),
    )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _check_own_files(part: Manifest, node: str) -> None:
    """A part's files lie in its own folder, and its shards only in those files (a safetensors file, or a zarr
    array's folder of listed files: a local-tier part, flowcheck/dcp/parts.py)."""
    own = f"{part_dir(part.step, node)}/"
    paths = {f.path for f in part.files}
    folders = {p.rsplit("/", i)[0] for p in paths for i in range(1, p.count("/") + 1)}
    bad = sorted(p for p in paths if not p.startswith(own))
    bad += sorted(p for p in {pc.path for t in part.tensors.values() for s in t.shards for pc in s.location} - paths
                  if not (p.startswith(own) and p in folders))
    if bad:
        raise ClusterError(
            f"step {part.step}: node {node}'s part names {bad[0]!r}; expected only its own files under {own}"
        )


def _box(s: ShardEntry) -> str:
    return f"offsets {list(s.offsets)} shape {list(s.shape)}"


def check_cover(step: int, name: str, shape: tuple[int, ...], owned: list[tuple[str, ShardEntry]]) -> None:
    """Every element of the tensor belongs to exactly one shard of one node: no overlap, no hole."""
    _check_disjoint(step, name, shape, owned)
    total = math.prod(shape)
    covered = sum(math.prod(s.shape) for _, s in owned)
    if covered != total:
        holders = sorted({n for n, _ in owned})
        raise ClusterError(
            f"step {step} tensor {name}: expected the node parts to cover all {total} elements of shape {list(shape)}, "
            f"found {covered} (shards from {holders or 'no node'}); every element must belong to exactly one node"
        )


def _check_disjoint(step: int, name: str, shape: tuple[int, ...], owned: list[tuple[str, ShardEntry]]) -> None:
    """Sweep along the dimension with the most distinct offsets: only boxes open there can overlap."""
    if len(owned) < 2:
        return
    dim = max(range(len(shape)), key=lambda d: len({s.offsets[d] for _, s in owned})) if shape else None
    start = (lambda s: s.offsets[dim]) if dim is not None else (lambda s: 0)
    stop = (lambda s: s.offsets[dim] + s.shape[dim]) if dim is not None else (lambda s: 1)
    active: list[tuple[str, ShardEntry]] = []
    for node, s in sorted(owned, key=lambda o: start(o[1])):
        active = [(n, a) for n, a in active if stop(a) > start(s)]
        for n, a in active:
            if _overlap(a, s):
                raise ClusterError(
                    f"step {step} tensor {name}: node {n}'s shard ({_box(a)}) overlaps node {node}'s shard ({_box(s)}); "
                    "every element must belong to exactly one node — check the nodes' shard assignment"
                )
        active.append((node, s))


def _overlap(a: ShardEntry, b: ShardEntry) -> bool:
    if a.offsets == b.offsets and a.shape == b.shape:
        return True  # the same box twice, even an empty one
    return all(max(oa, ob) < min(oa + sa, ob + sb) for oa, sa, ob, sb in zip(a.offsets, a.shape, b.offsets, b.shape))


# ---- verifying -----------------------------------------------------------------------
def verify_parts(tier: ObjectTier, m: Manifest) -> list[Problem]:
    """Each listed part manifest: present, intact, of the digest the step lists, and merged as stored."""
    problems: list[Problem] = []
    merged = _placements(m)
    from_parts: set[tuple] = set()
    for ref in m.nodes:
        rel = part_manifest(m.step, ref.node)
        try:
            part = _read_part(tier, m.step, ref.node)
        except FlowcheckError as e:
            problems.append(Problem(tier.name, m.step, f"node {ref.node}: {e}", rel))
            continue
        if part is None:
            problems.append(Problem(tier.name, m.step, f"node {ref.node}: part manifest listed by the step is missing", rel))
            continue
        if part.digest() != ref.manifest_digest:
            problems.append(Problem(tier.name, m.step, f"node {ref.node}: part manifest digest {part.digest()} != "
                                    f"step manifest's {ref.manifest_digest}", rel))
            continue
        placed = _placements(part)
        if not placed <= merged or not set(part.files) <= set(m.files):
            problems.append(Problem(tier.name, m.step, f"node {ref.node}: the step manifest does not hold this part's "
                                    "shards and files as the part records them", rel))
        from_parts |= placed
    if not problems and from_parts != merged:
        problems.append(Problem(tier.name, m.step, f"{len(merged - from_parts)} shard(s) of the step manifest belong "
                                "to no node part", MANIFEST))
    return problems


def _placements(m: Manifest) -> set[tuple]:
    return {(n, s.offsets, s.shape, s.digest, s.location) for n, t in m.tensors.items() for s in t.shards}


def expected_manifest_id(m: Manifest, path: str) -> str:
    """The manifest id a stored file's safetensors metadata must carry: its node part's digest, or the step's."""
    node = node_of(path)
    for ref in m.nodes:
        if ref.node == node:
            return ref.manifest_digest
    return m.digest()


__all__ = ["check_cover", "merge", "part_dir", "part_manifest", "try_commit", "verify_parts", "write", "write_part"]
