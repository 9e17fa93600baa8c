"""A restore from the object tier reads stored tensors straight into the torch_dist writer's memory (restore/direct.py)."""
from __future__ import annotations

import os

import pytest

from flowcheck.errors import IntegrityError
from flowcheck.restore.importer import import_into
from flowcheck.restore.megatron_common import Target
from flowcheck.restore.service import restore
from flowcheck.tiers.object import ObjectTier

from tests.helpers import read_raw, write_raw
from .conftest import make_store, same_or_padded


def _spy(monkeypatch) -> dict:
    """Count what the object tier reads into place and what it reads shard by shard (the real reads run)."""
    seen = {"into": 0, "shard": 0}
    into, shard = ObjectTier.read_shards_into, ObjectTier.read_shard

    def read_shards_into(self, manifest, items, dests):
        seen["into"] += len(items)
        return into(self, manifest, items, dests)

    def read_shard(self, *a, **kw):
        seen["shard"] += 1
        return shard(self, *a, **kw)

    monkeypatch.setattr(ObjectTier, "read_shards_into", read_shards_into)
    monkeypatch.setattr(ObjectTier, "read_shard", read_shard)
    return seen


@pytest.mark.parametrize("tp", [1, 2])  # 2: the vocabulary gets padding rows after the stored ones
def test_a_torch_dist_restore_from_the_object_tier_reads_into_place_and_matches_the_local_restore(
        tmp_path, gqa_store, monkeypatch, tp):
    store, state, _ = gqa_store
    store.promote(10)
    local = restore(store, 10, Target(tp, 1, 1, "megatron-dist"), str(tmp_path / "out-local"), prefer="local")
    seen = _spy(monkeypatch)
    obj = restore(store, 10, Target(tp, 1, 1, "megatron-dist"), str(tmp_path / "out-object"), prefer="object")
    assert obj.tier == "object" and seen["into"] > 0 and seen["shard"] == 0
    back = {}
    for name, rep in (("local", local), ("object", obj)):
        back[name] = make_store(tmp_path, f"back-{name}")
        import_into(back[name], rep.out, 10)
    for n in state:
        a, b = back["local"].read(10, n), back["object"].read(10, n)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), n
        assert same_or_padded(b, state[n].numpy()), n


def test_a_damaged_object_copy_is_read_again_tensor_by_tensor_and_named(tmp_path, gqa_store, monkeypatch):
    store, _, _ = gqa_store
    store.promote(10)
    tier = store.object
    m = tier.manifest(10)
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    piece = m.tensors[name].shards[0].location[0]
    info = tier.header(piece.path).tensors[piece.key]
    data = bytearray(read_raw(tier, piece.path))
    data[tier.header(piece.path).data_start + info.begin + 10] ^= 0x01
    write_raw(tier, piece.path, bytes(data))
    seen = _spy(monkeypatch)
    with pytest.raises(IntegrityError, match=name):
        restore(store, 10, Target(2, 1, 1, "megatron-dist"), str(tmp_path / "out"), prefer="object")
    assert seen["into"] > 0 and seen["shard"] > 0  # the batch holding it was read again shard by shard
    assert not os.path.exists(tmp_path / "out")


def test_a_missing_object_file_fails_the_restore_naming_it(tmp_path, gqa_store):
    store, _, _ = gqa_store
    store.promote(10)
    tier = store.object
    rel = tier.manifest(10).files[0].path
    os.remove(os.path.join(tier.root, rel))
    with pytest.raises(IntegrityError, match="missing"):
        restore(store, 10, Target(2, 1, 1, "megatron-dist"), str(tmp_path / "out"), prefer="object")
    assert not os.path.exists(tmp_path / "out")
