"""The snapshot policy: step triggers and APScheduler timers that move state down the tiers.

Local snapshots run every ``every_steps`` steps and/or ``every_seconds``;
object promotions likewise (hourly by default).  Jobs run off the caller's
thread — the trainer or updater never waits for storage — one at a time per
tier; a trigger that fires while its tier is busy is coalesced, not queued.
GC of a tier runs right after that tier committed.

Every job leaves a ``JobRecord``: when it was requested (the step, timer or API call that
triggered it), when a tier worker started it, when it finished, and what it committed —
the node's metrics split snapshot and upload time into queue and transfer from these.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from flowcheck.config import PolicyConfig
from flowcheck.errors import StaleStateError, StepNotFoundError
from flowcheck.manifest import Manifest
from flowcheck.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobRecord:
    """One policy job: ``tier`` "local" is a snapshot (RAM -> local), "object" an upload (local -> object).

    Times are ``time.monotonic()``; ``outcome`` is committed (a new step), noop (nothing new to
    write), stale (the RAM state may not be snapshotted) or failed.
    """

    tier: str
    outcome: str
    requested: float
    started: float
    finished: float
    step: int | None = None
    nbytes: int = 0

    @property
    def queue_s(self) -> float:
        """Requested -> started: waiting for the tier's worker (a job in flight, or the API's turn)."""
        return self.started - self.requested

    @property
    def transfer_s(self) -> float:
        """Started -> committed: reading, writing, fsync and the manifest commit."""
        return self.finished - self.started


HISTORY = 256  # entries kept per PolicyStats list: a node runs for months, one job every few seconds


def _keep(history: list, item) -> None:
    """Append, dropping the oldest entries past ``HISTORY`` (lists, so callers keep slicing and comparing)."""
    history.append(item)
    del history[:-HISTORY]


@dataclass
class PolicyStats:
    local_snapshots: list[int] = field(default_factory=list)
    promotions: list[int] = field(default_factory=list)
    coalesced: int = 0
    errors: list[str] = field(default_factory=list)
    durations: dict[str, list[float]] = field(default_factory=lambda: {"local": [], "object": []})
    jobs: deque[JobRecord] = field(default_factory=lambda: deque(maxlen=256))  # the newest jobs
    gc_deleted: dict[str, int] = field(default_factory=lambda: {"local": 0, "object": 0})  # steps deleted by GC


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
        self.listeners: list[Callable[[JobRecord], None]] = []  # called with every finished job (metrics)

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
            fut = self._pools[tier].submit(self._timed, tier, job, time.monotonic())
            self._busy[tier] = fut
            return fut

    def snapshot_now(self, timeout: float | None = None) -> Manifest:
        """Persist the RAM state to the local tier now (the API's /snapshot), after any local job in flight.

        Returns the step's manifest (also when that step was committed already); raises what the store raises,
        and StepNotFoundError (not a job failure: nothing is logged) when no trainer has pushed a step yet.
        """
        if self.store.memory.step is None:
            raise StepNotFoundError(f"run {self.store.config.run!r}: the node holds no state yet (no trainer has pushed "
                                    "a step): nothing to snapshot")
        fut = self._pools["local"].submit(self._timed, "local", self._snapshot_any, time.monotonic(), True)
        return fut.result(timeout)

    def _timed(self, tier: str, job: Callable[[], tuple[Manifest | None, bool]], requested: float,
               reraise: bool = False) -> Manifest | None:
        started = time.monotonic()
        m, outcome = None, "noop"
        try:
            m, wrote = job()
            outcome = "committed" if wrote else "noop"
            return m
        except StaleStateError as e:
            outcome = "stale"
            log.warning("policy: %s snapshot skipped: %s", tier, e, extra={"event": "snapshot_skipped", "tier": tier})
            if reraise:
                raise
        except Exception as e:  # noqa: BLE001 - a failed job must not kill the scheduler; it is reported
            outcome = "failed"
            log.exception("policy: %s job failed", tier, extra={"event": "job_failed", "tier": tier})
            _keep(self.stats.errors, f"{tier}: {type(e).__name__}: {e}")
            if reraise:
                raise
        finally:
            _keep(self.stats.durations[tier], time.monotonic() - started)
            self._record(JobRecord(tier, outcome, requested, started, time.monotonic(),
                                   None if m is None else m.step, m.nbytes if m is not None and outcome == "committed" else 0))
        return None

    def _record(self, job: JobRecord) -> None:
        self.stats.jobs.append(job)
        if job.outcome == "committed":
            what = "snapshot" if job.tier == "local" else "upload"
            log.info("policy: %s of step %d committed to the %s tier: %d bytes in %.3f s (queued %.3f s)",
                     what, job.step, job.tier, job.nbytes, job.transfer_s, job.queue_s,
                     extra={"event": f"{what}_committed", "step": job.step, "tier": job.tier, "bytes": job.nbytes,
                            "seconds": round(job.transfer_s, 6), "queue_seconds": round(job.queue_s, 6)})
        for listener in list(self.listeners):
            try:
                listener(job)
            except Exception:  # noqa: BLE001 - an observer must never break the policy
                log.exception("policy: job listener failed")

    def _snapshot_any(self) -> tuple[Manifest, bool]:
        """The RAM step to the local tier (the API's snapshot: errors propagate, no GC)."""
        before = {s.digest for s in self.store.history(["local"]).states}
        m = self.store.snapshot()
        return m, m.digest() not in before

    def _snapshot_local(self) -> tuple[Manifest | None, bool]:
        if self.store.memory.step is None:
            return None, False
        m, wrote = self._snapshot_any()
        if not self.stats.local_snapshots or self.stats.local_snapshots[-1] != m.step:
            _keep(self.stats.local_snapshots, m.step)
        self._gc("local")
        return m, wrote

    def _promote(self) -> tuple[Manifest | None, bool]:
        obj = self.store.object
        if obj is None:
            return None, False
        hist = self.store.history()
        path = hist.path(hist.current())
        local = {(s.step, s.branch) for s in hist.states if s.tier == "local"}
        uploaded = {(s.step, s.branch) for s in hist.states if s.tier == "object"}
        newest = max((n for n, b in path.items() if (n, b) in local), default=None)
        # the newest local state of the current branch, unless object holds it or a later state of that branch
        if newest is None or any(n >= newest and (n, b) in uploaded for n, b in path.items()):
            return None, False
        m = self.store.promote(newest)
        _keep(self.stats.promotions, m.step)
        self._gc("object")
        return m, True

    def _gc(self, tier: str) -> None:
        report = self.store.gc(tiers=[tier])
        for tier, steps in report.deleted.items():
            if steps:
                self.stats.gc_deleted[tier] = self.stats.gc_deleted.get(tier, 0) + len(steps)
                log.info("policy: gc deleted %s steps %s", tier, [str(k) for k in steps],
                         extra={"event": "gc", "tier": tier, "steps": [k.step for k in steps],
                                "branches": [k.branch for k in steps]})

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
        self._timed("local", self._snapshot_local, time.monotonic())
        self._timed("object", self._promote, time.monotonic())

    def stop(self, wait: bool = True) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=wait)
        for pool in self._pools.values():
            pool.shutdown(wait=wait)
