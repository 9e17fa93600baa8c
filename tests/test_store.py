"""The store: snapshot RAM -> local, promote -> object, find the fastest tier, GC safely."""
from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pytest

from flowcheck.branches import Located

from flowcheck.config import Config, LocalConfig, ObjectConfig, PolicyConfig, TierPolicy, TiersConfig
from flowcheck.errors import StepNotFoundError
from flowcheck.state import Scalars
from flowcheck.store import Store
from flowcheck.tiers.base import step_dir
from tests.helpers import W, global_array, make_snapshot


def make_store(tmp_path, object_url=None, local_keep=2, object_keep=1) -> Store:
    cfg = Config(
        run="r1",
        tiers=TiersConfig(
            local=LocalConfig(root=str(tmp_path / "local")),
            object=ObjectConfig(url=object_url or f"file://{tmp_path / 'object'}", max_file_mib=1),
        ),
        policy=PolicyConfig(local=TierPolicy(keep_last=local_keep, tmp_grace_seconds=60),
                            object=TierPolicy(keep_last=object_keep, tmp_grace_seconds=60)),
    )
    return Store(cfg)


def advance(store: Store, step: int) -> None:
    with store.memory.update(step, Scalars(optimizer_step=step)) as u:
        for shard in u.shards():
            arr = u.array(shard)
            if arr.dtype == np.float32:
                arr += 1.0


def test_snapshot_chains_parents_and_promotion_keeps_digest(tmp_path):
    store = make_store(tmp_path)
    store.push(make_snapshot(step=10))
    m10 = store.snapshot()
    advance(store, 11)
    m11 = store.snapshot()
    assert m10.parent is None and m11.parent == m10.parent_ref()
    promoted = store.promote()
    assert promoted.step == 11 and promoted.digest() == m11.digest()
    assert store.find(11).name == "memory"
    assert store.find(10).name == "local"
    np.testing.assert_array_equal(store.read(11, W, prefer="object"), store.read(11, W, prefer="local"))


def test_unknown_step_is_a_clear_error(tmp_path):
    store = make_store(tmp_path)
    with pytest.raises(StepNotFoundError, match="step 99"):
        store.find(99)
    with pytest.raises(StepNotFoundError):
        store.promote()


def test_gc_never_deletes_newest_committed_step_and_leaves_pruning_records(tmp_path):
    store = make_store(tmp_path, local_keep=1)
    store.push(make_snapshot(step=1))
    for step in range(1, 5):
        if step > 1:
            advance(store, step)
        store.snapshot()
    report = store.gc()
    assert report.deleted["local"] == [Located(1), Located(2), Located(3)] and store.local.steps() == [4]
    assert set(store.local.pruned()) == {1, 2, 3}
    assert store.gc().deleted["local"] == []  # idempotent; 4 is the newest


def test_gc_keeps_what_it_cannot_classify(tmp_path):
    store = make_store(tmp_path, local_keep=1)
    for step in (1, 2, 3):
        store.local.write(make_snapshot(step=step))
    manifest = os.path.join(store.local.root, "step-000000001", "manifest.json")
    with open(manifest, "r+b") as f:
        f.write(b"garbage")
    report = store.gc()
    assert Located(1) in report.kept["local"] and report.deleted["local"] == [Located(2)]
    assert store.local.steps() == [1, 3]


def test_gc_cleans_only_stale_tmp_dirs(tmp_path):
    store = make_store(tmp_path)
    store.local.write(make_snapshot(step=1))
    old = os.path.join(store.local.root, "step-000000002.dead.tmp")
    new = os.path.join(store.local.root, "step-000000003.busy.tmp")
    for d in (old, new):
        os.makedirs(d)
    past = time.time() - 3600
    os.utime(old, (past, past))
    assert store.gc(dry_run=True).cleaned["local"] == [old] and os.path.isdir(old)
    store.gc()
    assert not os.path.exists(old) and os.path.isdir(new)


def test_failed_write_leaves_nothing_visible_and_latest_unmoved(tmp_path):
    store = make_store(tmp_path)
    store.local.write(make_snapshot(step=1))
    good = make_snapshot(step=2)
    shards = list(good.data)

    def boom():
        raise OSError(28, "No space left on device")

    data = dict(good.data)
    data[shards[-1]] = boom
    bad = type(good)(good.run, 2, good.layout, data, good.scalars)
    with pytest.raises(OSError):
        store.local.write(bad)
    assert store.local.steps() == [1] and store.local.incomplete() == []
    assert store.local.latest_record() == 1
    np.testing.assert_array_equal(store.local.read(1, W), global_array(make_snapshot(step=1), W))


