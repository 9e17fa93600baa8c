"""The manifest of a snapshot written to a tier: built from its shards, digests checked against a read-back origin."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import numpy as np

from flowcheck.version import __version__
from flowcheck.digest import data_digest
from flowcheck.errors import IntegrityError
from flowcheck.manifest import FORMAT_VERSION, FileEntry, Manifest, ParentRef, Piece, Producer, ShardEntry, TensorEntry, now_utc
from flowcheck.state import Shard, Snapshot


def make_manifest(
    snapshot: Snapshot,
    *,
    node: str,
    parent: ParentRef | None,
    digests: dict[Shard, str],
    locations: dict[Shard, tuple[Piece, ...]],
    files: Iterable[FileEntry],
) -> Manifest:
    """The manifest of a snapshot written to a tier; a read-back snapshot keeps its identity."""
    by_tensor: dict[str, list[ShardEntry]] = {}
    for shard in snapshot.data:
        entry = ShardEntry(shard.offsets, shard.shape, digests[shard], locations[shard])
        by_tensor.setdefault(shard.tensor, []).append(entry)
    origin: Manifest | None = snapshot.origin
    if origin is not None:
        # a read-back snapshot comes in storage order (an incremental step's shards lie in several steps' files):
        # its copy lists each tensor's shards in the origin's order, which the manifest digest covers
        for name, entries in by_tensor.items():
            rank = {(e.offsets, e.shape): i for i, e in enumerate(origin.tensors[name].shards)}
            entries.sort(key=lambda e: rank.get((e.offsets, e.shape), len(rank)))
    tensors = {
        spec.name: TensorEntry(spec.dtype, spec.shape, spec.role, tuple(by_tensor.get(spec.name, ())))
        for spec in snapshot.layout.tensors
    }
    return Manifest(
        run=snapshot.run,
        step=snapshot.step,
        created_at=origin.created_at if origin else now_utc(),
        producer=origin.producer if origin else Producer(node, __version__, snapshot.source),
        parent=origin.parent if origin else parent,
        layout_digest=snapshot.layout.digest(),
        source_layout=snapshot.layout.source,
        tensors=tensors,
        files=tuple(sorted(files, key=lambda f: f.path)),
        scalars=origin.scalars if origin else snapshot.scalars.to_json(),
        buckets=snapshot.layout.buckets,
        # a merged multi-node step keeps its node list (and so its digest) in every tier it is copied to; a v3
        # origin's version says only how the local tier laid it out (the writing tier says its own)
        format_version=origin.format_version if origin and origin.nodes else FORMAT_VERSION,
        nodes=origin.nodes if origin else (),
    )


def shard_digests(snapshot: Snapshot, arrays: dict[Shard, np.ndarray]) -> dict[Shard, str]:
    """Data digests, checked against the origin manifest when the snapshot was read back."""
    return check_digests(snapshot, {s: data_digest(a) for s, a in arrays.items()})


def check_digests(snapshot: Snapshot, out: dict[Shard, str]) -> dict[Shard, str]:
    """Data digests computed while writing, checked against the origin manifest when the snapshot was read back."""
    if snapshot.origin is not None:
        known = _origin_digests(snapshot.origin)
        for shard, got in out.items():
            want = known.get((shard.tensor, shard.offsets, shard.shape))
            if got != want:
                raise IntegrityError(
                    f"step {snapshot.step} tensor {shard.tensor} shard {shard.offsets}: data digest {got} "
                    f"does not match the manifest's {want}; the source copy is damaged"
                )
    return out


def _origin_digests(m: Manifest) -> dict[tuple[str, tuple[int, ...], tuple[int, ...]], str]:
    """Every shard's digest by (tensor, offsets, shape): one lookup per shard (a tensor may have thousands of row
    blocks)."""
    return {(name, s.offsets, s.shape): s.digest for name, t in m.tensors.items() for s in t.shards}


def shard_files(manifest: Manifest, entry: ShardEntry) -> list[str]:
    """The manifest's files holding a shard: its pieces' files, or the files under its zarr array."""
    refs = [p for p in entry.location if p.ref is not None and p.ref < len(manifest.refs)]
    if refs:
        return [f"{p.path} of step {manifest.refs[p.ref].step} (branch {manifest.refs[p.ref].branch}), referenced"
                for p in refs]
    pieces = {p.path for p in entry.location}
    found = [f.path for f in manifest.files if f.path in pieces or any(f.path.startswith(p + "/") for p in pieces)]
    return found or sorted(pieces) or ["(no file)"]


def with_origin(snapshot: Snapshot, origin: Manifest | None) -> Snapshot:
    return replace(snapshot, origin=origin)
