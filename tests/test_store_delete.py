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
from tests.conftest import OBJECT_SERVERS, bucket_on
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


@pytest.fixture(params=["file", *OBJECT_SERVERS])
def object_url(request) -> str | None:
    """The store's object tier: a ``file://`` folder (None), or a fresh bucket on each S3 server."""
    return None if request.param == "file" else bucket_on(request, request.param)


def test_delete_leaves_a_pruning_record_and_audit_reads_a_deliberate_gap(tmp_path, object_url):
    store = make_store(tmp_path, object_url, local_keep=10, object_keep=10)
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


def test_delete_from_one_tier_keeps_the_other_copy(tmp_path, object_url):
    store = make_store(tmp_path, object_url, local_keep=10, object_keep=10)
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


def test_a_symlinked_step_folder_is_deleted_as_a_link_and_what_it_points_at_stays(tmp_path):
    """A step folder that is a symlink (planted, or a copy linked in): deleting it removes the link only, and leaves
    no `…deleting.tmp` link behind for every GC to report cleaned and audit to warn about; one left by an older
    version is removed for real."""
    import shutil

    store = make_store(tmp_path, local_keep=5)
    for step in (1, 2):
        store.write(make_snapshot(step=step, seed=step), "local")
    outside = tmp_path / "elsewhere" / "step-000000003"
    shutil.copytree(os.path.join(store.local.root, "step-000000002"), outside)
    os.symlink(outside, os.path.join(store.local.root, "step-000000003"))
    os.symlink(outside, os.path.join(store.local.root, "step-000000004.0123abcd.deleting.tmp"))  # an old leftover
    os.utime(os.path.join(store.local.root, "step-000000004.0123abcd.deleting.tmp"), (0, 0), follow_symlinks=False)
    if 3 in store.local.steps():
        Store(store.config).delete(3, "local", force=True)
    first = Store(store.config).gc(tiers=["local"])
    again = Store(store.config).gc(tiers=["local"])
    assert not again.cleaned.get("local"), again.cleaned
    assert any("deleting.tmp" in p for p in first.cleaned.get("local", [])), first.cleaned
    assert sorted(os.listdir(outside)) and os.path.isfile(outside / "manifest.json")  # the target is untouched
    assert not [n for n in os.listdir(store.local.root) if n.endswith(".tmp")]
    assert not [p for p in audit(Store(store.config)).problems if "incomplete" in p.what]


def test_concurrent_deletes_and_gcs_of_one_store_never_raise_a_raw_os_error(tmp_path):
    """Two processes' worth of stores (each its own locks) deleting the same steps and collecting at once."""
    import threading

    store = make_store(tmp_path, local_keep=1)
    for step in range(1, 13):
        store.write(make_snapshot(step=step, seed=step), "local")
    errors, start = [], threading.Barrier(4)

    def worker(kind: str, steps: range) -> None:
        s = Store(store.config)
        start.wait(10)
        for step in steps:
            try:
                if kind == "delete":
                    s.delete(step, "local")
                else:
                    s.gc(tiers=["local"])
            except (StepNotFoundError, FlowcheckError):
                pass  # deleted by the other: said in words
            except Exception as e:  # noqa: BLE001 - the finding
                errors.append(f"{kind} {step}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(k, range(1, 12))) for k in ("delete", "delete", "gc", "gc")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert 12 in Store(store.config).local.steps()
    report = audit(Store(store.config))
    assert report.ok, [str(p) for p in report.problems]