@pytest.mark.s3
def test_gc_aborts_stale_multipart_uploads_and_uncommitted_prefixes(tmp_path, object_bucket, object_server):
    import boto3

    store = make_store(tmp_path, object_url=object_bucket)
    store.local.write(make_snapshot(step=1))
    store.promote(1)
    bucket, prefix = object_bucket[len("s3://"):].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=object_server, region_name="us-east-1")
    key = f"{prefix}/r1/step-000000002/shard-00000-of-00001.safetensors"
    s3.create_multipart_upload(Bucket=bucket, Key=key)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/r1/step-000000003/shard-00000-of-00001.safetensors", Body=b"x")
    assert store.object.incomplete() == ["step-000000003"]
    fresh = store.gc(dry_run=True).cleaned["object"]
    # the prefix is younger than the grace period (could be an upload in flight); moto reports every
    # multipart upload as initiated in 2010, so that one already counts as stale
    assert not any("step-000000003" in c for c in fresh)
    cleaned = store.object.clean_incomplete(older_than_s=-1)
    assert any(c.startswith("multipart:") for c in cleaned) and any("step-000000003" in c for c in cleaned)
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert store.object.steps() == [1] and store.object.verify(1) == []


def test_a_step_missing_from_the_run_names_the_other_run_that_holds_it(tmp_path):
    store = make_store(tmp_path)
    store.local.write(make_snapshot(step=1))
    other = Store(dataclasses.replace(store.config, run="r2"))
    other.local.write(make_snapshot(run="r2", step=7))
    assert store.runs() == ["r1", "r2"]
    with pytest.raises(StepNotFoundError, match=r"step 7 is not committed on branch 'main' of run 'r1'.*r2.*--run r2"):
        store.locate(7)


def test_a_run_that_never_branched_is_located_without_reading_every_manifest_and_as_the_history_would(tmp_path):
    store = make_store(tmp_path, local_keep=5)
    store.push(make_snapshot(step=10))
    store.snapshot()
    for step in (11, 12):
        advance(store, step)
        store.snapshot()
    reader = Store(store.config)  # a fresh process's store: RAM holds nothing
    assert reader.history().resolve("latest") == Located(12) and reader.history().resolve(11) == Located(11)
    reader = Store(store.config)
    seen = []
    reader.local.manifest = lambda step, **kw: seen.append(step) or type(reader.local).manifest(reader.local, step, **kw)
    assert reader.locate(11) == (reader.local, 11) and seen == []  # a number: the listing says it all
    assert reader.locate("latest") == (reader.local, 12) and seen == [12]  # only the newest is read, to vouch for it
    # the newest manifest damaged: the history decides, as without the shortcut (the newest readable one)
    path = os.path.join(store.local.root, step_dir(12), "manifest.json")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 20)
    reader = Store(store.config)
    assert reader.locate("latest") == (reader.local, 11)


def test_reading_a_name_or_region_a_step_lacks_is_a_flowcheck_error_in_every_tier(tmp_path):
    """The memory tier too: a name not in the step held in RAM is TensorNotFoundError (not a bare KeyError), and a
    region with more dimensions than the tensor a RegionError (not a bare IndexError)."""
    from flowcheck.errors import RegionError, TensorNotFoundError

    store = make_store(tmp_path)
    snap = make_snapshot(run="r1", step=4)
    store.push(snap)
    store.snapshot()  # held in RAM and in the local tier
    name = next(t.name for t in snap.layout.tensors if len(t.shape) == 2)
    for prefer in ("memory", "local"):
        with pytest.raises(TensorNotFoundError, match="step 4 has no tensor 'no.such.tensor'"):
            store.read(4, "no.such.tensor", prefer=prefer)
        with pytest.raises(RegionError, match="expected a region of at most 2 dimensions"):
            store.read(4, name, (slice(0, 1), slice(0, 1), slice(0, 1)), prefer=prefer)


def test_a_replay_to_the_same_state_after_a_rollback_says_why_no_branch_forms(tmp_path, caplog):
    import logging

    store = make_store(tmp_path)
    for n in (1, 2, 3):
        store.write(make_snapshot(step=n, seed=n))
    with caplog.at_level(logging.INFO, logger="flowcheck.store"):
        again = store.write(make_snapshot(step=2, seed=2), parent=store.local.manifest(1).parent_ref())
    assert again.digest() == store.local.manifest(2).digest() and store.local.branch_names() == []
    assert "step 2 is the same state as before the rollback (step 3 on main was committed after it): kept once, " \
           "no branch forms" in caplog.text, caplog.text


def test_listing_rows_are_typed_and_print_as_ls_prints_them(tmp_path):
    from flowcheck.listing import StepRow

    store = make_store(tmp_path)
    store.write(make_snapshot(step=5))
    listed = store.listing()
    assert [(r.tier, r.step, r.status) for r in listed.rows] == [("local", 5, "committed")]
    assert isinstance(listed.rows[0], StepRow) and listed.rows[0].current and listed.rows[0].bytes > 0
    assert set(listed.rows[0].to_json()) == {"tier", "branch", "current", "step", "bytes", "created_at", "source",
                                             "status", "digest"}
    assert listed.lines()[0].startswith(f"run {store.config.run}   current branch main")
    assert "committed" in listed.lines()[2] and listed.lines()[2].startswith("local")
