"""Deleting a state on purpose (Store.delete) and finding what was deleted (Store.pruned, StepPrunedError)."""
from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone

import pytest

from flowcheck.audit import audit
from flowcheck.branches import Located
from flowcheck.errors import FlowcheckError, StepNotFoundError, StepPrunedError
from flowcheck.store import Store
from tests.helpers import make_snapshot
from tests.test_store import advance, make_store


def chain(store: Store, steps=(1, 2, 3), promote=()) -> dict:
    """Commit a lineage of RAM snapshots to the local tier (promoting some); step -> manifest."""
    out = {}
    store.push(make_snapshot(step=steps[0]))
    for i, step in enumerate(steps):
        if i:
            advance(store, step)
        out[step] = store.snapshot()
        if step in promote:
            store.promote(step)
    return out


def test_delete_leaves_a_pruning_record_and_audit_reads_a_deliberate_gap(tmp_path):
    store = make_store(tmp_path, local_keep=10, object_keep=10)
    ms = chain(store, promote=(2,))
    report = store.delete(2)
    assert report.state == Located(2) and report.tiers == ("local", "object") and not report.was_head
    assert report.manifest_digest == ms[2].digest()
    assert store.local.steps() == [1, 3] and store.object.steps() == []
    assert store.local.pruned() == {2: ms[2].digest()} and store.object.pruned() == {2: ms[2].digest()}
    rec = store.pruned(2)
    assert rec.by == "delete" and rec.manifest_digest == ms[2].digest()
    assert datetime.now(timezone.utc) - rec.pruned_at < timedelta(minutes=5)
    result = audit(store)
    assert result.ok, [str(p) for p in result.problems]  # step 3's parent is gone on purpose


def test_delete_from_one_tier_keeps_the_other_copy(tmp_path):
    store = make_store(tmp_path, local_keep=10, object_keep=10)
    chain(store, promote=(2,))
    assert store.delete(2, tier="local").tiers == ("local",)
    assert store.local.steps() == [1, 3] and store.object.steps() == [2]
    assert store.pruned(2) is None  # still stored: nothing to explain
    assert store.find(2).name == "object"
    with pytest.raises(StepNotFoundError, match=r"not committed in local \(held by: object\).*deleted on request at"):
        store.find(2, prefer="local")
    with pytest.raises(StepNotFoundError, match="not committed in the object tier"):
        store.delete(1, tier="object")


def test_delete_refuses_the_head_of_the_current_branch_without_force(tmp_path):
    store = make_store(tmp_path, local_keep=10)
    chain(store)
    with pytest.raises(FlowcheckError, match=r"step 3 of run 'r1' is the newest committed state.*--force"):
        store.delete("latest")
    assert store.local.steps() == [1, 2, 3] and store.local.pruned() == {}


def test_force_deletes_the_head_and_audit_stays_clean(tmp_path):
    store = make_store(tmp_path, local_keep=10)
    ms = chain(store)
    report = store.delete(3, force=True)
    assert report.was_head and store.local.steps() == [1, 2]
    assert store.local.latest_record() == 3  # 'latest' named it: the pruning record explains it to audit
    result = audit(store)
    assert result.ok, [str(p) for p in result.problems]
    assert store.history().resolve("latest") == Located(2)
    assert store.pruned(f"sha256:{ms[3].digest().split(':')[1][:12]}").step == 3


def test_a_step_pruned_by_gc_says_when_instead_of_not_found(tmp_path):
    store = make_store(tmp_path, local_keep=1)
    ms = chain(store)
    store.gc()
    rec = store.pruned(1)
    assert rec is not None and rec.by == "gc" and rec.tier == "local" and rec.manifest_digest == ms[1].digest()
    with pytest.raises(StepPrunedError, match=r"step 1 of run 'r1' was pruned by GC at 20\d\d-.*Z \(from the local tier") as err:
        store.find(1)
    assert err.value.record == rec
    with pytest.raises(StepPrunedError, match="pruned by GC at"):
        store.locate(f"sha256:{ms[2].digest().split(':')[1][:12]}")
    with pytest.raises(StepNotFoundError) as other:
        store.find(99)
    assert not isinstance(other.value, StepPrunedError)


def test_a_pruning_record_from_before_pruned_at_still_reads(tmp_path):
    store = make_store(tmp_path, local_keep=10)
    store.local.write(make_snapshot(step=5))
    folder = os.path.join(store.local.root, "pruned")
    os.makedirs(folder)
    with open(os.path.join(folder, "step-000000004.json"), "w") as f:  # the format GC wrote until now
        json.dump({"step": 4, "manifest_digest": "sha256:" + "ab" * 32, "branch": "main", "parent": None}, f)
    rec = store.pruned(4)
    assert rec.step == 4 and rec.pruned_at is None and rec.by == "gc"
    assert rec.describe() == "pruned by GC at an unrecorded time"
    assert store.local.pruned() == {4: "sha256:" + "ab" * 32}
    with pytest.raises(StepPrunedError, match="pruned by GC at an unrecorded time"):
        store.find(4)
