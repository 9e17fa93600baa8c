"""Assemble a global tensor (or a region of it) from a step's shards, every shard's digest verified."""
from __future__ import annotations

import math

import numpy as np

from flowcheck.errors import FlowcheckError, IntegrityError, TierError
from flowcheck.manifest import Manifest
from flowcheck.state import Shard
from flowcheck.tiers.base import Tier, allocate, full_region


def assemble_tensor(tier: Tier, manifest: Manifest, name: str) -> np.ndarray:
    """The whole global tensor ``name``; raises IntegrityError if a shard is damaged or the shards leave holes.

    Every failure is a FlowcheckError: a read the tier lets through as a bare OSError becomes a TierError (so
    a writer consuming this never takes it for a failure of its own output)."""
    try:
        return _assemble(tier, manifest, name)
    except FlowcheckError:
        raise
    except OSError as e:
        raise TierError(f"{tier.name} tier: cannot read step {manifest.step} tensor {name}: {e}") from e


def _assemble(tier: Tier, manifest: Manifest, name: str) -> np.ndarray:
    t = manifest.tensors[name]
    if len(t.shards) == 1 and tuple(t.shards[0].shape) == tuple(t.global_shape):
        return tier.read_shard(manifest, name, t.shards[0], verify=True)  # one shard is the tensor: no copy
    if sum(math.prod(s.shape) for s in t.shards) < math.prod(t.global_shape):
        # checked before allocating: a manifest whose shape outgrows its shards must not size the buffer
        raise IntegrityError(f"step {manifest.step} tensor {name}: the stored shards cover less than its global "
                             f"shape {list(t.global_shape)}; this copy is incomplete or its manifest forged")
    what = f"{tier.name} tier step {manifest.step} tensor {name}"
    out = allocate(t.global_shape, t.dtype, what)
    covered = allocate(t.global_shape, "bool", what, zeroed=True) if len(t.shards) > 1 else None
    for entry in t.shards:
        _, dest = Shard(name, entry.offsets, entry.shape).intersect(full_region(t.global_shape))
        out[dest] = tier.read_shard(manifest, name, entry, verify=True)
        if covered is not None:
            covered[dest] = True
    if (covered is not None and not covered.all()) or (not t.shards and out.size):
        raise IntegrityError(f"step {manifest.step} tensor {name}: the stored shards do not cover the whole tensor")
    return out
