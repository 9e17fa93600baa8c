"""``flowcheck.dcp.Reader`` on the object tier (file:// and a moto S3 server): a shard DCP's plan wants whole is read
by ranged reads straight into its destination tensor, its digest computed over that tensor and checked against the
manifest's; a damaged copy fails naming the shard, or is read from an intact copy."""
from __future__ import annotations

import dataclasses
import math
import os
import warnings

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from flowcheck import dtypes
from flowcheck.dcp.index import object_name
from flowcheck.errors import IntegrityError
from flowcheck.store import open_store
from flowcheck.tiers.object import ObjectTier
from tests.conftest import OBJECT_SERVERS, bucket_on
from tests.dcp.test_dcp_fsdp import config
from tests.dcp.test_dcp_single import load, same, save, state, zeros_like

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@pytest.fixture(params=["file", *OBJECT_SERVERS])
def cfg(request, tmp_path):
    return config(str(tmp_path), None if request.param == "file" else bucket_on(request, request.param))


def _stored(cfg: str, step: int):
    store = open_store(cfg)
    m = store.object.manifest(step)
    items = [(n, e) for n, t in m.tensors.items() for e in t.shards]
    return store.object, m, items


def _buffers(m, items) -> list[np.ndarray]:
    return [np.full(math.prod(e.shape) * dtypes.dtype(m.tensors[n].dtype).itemsize, 0xAB, np.uint8) for n, e in items]


def test_read_shards_into_fills_the_callers_arrays_with_the_checked_shards(cfg):
    save(cfg, state(3), 3, tier="object")
    tier, m, items = _stored(cfg, 3)
    into = _buffers(m, items)
    tier.read_shards_into(m, items, into)
    for (name, entry), got in zip(items, into):
        assert np.array_equal(got, np.ascontiguousarray(tier.read_shard(m, name, entry)).reshape(-1).view(np.uint8))
    name, entry = items[-1]
    wrong = dataclasses.replace(entry, digest="xxh3-128:" + "0" * 32)
    with pytest.raises(IntegrityError, match=f"tensor {name} shard"):
        tier.read_shards_into(m, [*items[:-1], (name, wrong)], _buffers(m, items))
    with pytest.raises(ValueError, match="expected a writable contiguous array"):
        tier.read_shards_into(m, items, [b[:-1] for b in into])


def test_a_dcp_load_from_the_object_tier_reads_whole_shards_straight_into_the_state(cfg, monkeypatch):
    save(cfg, state(3), 3, tier="object")
    filled, one_by_one = [], []
    real_into, real_one = ObjectTier.read_shards_into, ObjectTier.read_shard

    def read_shards_into(self, m, items, into):  # the real read, recording where it wrote
        filled.extend(a.__array_interface__["data"][0] for a in into)
        return real_into(self, m, items, into)

    def read_shard(self, m, name, entry, **kw):
        one_by_one.append(name)
        return real_one(self, m, name, entry, **kw)

    monkeypatch.setattr(ObjectTier, "read_shards_into", read_shards_into)
    monkeypatch.setattr(ObjectTier, "read_shard", read_shard)
    target = zeros_like(state(3))
    tensors = list(target["model"].values())
    assert same(load(cfg, target, step=3, prefer="object"), state(3))
    assert sorted(filled) == sorted(t.data_ptr() for t in tensors)  # into the state's own tensors
    assert one_by_one and all(n.startswith(object_name("")) for n in one_by_one)  # only the bytes items, one by one


def test_a_damaged_object_copy_fails_naming_the_shard_or_is_read_from_the_intact_local_copy(tmp_path):
    cfg = config(str(tmp_path))
    save(cfg, state(3), 3)
    store = open_store(cfg)
    store.promote(3)
    tier, m, items = _stored(cfg, 3)
    name, entry = next((n, e) for n, e in items if n.endswith("w"))
    piece = entry.location[0]
    path = os.path.join(str(tmp_path), "object", "gpt", piece.path)
    begin = tier.header(piece.path).data_start + tier.header(piece.path).tensors[piece.key].begin
    raw = bytearray(open(path, "rb").read())
    raw[begin + 3] ^= 0x01
    with open(path, "wb") as f:
        f.write(bytes(raw))
    with pytest.raises(CheckpointException, match=f"{name} shard"):
        load(cfg, zeros_like(state(3)), step=3, prefer="object")
    # the Reader falls back to an intact copy when the object copy is the one read first
    from flowcheck.tiers.fallback import FallbackTier

    fb = FallbackTier(tier, m, lambda: [store.local])
    into = _buffers(m, [(name, entry)])
    with pytest.raises(IntegrityError):
        fb.read_shards_into(m, [(name, entry)], into)
    got = fb.read_shard(m, name, entry)
    assert torch.equal(torch.from_numpy(np.ascontiguousarray(got)).reshape(-1), state(3)["model"]["w"].reshape(-1))
