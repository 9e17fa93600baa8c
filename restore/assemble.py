"""Assemble a global tensor (or a region of it) from a step's shards, every shard's digest verified."""
from __future__ import annotations

import numpy as np

from flowcheck import dtypes
from flowcheck.errors import IntegrityError
from flowcheck.manifest import Manifest
from flowcheck.state import Shard
from flowcheck.tiers.base import Tier, full_region


def assemble_tensor(tier: Tier, manifest: Manifest, name: str) -> np.ndarray:
    """The whole global tensor ``name``; raises IntegrityError if a shard is damaged or the shards leave holes."""
    t = manifest.tensors[name]
    if len(t.shards) == 1 and tuple(t.shards[0].shape) == tuple(t.global_shape):
        return tier.read_shard(manifest, name, t.shards[0], verify=True)  # one shard is the tensor: no copy
    out = np.empty(t.global_shape, dtype=dtypes.dtype(t.dtype).storage)
    covered = np.zeros(t.global_shape, dtype=bool) if len(t.shards) > 1 else None
    for entry in t.shards:
        _, dest = Shard(name, entry.offsets, entry.shape).intersect(full_region(t.global_shape))
        out[dest] = tier.read_shard(manifest, name, entry, verify=True)
        if covered is not None:
            covered[dest] = True
    if (covered is not None and not covered.all()) or (not t.shards and out.size):
        raise IntegrityError(f"step {manifest.step} tensor {name}: the stored shards do not cover the whole tensor")
    return out
