"""One DCP save as "many nodes, one step" (tiers/cluster.py): each rank stores a part, the coordinator commits the step.

Every rank writes its chunks with its tier's own writer as a part named ``rank-<rank:05d>``, under the step's
``nodes/<node>/`` folder — the object tier through ``ObjectTier.write_part`` (files in an attempt folder, then the
part manifest, exclusive create), the local tier through ``LocalTier.write_part`` straight into
``nodes/<node>/`` of the step's temporary folder (every file and folder fsync'd; no part manifest file, no
rename: the part manifest travels in the write results).  DCP's bytes items reach the coordinator in the write
results; it stores them as one more part, ``objects`` (their sizes are known only now, so no rank's part could
list them).  The step manifest is ``cluster.merge`` of the rank parts (they must agree, cover every tensor exactly once, name only their own
files) plus the objects part, committed the way each tier commits: on the object tier the exclusive create of
``step-…/manifest.json``, on the local tier the manifest written last into ``step-….dcp-<save>.tmp`` and the
folder renamed into place.  A rank that fails or dies leaves parts but no step manifest: nothing is visible,
and GC removes the leftovers after the grace period (``.tmp`` folders, uncommitted object prefixes).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Mapping

from flowcheck.config import ClusterConfig
from flowcheck.dcp.target import SaveTarget, cores_per_rank
from flowcheck.digest import file_digest
from flowcheck.errors import FlowcheckError, StepExistsError
from flowcheck.manifest import FORMAT_VERSION, FileEntry, Manifest, NodeRef, parse
from flowcheck.state import Snapshot
from flowcheck.store import Store
from flowcheck.tiers import cluster
from flowcheck.tiers.base import MANIFEST, step_dir
from flowcheck.tiers.durable import fsync_dir, replace_file, sync_paths, write_file

log = logging.getLogger(__name__)

OBJECTS_NODE = "objects"  # the part holding DCP's bytes items, written by the coordinator


def write_part(store: Store, target: SaveTarget, snapshot: Snapshot, node: str) -> Manifest:
    """Store one part of the step (``node``'s shards) and return its manifest (locations under ``nodes/<node>/``)."""
    if target.tier == "object":
        tier = _as_node(store, node).tier("object", target.branch)
        part = tier.write_part(snapshot, target.parent)
        if part is None:
            raise FlowcheckError(f"object tier: {node}'s part of step {target.step} was taken over by another writer "
                                 "and then removed; save the step again")
        return part
    return _local_part(store, target, snapshot, node)


def _as_node(store: Store, node: str) -> Store:
    """The same store, writing as ``node`` (a part manifest's producer.node names its part)."""
    return Store(dataclasses.replace(store.config, node=node))


def temp_dir(store: Store, target: SaveTarget) -> str:
    """This save's folder next to the step's final one (a ``step-*.tmp``: local GC removes it when abandoned)."""
    return os.path.join(store.tier("local", target.branch).root, f"{step_dir(target.step)}.dcp-{target.save_id}.tmp")


def _local_part(store: Store, target: SaveTarget, snapshot: Snapshot, node: str) -> Manifest:
    from flowcheck.tiers.local import LocalTier

    tmp = temp_dir(store, target)
    cfg = store.config
    # fsync file by file: the ranks write at once, and each one's syncfs would flush all the others' data too;
    # writer threads: this rank's share of the cores.  The root is never written (the part goes to `dest`); it
    # only keeps the writer from finding an earlier step to share shards with (a part holds all of its shards)
    local = dataclasses.replace(cfg.tiers.local, root=os.path.join(tmp, "staging", node), sync_mode="fsync",
                                workers=cores_per_rank(cfg.tiers.local.workers))
    writer = LocalTier(local, cfg.run, node=node, signing_key=store.local.signing_key,
                       require_signature=store.local.require_signature)
    dest = os.path.join(tmp, cluster.NODES, node)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    # zarr, CRC32C, digests, every file and folder durable: the tier's own write, straight into the step's
    # temporary folder and without a manifest file of its own (the part manifest travels in the write results;
    # the step manifest lists the part; the commit syncs `nodes/` before it writes that manifest)
    part = writer.write_part(snapshot, target.parent, dest)
    return _relocated(part, node)


def _relocated(part: Manifest, node: str) -> Manifest:
    """A part written as a step of its own, its paths moved under ``step-…/nodes/<node>/`` (locations and files
    are not part of a manifest's digest: the part keeps its identity)."""
    old, new = f"{step_dir(part.step)}/", f"{cluster.part_dir(part.step, node)}/"

    def moved(path: str) -> str:
        if not path.startswith(old):
            raise FlowcheckError(f"local tier: {node}'s part names {path!r} outside its step folder")
        return new + path[len(old):]

    tensors = {name: dataclasses.replace(t, shards=tuple(
        dataclasses.replace(s, location=tuple(dataclasses.replace(p, path=moved(p.path)) for p in s.location))
        for s in t.shards)) for name, t in part.tensors.items()}
    files = tuple(FileEntry(moved(f.path), f.bytes, f.digest) for f in part.files)
    return dataclasses.replace(part, tensors=tensors, files=files, signature=None)


# ---- the coordinator's commit ------------------------------------------------------------
def step_manifest(target: SaveTarget, parts: Mapping[str, Manifest], objects: Manifest | None, producer: str) -> Manifest:
    """``cluster.merge`` of the rank parts, with the bytes items' part added (v2: ``nodes`` lists every part).

    Parts written in a layout of their own version (the local tier's packed pieces, v3) give the step that version,
    which carries no node list: the step manifest then names the parts only through its files' paths."""
    every = {**parts, **({OBJECTS_NODE: objects} if objects is not None else {})}
    if not every:
        raise FlowcheckError(f"DCP save of step {target.step}: no rank wrote anything; nothing to commit")
    if not parts:
        parts, objects = every, None
    merged = cluster.merge(parts, cluster=ClusterConfig(nodes=sorted(parts), name=producer), parent=target.parent)
    if objects is not None:
        whole = dataclasses.replace(merged, tensors={**merged.tensors, **objects.tensors},
                                    files=tuple(sorted(merged.files + objects.files, key=lambda f: f.path)),
                                    nodes=tuple(sorted(merged.nodes + (NodeRef(OBJECTS_NODE, objects.digest()),),
                                                       key=lambda n: n.node)))
        merged = dataclasses.replace(whole, layout_digest=whole.layout().digest())
    own = {p.format_version for p in every.values()} - {FORMAT_VERSION}
    return dataclasses.replace(merged, format_version=max(own), nodes=()) if own else merged


def commit(store: Store, target: SaveTarget, manifest: Manifest) -> Manifest:
    """Commit the step manifest in the target tier (nothing of the step is visible before this)."""
    tier = store.tier(target.tier, target.branch)
    if target.tier == "object":
        m = _commit_object(tier, manifest)
    else:
        m = _commit_local(store, target, tier, manifest)
    try:
        tier.publish_latest(m.step)  # only after a durable commit, as every tier write does
    except FlowcheckError as e:
        log.warning("%s tier: step %d committed, but updating 'latest' failed: %s", tier.name, m.step, e)
    log.info("%s tier: committed DCP step %d of run %s (%d parts, %d bytes)", tier.name, m.step, m.run,
             len(m.nodes), m.nbytes)
    return m


def discard(store: Store, target: SaveTarget, written: Mapping[str, Manifest]) -> None:
    """Drop a save that is not committed (the same state is already stored): the local tier's temporary folder, or
    on the object tier each part's files and part manifest (``written``: the parts, by node), so a later save of
    another state at this step on this branch finds no stale part in its way."""
    if target.tier == "local":
        shutil.rmtree(temp_dir(store, target), ignore_errors=True)
        return
    tier = store.tier("object", target.branch)
    for node, part in written.items():
        for f in part.files:
            tier.remove_file(f.path, f"removing {node}'s part of a save that committed nothing")
        tier.remove_file(cluster.part_manifest(target.step, node), f"removing {node}'s part manifest")


def _commit_object(tier, m: Manifest) -> Manifest:
    m = tier.sign(m)
    rel = f"{step_dir(m.step)}/{MANIFEST}"
    try:
        tier.create_exclusive(rel, m.to_bytes(), "committing the step manifest")
    except FileExistsError as e:
        existing = parse(tier.read_bytes(rel, "reading back the step manifest"), rel)
        if existing.digest() != m.digest():  # ours, when the answer to our own create was lost
            raise StepExistsError(f"object tier {tier.url}: step {m.step} was committed by another writer meanwhile "
                                  f"(manifest {existing.digest()}); this save's parts stay uncommitted and GC removes "
                                  "them — save under another step") from e
    return m


def _commit_local(store: Store, target: SaveTarget, tier, m: Manifest) -> Manifest:
    """The local tier's commit, as LocalTier does it: data durable, manifest last, then the folder renamed.

    The parts' files and folders are durable already (each rank synced its own); what is left before the manifest
    — the two group files, ``nodes/`` (the parts' entries) and the step folder — is synced at once, in any order
    (none of them is visible before the manifest and the rename), so the journal commits them together."""
    tmp, final = temp_dir(store, target), os.path.join(tier.root, step_dir(m.step))
    fsync = store.config.tiers.local.fsync
    shutil.rmtree(os.path.join(tmp, "staging"), ignore_errors=True)
    groups = [_zarr_group(tmp, rel, m) for rel in (cluster.NODES, "")]  # zarr readers open the step folder
    m = dataclasses.replace(m, files=tuple(sorted(m.files + tuple(groups), key=lambda f: f.path)))
    m, raw = tier.signed_bytes(m)
    if fsync:
        sync_paths([os.path.join(tmp, cluster.NODES, "zarr.json"), os.path.join(tmp, "zarr.json"),
                    os.path.join(tmp, cluster.NODES), tmp], workers=4)
    replace_file(os.path.join(tmp, MANIFEST), raw, fsync=fsync)
    if os.path.exists(os.path.join(final, MANIFEST)):
        raise StepExistsError(f"local tier {tier.root}: step {m.step} was committed by another writer meanwhile; this "
                              "save stays uncommitted (GC removes its .tmp folder) — save under another step")
    os.rename(tmp, final)
    if fsync:
        fsync_dir(tier.root)
    return m


def _zarr_group(tmp: str, rel: str, m: Manifest) -> FileEntry:
    """A zarr v3 group's ``zarr.json`` at ``rel`` of the step folder, as a file of the manifest (not yet synced)."""
    body = {"zarr_format": 3, "node_type": "group", "attributes": {} if rel else
            {"flowcheck": {"run": m.run, "step": m.step, "parts": [n.node for n in m.nodes]}}}
    path = os.path.join(tmp, rel, "zarr.json")
    write_file(path, json.dumps(body, sort_keys=True).encode(), fsync=False)
    size, digest = file_digest(path)
    return FileEntry(f"{step_dir(m.step)}/{rel + '/' if rel else ''}zarr.json", size, digest)
