"""The node's Prometheus metrics: one CollectorRegistry per node, names documented in docs/node.md ("Reading the metrics").

Counters that already live in the node's components (push receiver, mirror capture, policy) are read
at scrape time by a custom collector — no second bookkeeping that could drift; the queue/transfer
histograms and bytes-written counters are fed by the policy's job records as jobs finish.
"""
from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from flowcheck.policy import JobRecord

log = logging.getLogger(__name__)

# snapshots of ~GB states take seconds to minutes; queue times are usually milliseconds
BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
TIERS = ("memory", "local", "object")


class NodeMetrics:
    """``render()`` -> (body, content type) of the node's /metrics."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self.registry = CollectorRegistry(auto_describe=False)
        self.queue = Histogram("flowcheck_snapshot_queue_seconds", "Policy job requested -> started, by target tier "
                               "(local: snapshot RAM -> local; object: upload local -> object).", ["tier"],
                               buckets=BUCKETS, registry=self.registry)
        self.transfer = Histogram("flowcheck_snapshot_transfer_seconds", "Policy job started -> committed, by target "
                                  "tier (read, write, fsync, manifest).", ["tier"], buckets=BUCKETS, registry=self.registry)
        self.written = Counter("flowcheck_tier_written_bytes", "Bytes committed to a tier by this node's snapshots and "
                               "uploads.", ["tier"], registry=self.registry)
        self.jobs = Counter("flowcheck_policy_jobs", "Policy jobs by target tier and outcome "
                            "(committed, noop, stale, failed).", ["tier", "outcome"], registry=self.registry)
        for tier in ("local", "object"):  # present from the first scrape, so rate() has a starting point
            self.queue.labels(tier)
            self.transfer.labels(tier)
            self.written.labels(tier)
        self.registry.register(_NodeCollector(node))

    def observe(self, job: JobRecord) -> None:
        """A finished policy job (a PolicyRunner listener)."""
        self.jobs.labels(job.tier, job.outcome).inc()
        if job.outcome == "committed":
            self.queue.labels(job.tier).observe(max(0.0, job.queue_s))
            self.transfer.labels(job.tier).observe(max(0.0, job.transfer_s))
            self.written.labels(job.tier).inc(job.nbytes)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _NodeCollector:
    """Reads the node's live counters and gauges at scrape time."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self._held: dict[tuple[str, int], int] = {}  # (tier, step) -> bytes: each manifest is read once

    def describe(self):
        return []

    def collect(self):
        yield from self._info()
        yield from self._push()
        yield from self._mirror()
        yield from self._tiers()
        yield from self._branches()
        yield from self._policy()

    def _info(self):
        from flowcheck.version import __version__

        node = self.node
        info = GaugeMetricFamily("flowcheck_node_info", "Always 1; labels say which run and node this is.",
                                 labels=["run", "node", "version"])
        info.add_metric([node.config.run, node.config.node, __version__], 1)
        yield info
        yield _gauge("flowcheck_rss_bytes", "Resident set size of the node process.", _rss())
        yield _gauge("flowcheck_memory_stale", "1 when the RAM state is stale (not snapshotted until a full push).",
                     int(bool(node.store.memory.stale)))
        yield _gauge("flowcheck_resync_requested", "1 while a request for a full state push is pending.",
                     int(node.resync is not None))
        yield _counter("flowcheck_resync_requests", "Full-state pushes asked of the trainer.", node.resync_requests)

    def _push(self):
        rs = self.node.receiver.stats
        yield _counter("flowcheck_push_bytes", "Bytes of state received from trainers (push capture).", rs.bytes)
        yield _counter("flowcheck_push_frames", "Parts received from trainers (push capture).", rs.frames)
        yield _counter("flowcheck_push_steps", "Pushed steps applied to the RAM state.", rs.steps)
        yield _counter("flowcheck_push_rejected",
                       "Pushed parts rejected (bad header, layout, size; unsigned, wrongly signed or replayed).", rs.rejected)
        yield _counter("flowcheck_push_aborted_steps", "Pushed steps aborted (a sender lost or timed out).",
                       rs.aborted_steps)
        yield _counter("flowcheck_push_kept_bytes", "Bytes of frozen tensors and unchanged buffers pushes carried as "
                       "kept (held in RAM, not sent again).", rs.kept_bytes)
        yield _counter("flowcheck_push_resends_asked", "Pushes with kept shards the node lacked, asked again whole.",
                       rs.resends_asked)
        yield from self._connections()

    def _connections(self):
        listeners = self.node.connections()
        open_ = GaugeMetricFamily("flowcheck_connections_open", "Connections open per listener (push, http).",
                                  labels=["listener"])
        refused = CounterMetricFamily("flowcheck_connections_refused", "Connections refused at once: the listener "
                                      "held serve.max_connections.", labels=["listener"])
        timed_out = CounterMetricFamily("flowcheck_connections_timed_out", "Push connections closed for sending no "
                                        "complete frame in time (serve.header_timeout_s / idle_timeout_s).",
                                        labels=["listener"])
        for name, counts in sorted(listeners.items()):
            open_.add_metric([name], counts["open"])
            refused.add_metric([name], counts["refused"])
            if "timed_out" in counts:
                timed_out.add_metric([name], counts["timed_out"])
        yield from (open_, refused, timed_out)

    def _mirror(self):
        st, rep = self.node.mirror_stats, self.node.mirror_report  # report: None until a mirror capture runs
        iterations, stale, skipped, resyncs = (0, 0, 0, 0) if rep is None else (
            rep.iterations, len(rep.stale), rep.skipped, len(rep.resyncs))
        yield _counter("flowcheck_mirror_frames", "Frames read by the mirror-capture source.", st.frames)
        yield _counter("flowcheck_mirror_bytes", "Wire bytes read by the mirror-capture source.", st.bytes)
        yield _counter("flowcheck_mirror_frames_dropped", "Frames the kernel dropped before the live mirror capture "
                       "read them (its socket buffer was full: capture fell behind).", st.frames_dropped)
        packets = CounterMetricFamily("flowcheck_mirror_packets", "Mirrored frames parsed, by status "
                                      "(OK, BAD_ICRC, MALFORMED, NOT_ROCE).", labels=["status"])
        for status, n in sorted(st.packets.items()):
            packets.add_metric([status.lower()], n)
        yield packets
        yield _counter("flowcheck_mirror_packets_missing", "Packets a mirrored stream never delivered (PSN gaps).",
                       st.packets_missing)
        yield _counter("flowcheck_mirror_packets_duplicate", "Duplicate packets on mirrored streams.",
                       st.packets_duplicate)
        ars = CounterMetricFamily("flowcheck_mirror_allreduces", "Allreduces assembled, complete or not.",
                                  labels=["result"])
        ars.add_metric(["complete"], st.allreduces_complete)
        ars.add_metric(["incomplete"], st.allreduces_incomplete)
        yield ars
        yield _counter("flowcheck_mirror_elements_recovered", "Gradient elements missing on one mirrored copy and "
                       "recovered from another.", st.elements_recovered)
        yield _counter("flowcheck_mirror_elements_lost", "Gradient elements no mirrored copy delivered (lost for good).",
                       st.elements_lost)
        yield _counter("flowcheck_mirror_iterations", "Iterations applied to the replica from the wire.", iterations)
        yield _counter("flowcheck_stale_iterations", "Iterations that could not be completed (state marked stale).",
                       stale)
        yield _counter("flowcheck_mirror_skipped_iterations", "Iterations passed over while stale, awaiting a resync.",
                       skipped)
        yield _counter("flowcheck_resyncs", "Full states taken after a stale iteration (resyncs completed).",
                       resyncs)

    def _tiers(self):
        node = self.node
        last = GaugeMetricFamily("flowcheck_last_committed_step", "Newest committed step per tier (memory: the RAM step).",
                                 labels=["tier"])
        held = GaugeMetricFamily("flowcheck_tier_bytes", "Bytes held per tier (memory: RAM state; local, object: "
                                 "files of committed steps).", labels=["tier"])
        count = GaugeMetricFamily("flowcheck_tier_steps", "Committed steps held per tier.", labels=["tier"])
        mem = node.store.memory
        if mem.step is not None:
            last.add_metric(["memory"], mem.step)
        held.add_metric(["memory"], node.memory_bytes())
        count.add_metric(["memory"], len(mem.steps()))
        for tier in node.store.tiers(include_memory=False):
            try:
                steps = tier.steps()
                nbytes = self._bytes(tier, steps)
            except Exception as e:  # noqa: BLE001 - an unreachable object store must not break the scrape
                log.warning("metrics: %s tier unreadable: %s", tier.name, e)
                continue
            if steps:
                last.add_metric([tier.name], steps[-1])
            held.add_metric([tier.name], nbytes)
            count.add_metric([tier.name], len(steps))
        yield from (last, held, count)

    def _branches(self):
        """Each branch's head step; ``current`` says which one "latest", restore and GC follow."""
        try:
            lineage = self.node.branches()
        except Exception as e:  # noqa: BLE001 - an unreachable object store must not break the scrape
            log.warning("metrics: branches unreadable: %s", e)
            return
        heads = GaugeMetricFamily("flowcheck_branch_head_step", "Newest committed step of each branch of the run "
                                  "(current=1: the branch latest and GC follow).", labels=["branch", "current"])
        for name, b in lineage["branches"].items():
            if b["head"] is not None:
                heads.add_metric([name, "1" if name == lineage["current"] else "0"], b["head"])
        yield heads
        yield _gauge("flowcheck_branches", "Branches of the run (1 + rollbacks/restarts from an older step).",
                     len(lineage["branches"]))

    def _bytes(self, tier, steps: list[int]) -> int:
        present = {(tier.name, s) for s in steps}
        for key in [k for k in self._held if k[0] == tier.name and k not in present]:
            del self._held[key]  # deleted by GC
        total = 0
        for s in steps:
            if (tier.name, s) not in self._held:
                self._held[(tier.name, s)] = tier.manifest(s, check_signature=False).nbytes
            total += self._held[(tier.name, s)]
        return total

    def _policy(self):
        ps = self.node.policy.stats
        yield _counter("flowcheck_policy_coalesced", "Policy triggers coalesced into a job already running.", ps.coalesced)
        gc = CounterMetricFamily("flowcheck_gc_deleted_steps", "Steps deleted by retention after a commit.",
                                 labels=["tier"])
        for tier, n in sorted(ps.gc_deleted.items()):
            gc.add_metric([tier], n)
        yield gc


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss
