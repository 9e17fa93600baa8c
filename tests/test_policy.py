"""The policy runner: step triggers and APScheduler timers move state down the tiers without blocking."""
from __future__ import annotations

import time

from flowcheck.config import PolicyConfig, TierPolicy
from flowcheck.policy import PolicyRunner
from tests.helpers import make_snapshot
from tests.test_store import advance, make_store


def test_step_triggers_snapshot_and_timer_promotes(tmp_path):
    store = make_store(tmp_path, local_keep=2, object_keep=1)
    policy = PolicyConfig(local=TierPolicy(every_steps=5, keep_last=2), object=TierPolicy(every_seconds=0.2, keep_last=1))
    runner = PolicyRunner(store, policy).start()
    try:
        store.push(make_snapshot(step=0))
        for step in range(1, 21):
            advance(store, step)
            runner.on_step(step)
            runner.drain()
        deadline = time.time() + 10
        while (store.object.latest() or 0) < 20 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        runner.stop()
    assert runner.stats.errors == []
    assert runner.stats.local_snapshots == [5, 10, 15, 20]
    assert store.local.steps() == [15, 20]  # keep_last=2 applied after each commit
    assert store.object.steps() == [20] and store.object.manifest(20).digest() == store.local.manifest(20).digest()


def test_a_trigger_while_busy_is_coalesced_not_queued(tmp_path):
    store = make_store(tmp_path)
    store.push(make_snapshot(step=1))
    runner = PolicyRunner(store, PolicyConfig(local=TierPolicy(keep_last=3), object=TierPolicy(keep_last=1)))
    gate = store._locks["local"]
    gate.acquire()  # hold the local tier busy
    try:
        first = runner.trigger("local")
        assert first is not None
        assert runner.trigger("local") is None and runner.stats.coalesced == 1
    finally:
        gate.release()
    runner.drain()
    runner.stop()
    assert store.local.steps() == [1]


def test_scheduler_jobs_use_the_safe_apscheduler_settings(tmp_path):
    runner = PolicyRunner(make_store(tmp_path), PolicyConfig(object=TierPolicy(every_seconds=3600.0))).start()
    try:
        job = runner._scheduler.get_job("object-timer")
        assert (job.max_instances, job.coalesce, job.misfire_grace_time) == (1, True, None)
    finally:
        runner.stop()


def test_job_history_stays_bounded_on_a_long_running_node(tmp_path, monkeypatch):
    import flowcheck.policy as policy_module

    monkeypatch.setattr(policy_module, "HISTORY", 4)
    store = make_store(tmp_path, local_keep=2, object_keep=1)
    runner = PolicyRunner(store, PolicyConfig(local=TierPolicy(every_steps=1, keep_last=2),
                                              object=TierPolicy(every_steps=1, keep_last=1)))
    store.push(make_snapshot(step=0))
    for step in range(1, 11):
        advance(store, step)
        runner.trigger("local").result()
        runner.trigger("object").result()
    runner.stop()
    # a node snapshotting every few seconds for months must not keep every step it ever wrote
    assert runner.stats.local_snapshots == [7, 8, 9, 10] and runner.stats.promotions == [7, 8, 9, 10]
    assert all(len(d) == 4 for d in runner.stats.durations.values())
