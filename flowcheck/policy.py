"""The snapshot policy: step triggers and APScheduler timers that move state down the tiers.

Local snapshots run every ``every_steps`` steps and/or ``every_seconds``;
object promotions likewise (hourly by default).  Jobs run off the caller's
thread — the trainer or updater never waits for storage — one at a time per
tier; a trigger that fires while its tier is busy is coalesced, not queued.
GC of a tier runs right after that tier committed.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from flowcheck.config import PolicyConfig
from flowcheck.errors import StaleStateError
from flowcheck.store import Store

log = logging.getLogger(__name__)


@dataclass
class PolicyStats:
    local_snapshots: list[int] = field(default_factory=list)
    promotions: list[int] = field(default_factory=list)
    coalesced: int = 0
    errors: list[str] = field(default_factory=list)
    durations: dict[str, list[float]] = field(default_factory=lambda: {"local": [], "object": []})


class PolicyRunner:
    """Runs a store's policy in the background: ``start()``, ``on_step(step)``, ``stop()``."""

    def __init__(self, store: Store, policy: PolicyConfig | None = None) -> None:
        self.store = store
        self.policy = policy or store.config.policy
        self.stats = PolicyStats()
        self._pools = {"local": ThreadPoolExecutor(1, "fc-local"), "object": ThreadPoolExecutor(1, "fc-object")}
        self._busy: dict[str, Future | None] = {"local": None, "object": None}
        self._lock = threading.Lock()
        self._scheduler = None

    def start(self) -> PolicyRunner:
        from apscheduler.schedulers.background import BackgroundScheduler
        from apscheduler.triggers.interval import IntervalTrigger

        self._scheduler = BackgroundScheduler(daemon=True)
        for tier in ("local", "object"):
            seconds = getattr(self.policy, tier).every_seconds
            if seconds:
                # misfire_grace_time=None: a late run still runs (3.x's default of 1 s silently skips it)
                self._scheduler.add_job(self.trigger, IntervalTrigger(seconds=seconds), args=[tier], id=f"{tier}-timer",
                                        max_instances=1, coalesce=True, misfire_grace_time=None)
        self._scheduler.start()
        return self

    def on_step(self, step: int) -> None:
        """Called by whoever advances the RAM state, after step ``step`` is in place."""
        for tier in ("local", "object"):
            every = getattr(self.policy, tier).every_steps
            if every and step % every == 0:
                self.trigger(tier)

    def trigger(self, tier: str) -> Future | None:
        """Start the tier's job unless one is running (then the trigger is coalesced into it)."""
        with self._lock:
            running = self._busy[tier]
            if running is not None and not running.done():
                self.stats.coalesced += 1
                return None
            job = self._snapshot_local if tier == "local" else self._promote
            fut = self._pools[tier].submit(self._timed, tier, job)
            self._busy[tier] = fut
            return fut

    def _timed(self, tier: str, job) -> None:
        t0 = time.perf_counter()
        try:
            job()
        except StaleStateError as e:
            log.warning("policy: %s snapshot skipped: %s", tier, e)
        except Exception as e:  # noqa: BLE001 - a failed job must not kill the scheduler; it is reported
            log.exception("policy: %s job failed", tier)
            self.stats.errors.append(f"{tier}: {type(e).__name__}: {e}")
        finally:
            self.stats.durations[tier].append(time.perf_counter() - t0)

    def _snapshot_local(self) -> None:
        if self.store.memory.step is None:
            return
        m = self.store.snapshot()
        if not self.stats.local_snapshots or self.stats.local_snapshots[-1] != m.step:
            self.stats.local_snapshots.append(m.step)
        self._gc("local")

    def _promote(self) -> None:
        newest = self.store.local.latest()
        obj = self.store.object
        if newest is None or obj is None:
            return
        latest_obj = obj.latest()
        if latest_obj is not None and latest_obj >= newest:
            return
        m = self.store.promote(newest)
        self.stats.promotions.append(m.step)
        self._gc("object")

    def _gc(self, tier: str) -> None:
        report = self.store.gc(tiers=[tier])
        for tier, steps in report.deleted.items():
            if steps:
                log.info("policy: gc deleted %s steps %s", tier, steps)

    def drain(self, timeout: float | None = None) -> None:
        """Wait for running jobs to finish."""
        for fut in list(self._busy.values()):
            if fut is not None:
                fut.result(timeout)

    def flush(self) -> None:
        """Persist the current RAM step to every tier now (end of training, clean shutdown).

        Runs after the jobs in flight, in the caller's thread: a trigger now
        could be coalesced into a promotion of an older step.
        """
        self.drain()
        self._timed("local", self._snapshot_local)
        self._timed("object", self._promote)

    def stop(self, wait: bool = True) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=wait)
        for pool in self._pools.values():
            pool.shutdown(wait=wait)
