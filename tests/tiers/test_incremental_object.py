"""Incremental steps in the object tier: a promotion uploads only the shards the parent's object copy does not
hold (manifest v4 references), every promoted step reads back bit-exact, deleting or GC of a referenced holder
keeps the referencing steps readable, and audit names both steps when a referenced file is damaged."""
from __future__ import annotations

import os

import pytest

from flowcheck.audit import audit
from flowcheck.errors import IntegrityError
from flowcheck.manifest import FORMAT_VERSION, INCREMENTAL_VERSION
from flowcheck.state import Shard
from tests.test_branches_store import make_store
from tests.tiers.test_incremental import ADAPTERS, CHANGED_BYTES, FROZEN, FROZEN_BYTES, assert_reads_back, lora_state

HEADER = 8 << 10  # a safetensors file's JSON header for a step's changed shards


def promote_steps(store, steps, seed=0):
    out = {}
    for step in steps:
        snap = lora_state(step, seed=seed)
        store.push(snap)
        store.snapshot()
        store.promote(step)
        out[step] = snap
    return out


def step_bytes(obj, step: int) -> int:
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _d, fs in os.walk(f"{obj.root}/step-{step:09d}") for f in fs
               if f != "manifest.json")


def test_promoted_lora_history_uploads_only_changed_shards_and_reads_back_bit_exact(tmp_path):
    store = make_store(str(tmp_path), object_keep=100)
    snaps = promote_steps(store, range(1, 7))
    obj = store.object
    first = obj.manifest(1)
    assert first.format_version == FORMAT_VERSION and first.nbytes > FROZEN_BYTES
    for step in range(2, 7):
        m = obj.manifest(step)
        assert m.format_version == INCREMENTAL_VERSION
        assert [(r.branch, r.step) for r in m.refs] == [("main", 1)]  # references never chain
        assert m.digest() == store.tier("local").manifest(step).digest()
        assert m.nbytes <= CHANGED_BYTES + HEADER and step_bytes(obj, step) == m.nbytes
        assert m.referenced_nbytes >= FROZEN_BYTES
        assert obj.verify(step) == []
    fresh = store.tier("object").at_branch("main")  # a new reader: nothing cached
    for step, snap in snaps.items():
        assert_reads_back(fresh, snap)
        shard = Shard(ADAPTERS[0], (0, 0), (8, 16))
        assert fresh.read(step, ADAPTERS[0], (slice(2, 5), slice(1, 9))).tobytes() == \
            snap.array(shard)[2:5, 1:9].tobytes()
    assert audit(store).ok


def test_a_parent_missing_from_the_object_tier_is_uploaded_in_full(tmp_path):
    store = make_store(str(tmp_path), object_keep=100)
    for step in range(1, 5):
        store.push(lora_state(step))
        store.snapshot()
    store.promote(1)
    store.promote(3)  # its parent (2) has no object copy: the whole step goes up
    store.promote(4)
    obj = store.object
    assert obj.manifest(3).format_version == FORMAT_VERSION and obj.manifest(3).nbytes > FROZEN_BYTES
    assert [r.step for r in obj.manifest(4).refs] == [3]
    for step in (1, 3, 4):
        assert_reads_back(obj, lora_state(step))


def test_gc_of_a_referenced_holder_keeps_referencing_steps_readable_and_audit_clean(tmp_path):
    store = make_store(str(tmp_path), object_keep=2)
    snaps = promote_steps(store, range(1, 6))
    obj = store.object
    report = store.gc(tiers=["object"])
    assert sorted(k.step for k in report.deleted["object"]) == [1, 2, 3]
    assert obj.steps() == [4, 5]
    # step 1 left the listings; its referenced file stays in place, the unreferenced steps are gone
    assert os.path.isdir(f"{obj.root}/step-000000001")
    assert not os.path.exists(f"{obj.root}/step-000000001/manifest.json")
    assert not os.path.exists(f"{obj.root}/step-000000002")
    assert obj.clean_incomplete(0.0) == [] and obj.incomplete() == []
    for step in (4, 5):
        assert_reads_back(store.tier("object").at_branch("main"), snaps[step])
    rep = audit(store)
    assert rep.ok, [str(p) for p in rep.problems]
    # once nothing references it, GC's cleanup removes it
    obj.delete(4)
    obj.delete(5)
    assert os.path.isdir(f"{obj.root}/step-000000001")
    obj.clean_incomplete(0.0)
    assert not os.path.exists(f"{obj.root}/step-000000001")


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_audit_names_both_steps_when_a_referenced_object_file_is_damaged(tmp_path, damage):
    store = make_store(str(tmp_path), object_keep=2)
    promote_steps(store, range(1, 5))
    store.gc(tiers=["object"])  # 1 (the holder), 2 deleted; 3 and 4 reference step 1's file
    obj = store.object
    path = next(os.path.join(dp, f) for dp, _d, fs in os.walk(f"{obj.root}/step-000000001") for f in fs)
    if damage == "delete":
        os.unlink(path)
    else:
        with open(path, "r+b") as f:  # a byte of frozen data, past the header
            f.seek(os.path.getsize(path) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    for report in (audit(store), audit(store, data=False)):
        bad = [p for p in report.problems if p.severity == "error" and p.tier.startswith("object")]
        assert {p.step for p in bad} == {3, 4}, [str(p) for p in report.problems]
        assert all("referenced step 1" in p.what for p in bad), [str(p) for p in bad]
    if damage == "flip":
        with pytest.raises(IntegrityError, match="step 1"):
            fresh = store.tier("object").at_branch("main")
            for name in FROZEN:
                fresh.read(4, name)


def test_s3_promoted_history_round_trips_and_survives_gc(tmp_path, object_bucket):
    store = make_store(str(tmp_path), object_url=object_bucket, object_keep=2)
    snaps = promote_steps(store, range(1, 5))
    obj = store.object
    for step in (2, 3, 4):
        m = obj.manifest(step)
        assert m.format_version == INCREMENTAL_VERSION and [r.step for r in m.refs] == [1]
        assert m.nbytes <= CHANGED_BYTES + HEADER
    store.gc(tiers=["object"])
    assert obj.steps() == [3, 4]
    for step in (3, 4):
        assert_reads_back(store.tier("object").at_branch("main"), snaps[step])
    rep = audit(store)
    assert rep.ok, [str(p) for p in rep.problems]
