"""The checkpoint node (``flowcheck serve``): push receiver + memory tier + policy + HTTP control API.

Shutdown (SIGTERM) stops taking pushes, lets a snapshot or upload in flight finish (a step is visible
only once committed, so anything cut short leaves no partial step), and stops the API.  A restarted node
rebuilds its view from the tiers: the newest committed step becomes the parent of the next snapshot.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from flowcheck.capture.push import PushReceiver
from flowcheck.config import Config, ServeConfig
from flowcheck.policy import PolicyRunner
from flowcheck.store import Store

log = logging.getLogger(__name__)


class Node:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.store = Store(config)
        self.started = time.time()
        self.resync: dict[str, Any] | None = None  # a pending request for a full state push
        self._recover()
        self.policy = PolicyRunner(self.store)
        host, port = ServeConfig.split(config.serve.push)
        self.receiver = PushReceiver(self.store, host, port, part_timeout_s=config.serve.part_timeout_s,
                                     on_step=self._on_step)
        self.api = None
        self.mirror: dict[str, Any] | None = None  # progress of the mirror-capture source, when configured
        self._stopped = threading.Event()

    def _recover(self) -> None:
        """The newest committed step in any persistent tier is what the next snapshot descends from."""
        best = None
        for tier in self.store.tiers(include_memory=False):
            steps = tier.steps()
            if steps and (best is None or steps[-1] > best.step):
                best = tier.manifest(steps[-1], check_signature=False)
        if best is not None:
            self.store.memory.head = best.parent_ref()
            log.info("node: recovered; newest committed step %d (%s)", best.step, best.digest()[:19])

    def _on_step(self, step: int) -> None:
        self.resync = None  # a full state arrived
        self.policy.on_step(step)

    def start(self) -> Node:
        from flowcheck.node.api import ControlAPI

        self.receiver.start()
        self.policy.start()
        host, port = ServeConfig.split(self.config.serve.http)
        self.api = ControlAPI(self, host, port).start()
        if self.config.serve.mirror_job:
            threading.Thread(target=self._replay_mirror, name="fc-mirror", daemon=True).start()
        log.info("node: push on %s:%d, control API on http://%s:%d", *self.receiver.address, *self.api.address)
        return self

    def _replay_mirror(self) -> None:
        """Mirror capture from the configured files: decode -> replica -> RAM, snapshots by the policy."""
        import glob

        from flowcheck.capture.decode import Decoded, decode, read_all
        from flowcheck.capture.job import load_job
        from flowcheck.capture.mirror import ResyncSource, Updater, initial_replica, publish_to, run_pipeline

        serve = self.config.serve
        self.mirror = {"state": "running", "job": serve.mirror_job}
        try:
            job = load_job(serve.mirror_job)
            pcaps = sorted(glob.glob(serve.mirror_pcaps))
            replica = initial_replica(job, serve.mirror_init, self.store)
            self.store.push(replica.snapshot(self.config.run))
            updater = Updater(job, replica, publish=publish_to(self.store, self.config.run, self._on_step),
                              on_stale=lambda it, why: self.request_resync(f"mirror capture, iteration {it}: {why}"),
                              resync=ResyncSource(job.resync))
            report = run_pipeline(decode(job, read_all(pcaps), Decoded()), updater)
            self.mirror.update(state="done", pcaps=len(pcaps), iterations=report.iterations, stale=len(report.stale),
                               resyncs=report.resyncs, step=report.steps[-1] if report.steps else None)
        except Exception as e:  # noqa: BLE001 - reported on /status; the node keeps serving pushes
            log.exception("node: mirror capture failed")
            self.mirror.update(state="failed", error=f"{type(e).__name__}: {e}")

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.receiver.close()
        self.policy.stop(wait=True)
        if self.api is not None:
            self.api.stop()

    def wait(self) -> None:
        self._stopped.wait()

    # ---- what the API reports -----------------------------------------------------------
    def request_resync(self, reason: str) -> dict[str, Any]:
        self.resync = {"reason": reason, "since": time.time()}
        self.store.memory.mark_stale(f"resync requested: {reason}")
        return self.resync

    def steps(self) -> dict[str, list[int]]:
        out = {t.name: t.steps() for t in self.store.tiers(include_memory=False)}
        mem = self.store.memory.step
        out["memory"] = [] if mem is None else [mem]
        return out

    def status(self) -> dict[str, Any]:
        mem = self.store.memory
        ps, rs = self.policy.stats, self.receiver.stats
        return {
            "run": self.config.run, "node": self.config.node, "pid": os.getpid(), "uptime_s": time.time() - self.started,
            "memory": {"step": mem.step, "stale": mem.stale, "parent": None if mem.head is None else mem.head.step},
            "tiers": {name: (steps[-1] if steps else None) for name, steps in self.steps().items()},
            "push": {"frames": rs.frames, "bytes": rs.bytes, "steps": rs.steps, "rejected": rs.rejected,
                     "aborted_steps": rs.aborted_steps, "last_step": rs.last_step, "errors": rs.errors[-5:]},
            "policy": {"local_snapshots": ps.local_snapshots[-5:], "promotions": ps.promotions[-5:],
                       "coalesced": ps.coalesced, "errors": ps.errors[-5:]},
            "resync": self.resync,
            "mirror": self.mirror,
        }

    def metrics(self) -> str:
        """Prometheus text exposition."""
        import psutil

        s = self.status()
        rs = self.receiver.stats
        lines = [
            "# HELP flowcheck_push_bytes_total Bytes of state received from trainers.",
            "# TYPE flowcheck_push_bytes_total counter",
            f"flowcheck_push_bytes_total {rs.bytes}",
            "# TYPE flowcheck_push_frames_total counter",
            f"flowcheck_push_frames_total {rs.frames}",
            "# TYPE flowcheck_push_steps_total counter",
            f"flowcheck_push_steps_total {rs.steps}",
            "# TYPE flowcheck_push_rejected_total counter",
            f"flowcheck_push_rejected_total {rs.rejected}",
            "# TYPE flowcheck_push_aborted_steps_total counter",
            f"flowcheck_push_aborted_steps_total {rs.aborted_steps}",
            "# TYPE flowcheck_memory_stale gauge",
            f"flowcheck_memory_stale {int(bool(s['memory']['stale']))}",
            "# TYPE flowcheck_resync_requested gauge",
            f"flowcheck_resync_requested {int(self.resync is not None)}",
            "# TYPE flowcheck_rss_bytes gauge",
            f"flowcheck_rss_bytes {psutil.Process().memory_info().rss}",
            "# HELP flowcheck_last_committed_step Newest committed step per tier.",
            "# TYPE flowcheck_last_committed_step gauge",
        ]
        for tier, step in s["tiers"].items():
            if step is not None:
                lines.append(f'flowcheck_last_committed_step{{tier="{tier}"}} {step}')
        lines += ["# TYPE flowcheck_snapshot_seconds summary"]
        for tier, durations in self.policy.stats.durations.items():
            lines.append(f'flowcheck_snapshot_seconds_count{{tier="{tier}"}} {len(durations)}')
            lines.append(f'flowcheck_snapshot_seconds_sum{{tier="{tier}"}} {sum(durations):.6f}')
        return "\n".join(lines) + "\n"
