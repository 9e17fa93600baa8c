"""Multi-node steps on the object tier: every node commits its part, a node that sees all parts commits the step.
(The protocol, the layout and the merge; the tier's half — writing parts, committing, verifying — is
tiers/object_cluster.py.)

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

import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from flowcheck.errors import ClusterError
from flowcheck.manifest import MULTI_NODE_VERSION, Manifest, NodeRef, ParentRef, Producer, ShardEntry, TensorEntry
from flowcheck.tiers.base import MANIFEST, step_dir

if TYPE_CHECKING:
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
def body_of(m: Manifest) -> dict:
    body = m.to_json(integrity=False)
    body.pop("signature", None)
    body.pop("parent")
    return body


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
def placements(m: Manifest) -> set[tuple]:
    return {(n, s.offsets, s.shape, s.digest, s.location) for n, t in m.tensors.items() for s in t.shards}


def expected_manifest_id(m: Manifest, path: str) -> str:
    """The manifest id a stored file's safetensors metadata must carry: its node part's digest, or the step's."""
    node = node_of(path)
    for ref in m.nodes:
        if ref.node == node:
            return ref.manifest_digest
    return m.digest()


__all__ = ["check_cover", "merge", "part_dir", "part_manifest"]
