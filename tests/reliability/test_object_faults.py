"""The object tier through a faulty S3: 500s, 503 SlowDown, resets, stalls and truncated bodies.

Every test puts tests/reliability/proxy.py between flowcheck and the moto server.  Figures
(faults injected by kind and by S3 operation, operations that met a fault and still succeeded)
are printed at the end of the module (``pytest -s``) and written to $FLOWCHECK_FAULT_REPORT
when it is set.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time

import numpy as np
import pytest

from flowcheck.config import Config, LocalConfig, ObjectConfig, PolicyConfig, TierPolicy, TiersConfig
from flowcheck.errors import FlowcheckError, TierError
from flowcheck.state import Shard, TensorSpec
from flowcheck.store import Store
from tests.helpers import make_custom_snapshot
from tests.reliability.proxy import KINDS, FaultProxy, Faults

pytestmark = pytest.mark.s3

FIGURES: dict = {"faults": {}, "requests": 0, "faults_by_operation": {}, "operations": 0, "operations_hit": 0}
SPECS = [TensorSpec("w", "float32", (3072, 1024)), TensorSpec("v", "float32", (256, 1024)),
         TensorSpec("n", "int64", (1000,))]


def big_snapshot(step: int):
    """~13 MiB: two files of 6 MiB (max_file_mib=6), each uploaded as two multipart parts, and a small one."""
    rng = np.random.default_rng(step)
    # small shards first: the local tier stores (and promotion reads) shards in snapshot order, so the small
    # file is uploaded first and is in the bucket when the large file's multipart upload fails
    arrays = {
        Shard("n", (0,), (1000,)): rng.integers(-(1 << 60), 1 << 60, 1000, dtype=np.int64),
        Shard("v", (0, 0), (256, 1024)): rng.standard_normal((256, 1024), dtype=np.float32),
        Shard("w", (0, 0), (3072, 1024)): rng.standard_normal((3072, 1024), dtype=np.float32),
    }
    return make_custom_snapshot(SPECS, arrays, step=step)


def object_config(url: str, proxy: FaultProxy, **kw) -> ObjectConfig:
    settings = dict(url=url, endpoint_url=proxy.url, max_file_mib=6, part_mib=5, upload_workers=2, retries=8,
                    retry_deadline_s=60.0, request_attempts=3, connect_timeout_s=2.0, read_timeout_s=1.0)
    return ObjectConfig(**{**settings, **kw})


def make_store(tmp_path, obj: ObjectConfig, policy: PolicyConfig | None = None) -> Store:
    return Store(Config(run="r1", node="n1", policy=policy or PolicyConfig(),
                        tiers=TiersConfig(local=LocalConfig(root=str(tmp_path / "local")), object=obj)))


def assert_bit_exact(store_tier, snap) -> None:
    loaded = store_tier.load(snap.step)
    for shard in snap.data:
        want = snap.array(shard)
        got = loaded.array(shard)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes(), shard


def survived(proxy: FaultProxy, what, *args):
    """Run one operation; count it (and whether faults struck while it ran) in the figures."""
    before = proxy.totals()["faults_total"]
    out = what(*args)
    FIGURES["operations"] += 1
    FIGURES["operations_hit"] += proxy.totals()["faults_total"] > before
    return out


def record(proxy: FaultProxy) -> dict:
    t = proxy.totals()
    FIGURES["requests"] += t["requests"]
    for k, n in t["faults"].items():
        FIGURES["faults"][k] = FIGURES["faults"].get(k, 0) + n
    for k, n in t["faults_by_operation"].items():
        FIGURES["faults_by_operation"][k] = FIGURES["faults_by_operation"].get(k, 0) + n
    return t


@pytest.fixture(scope="module", autouse=True)
def report_figures():
    yield
    FIGURES["faults_total"] = sum(FIGURES["faults"].values())
    text = json.dumps(FIGURES, indent=1, sort_keys=True)
    print(f"\nobject-store faults: injected / survived\n{text}")
    if os.environ.get("FLOWCHECK_FAULT_REPORT"):
        with open(os.environ["FLOWCHECK_FAULT_REPORT"], "w") as f:
            f.write(text)


@pytest.fixture
def proxy(moto_server):
    with FaultProxy(moto_server, seed=20260) as p:
        yield p
        record(p)


@pytest.fixture
def s3(s3_env):
    import boto3

    return boto3.client("s3", endpoint_url=s3_env, region_name="us-east-1")  # straight to moto: the ground truth


def test_promotions_survive_mixed_faults_and_read_back_bit_exact(s3_bucket, proxy, tmp_path):
    from flowcheck.audit import audit

    fast = dict(read_timeout_s=0.5)  # a stalled request costs half a second
    store = make_store(tmp_path, object_config(s3_bucket, proxy, **fast))
    snaps = [big_snapshot(step) for step in (10, 20, 30)]
    for snap in snaps:
        store.write(snap, "local")
    mixed = Faults.mixed(0.2, stall_s=2.0)  # 20% of requests fail: 4% of each kind
    proxy.set_faults(mixed)
    for snap in snaps[:2]:
        m = survived(proxy, store.promote, snap.step)
        assert m.step == snap.step and len(m.files) == 3
    proxy.set_faults(Faults.mixed(0.5, stall_s=2.0, path=r"uploads|uploadId="))  # half of all multipart requests
    assert survived(proxy, store.promote, 30).step == 30
    multipart = {k: n for k, n in proxy.totals()["faults_by_operation"].items() if "Multipart" in k or "UploadPart" in k}
    assert sum(multipart.values()) >= 5, multipart
    proxy.set_faults(mixed)

    reader = make_store(tmp_path / "reader", object_config(s3_bucket, proxy, **fast)).object  # a fresh client, no caches
    assert survived(proxy, reader.steps) == [10, 20, 30]
    for snap in snaps:
        survived(proxy, assert_bit_exact, reader, snap)
        region = survived(proxy, reader.read, snap.step, "w", (slice(1500, 1600), slice(3, 900)))
        assert region.tobytes() == snap.array(Shard("w", (0, 0), (3072, 1024)))[1500:1600, 3:900].tobytes()
    report = survived(proxy, audit, store)
    assert report.ok, [str(p) for p in report.problems]

    t = proxy.totals()
    assert all(t["faults"].get(kind, 0) > 0 for kind in KINDS), t["faults"]
    assert t["by_operation"]["UploadPart"] >= 12 and t["by_operation"]["CompleteMultipartUpload"] >= 6


def test_a_lost_answer_to_the_manifest_create_is_not_a_false_conflict(s3_bucket, proxy, tmp_path, s3):
    store = make_store(tmp_path, object_config(s3_bucket, proxy))
    snap = big_snapshot(40)
    local = store.write(snap, "local")
    # the first create lands at S3, its answer is lost; botocore's retry is refused (412 exists)
    proxy.set_faults(Faults(reset=1.0, after_apply=1.0, max_faults=1, methods=frozenset({"PUT"}), path=r"manifest\.json$"))
    m = survived(proxy, store.promote, 40)
    t = proxy.totals()
    assert t["faults_by_operation"] == {"PutObject(If-None-Match) reset": 1} and t["applied_then_failed"] == 1
    assert t["by_operation"]["PutObject(If-None-Match)"] >= 2  # the retried create was answered "exists"
    assert m.digest() == local.digest() and store.object.steps() == [40]
    bucket, _, prefix = s3_bucket[len("s3://"):].partition("/")
    body = s3.get_object(Bucket=bucket, Key=f"{prefix}/r1/step-000000040/manifest.json")["Body"].read()
    assert body == m.to_bytes()  # committed once, by us


def _multipart_uploads(s3, s3_bucket: str) -> list[str]:
    bucket, _, prefix = s3_bucket[len("s3://"):].partition("/")
    return [u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])]


def _objects(s3, s3_bucket: str, under: str) -> list[str]:
    bucket, _, prefix = s3_bucket[len("s3://"):].partition("/")
    return [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{under}").get("Contents", [])]


def test_an_outage_fails_the_promotion_in_bounded_time_then_gc_cleans_and_healed_promotion_succeeds(
        s3_bucket, proxy, tmp_path, s3):
    deadline = 3.0
    store = make_store(tmp_path, object_config(s3_bucket, proxy, retries=50, retry_deadline_s=deadline))
    snap = big_snapshot(50)
    store.write(snap, "local")

    # every request fails, in every way
    proxy.set_faults(Faults.mixed(1.0, stall_s=3.0))
    start = time.monotonic()
    with pytest.raises(TierError) as info:
        store.promote(50)
    elapsed = time.monotonic() - start
    # no new attempt after the deadline; the last one is bounded by request_attempts x read_timeout + backoff
    assert elapsed < deadline + 3 * 1.0 + 3 + 5, elapsed
    msg = str(info.value)
    assert isinstance(info.value, FlowcheckError) and ("step 50 was not committed" in msg or "step 50 was not promoted" in msg)
    assert "gave up after" in msg and "last error:" in msg

    # parts and their abort fail, everything else works: multipart uploads are left behind
    proxy.set_faults(Faults(slowdown_503=1.0, path=r"uploadId="))
    with pytest.raises(TierError) as info:
        store.promote(50)
    msg = str(info.value)
    assert "step 50 was not committed" in msg and re.search(r"uploading step-000000050/attempt-[0-9a-f]{12}/shard-", msg)
    assert "SlowDown" in msg or "reduce your request rate" in msg
    proxy.heal()
    assert store.object.steps() == [] and store.object.latest() is None  # nothing visible
    stale = _multipart_uploads(s3, s3_bucket)
    assert stale and all(re.search(r"/r1/step-000000050/attempt-[0-9a-f]{12}/shard-", k) for k in stale)
    assert store.object.incomplete() == ["step-000000050"]  # small files got in; no manifest names them

    removed = store.object.clean_incomplete(older_than_s=0)
    assert sum(r.startswith("multipart:") for r in removed) == len(stale)
    assert _multipart_uploads(s3, s3_bucket) == [] and _objects(s3, s3_bucket, "r1/step-000000050/") == []

    m = survived(proxy, store.promote, 50)
    assert store.object.steps() == [50] and m.step == 50
    assert_bit_exact(store.object, snap)


def test_a_stalled_object_store_never_blocks_training_or_the_local_tier(s3_bucket, proxy, tmp_path):
    from flowcheck.policy import PolicyRunner
    from tests.helpers import make_snapshot

    policy = PolicyConfig(local=TierPolicy(every_steps=1, keep_last=3), object=TierPolicy(every_steps=1, keep_last=1))
    store = make_store(tmp_path, object_config(s3_bucket, proxy, retries=1000, retry_deadline_s=600.0), policy)
    proxy.set_faults(Faults.everything("stall", stall_s=60.0))  # S3 answers nothing until healed
    runner = PolicyRunner(store, policy)
    try:
        store.push(make_snapshot(step=1))
        runner.trigger("local").result(timeout=60)
        upload = runner.trigger("object")  # hangs on its first request
        for step in range(2, 9):
            store.push(make_snapshot(step=step))  # the trainer's push returns while the upload hangs
            runner.on_step(step)
            local = runner._busy["local"]
            if local is not None:
                local.result(timeout=60)
            assert store.local.latest() == step and not upload.done()
        # every local snapshot committed (and local GC ran) while the first upload was stuck
        assert runner.stats.local_snapshots == list(range(1, 9)) and not upload.done()
        assert store.local.steps() == [6, 7, 8] and runner.stats.promotions == []
        assert runner.stats.coalesced >= 7  # object triggers folded into the stuck job, not queued behind it
        assert threading.active_count() < 100
        proxy.heal()
        upload.result(timeout=120)
        runner.flush()
        assert store.object.latest() == 8  # after healing, the newest step is uploaded
    finally:
        proxy.heal()
        runner.stop()
    assert_bit_exact(store.object, make_snapshot(step=8))


def test_with_retries_0_a_file_whose_upload_failed_is_not_uploaded_again(s3_bucket, proxy, tmp_path):
    store = make_store(tmp_path, object_config(s3_bucket, proxy, retries=0, request_attempts=1))
    store.write(big_snapshot(60), "local")
    proxy.set_faults(Faults(slowdown_503=1.0, path=r"partNumber="))  # every part upload fails
    with pytest.raises(TierError) as info:
        store.promote(60)
    msg = str(info.value)
    assert "step 60 was not committed" in msg and re.search(r"uploading step-000000060/attempt-[0-9a-f]{12}/shard-", msg)
    t = proxy.totals()
    assert t["by_operation"]["CreateMultipartUpload"] <= 2, t["by_operation"]  # each large file once at most
    assert store.object.steps() == []


@pytest.mark.parametrize("field, value", [("retries", -1), ("retries", 1.5), ("request_attempts", 0),
                                          ("retry_deadline_s", 0), ("connect_timeout_s", -1), ("read_timeout_s", "1"),
                                          ("reconnect_s", -1), ("reconnect_s", True)])
def test_retry_and_timeout_settings_are_validated(field, value):
    from flowcheck.config import from_dict
    from flowcheck.errors import ConfigError

    with pytest.raises(ConfigError, match=field):
        from_dict({"tiers": {"object": {field: value}}}, "x.yaml")
    assert ObjectConfig(url="s3://b/p", retries=0).retries == 0  # 0: fail on the first error
