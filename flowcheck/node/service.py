"""The checkpoint node (``flowcheck serve``): push receiver + memory tier + policy + HTTP control API.

Shutdown (SIGTERM) stops taking pushes, lets a snapshot or upload in flight finish (a step is visible
only once committed, so anything cut short leaves no partial step), and stops the API.  A restarted node
rebuilds its view from the tiers: the newest committed step becomes the parent of the next snapshot.

The node's token comes from the environment variable ``serve.auth_token_env`` names: with it, pushes and
control POSTs must be authorised; without it the node is unauthenticated and listens on loopback only.
A node holds its run's lease (flowcheck/node/lease.py) from construction to ``stop()``: a second node on
the same run and local tier fails to start, naming the first.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from flowcheck.capture.push.auth import read_token
from flowcheck.errors import ConfigError, FlowcheckError
from flowcheck.capture.mirror.stats import CaptureStats
from flowcheck.node.receiver import PushReceiver
from flowcheck.config import Config, ServeConfig
from flowcheck.logs import oneline
from flowcheck.node.lease import ObjectLease, RunLease
from flowcheck.node.limits import ConnectionLimits, check_fd_limit
from flowcheck.policy import PolicyRunner
from flowcheck.store import Store

log = logging.getLogger(__name__)

MAX_REASON = 500  # characters of a resync reason kept: it is logged and shown on /status

# glibc mallopt() parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def tune_allocator(arenas: int = 2, threshold: int = 1 << 20) -> bool:
    """Keep a long-running node's RSS near what it holds (glibc only; a no-op elsewhere).

    glibc gives each thread its own arena (up to 8 × cores) and raises its mmap threshold to the
    largest block ever freed (up to 32 MiB), so the node's many short-lived multi-MiB buffers (push
    parts, zarr chunks, upload bodies) end up in arenas that are never returned: a 600 s soak at a
    111 MiB state peaked at 5.9× the state.  Two arenas and a fixed 1 MiB mmap/trim threshold give
    big buffers back to the kernel when freed (2.6× in the same soak).  Call before threads start.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = [(param, value) for param, value, env in (
        (_M_ARENA_MAX, arenas, "MALLOC_ARENA_MAX"), (_M_MMAP_THRESHOLD, threshold, "MALLOC_MMAP_THRESHOLD_"),
        (_M_TRIM_THRESHOLD, threshold, "MALLOC_TRIM_THRESHOLD_")) if env not in os.environ]  # the operator's win
    ok = all(mallopt(param, value) == 1 for param, value in settings)
    log.debug("allocator: arenas=%d mmap/trim threshold=%d bytes (%s)", arenas, threshold, "set" if ok else "refused")
    return ok


def node_token(serve: ServeConfig) -> str | None:
    """The node's token from ``$serve.auth_token_env``; without one, ConfigError if a listener is not on loopback."""
    from flowcheck.node.access import is_loopback

    token = read_token(serve.auth_token_env)
    if token is None:
        exposed = [f"serve.{name} ({getattr(serve, name)})" for name in ("push", "http")
                   if not is_loopback(ServeConfig.split(getattr(serve, name))[0])]
        if exposed:
            raise ConfigError(
                f"{' and '.join(exposed)}: not a loopback address, and ${serve.auth_token_env} is unset: a node without "
                f"a token accepts anyone's pushes, so it listens on loopback only.  Set a token in the node's and the "
                f"trainers' environment (export {serve.auth_token_env}=$(python -c 'import secrets; "
                f"print(secrets.token_urlsafe(32))')), or bind 127.0.0.1")
    return token


class Node:
    def __init__(self, config: Config) -> None:
        self.config = config
        self._token = node_token(config.serve)  # before anything listens or touches the store
        self.lease = RunLease(config.tiers.local.root, config.run, config.node).acquire()  # before the ports too
        try:
            self._build(config)
        except BaseException:
            self.lease.release()
            raise

    def _build(self, config: Config) -> None:
        self.store = Store(config)
        self.object_lease = None
        if self.store.object is not None and not config.cluster.nodes:
            self.object_lease = ObjectLease(self.store.object, config.run, config.node, config.tiers.local.root).acquire()
        self.started = time.time()
        self.resync: dict[str, Any] | None = None  # a pending request for a full state push
        self.resync_requests = 0
        self._recover()
        self.policy = PolicyRunner(self.store)
        host, port = ServeConfig.split(config.serve.push)
        self.limits = ConnectionLimits.of(config.serve)
        self.receiver = PushReceiver(self.store, host, port, part_timeout_s=config.serve.part_timeout_s,
                                     on_step=self._on_push, token=self._token, token_env=config.serve.auth_token_env,
                                     limits=self.limits)
        self.api = None
        self.mirror: dict[str, Any] | None = None  # progress of the mirror-capture source, when configured
        self.mirror_stats = CaptureStats()
        self.mirror_report = None  # the mirror Updater's CaptureReport, live, once a capture runs
        self.mirror_info = None  # the mirror decode's Decoded (anomalies, bytes placed), live, once a capture runs
        self._stopped = threading.Event()  # set when stop() begins: the mirror capture ends
        self._finished = threading.Event()  # set when stop() is done: the work in flight finished, the lease released
        from flowcheck.node.metrics import NodeMetrics

        self._metrics = NodeMetrics(self)
        self.policy.listeners.append(self._metrics.observe)

    def _recover(self) -> None:
        """The head of the current branch (flowcheck/branches.py) is what the next snapshot descends from."""
        try:
            if not self.store.history().states:
                return
            tier, step = self.store.locate("latest")
            best = tier.manifest(step, check_signature=False)
        except FlowcheckError as e:
            log.warning("node: recovered without a parent for the next snapshot: %s", e)
            return
        self.store.memory.descends_from(best.parent_ref())
        log.info("node: recovered; head of branch %s is step %d (%s)", tier.branch, best.step, best.digest()[:19])

    def _on_push(self, step: int) -> None:
        log.info("node: push of step %d applied to RAM", step,
                 extra={"event": "push_received", "step": step, "bytes": self.memory_bytes()})
        self._on_step(step)

    def _on_step(self, step: int) -> None:
        self.resync = None  # a full state arrived
        self.policy.on_step(step)

    def start(self) -> Node:
        try:
            self._start()
        except BaseException:
            self.stop()  # the push port, the policy's threads and the lease are freed
            raise
        return self

    def _start(self) -> None:
        from flowcheck.node.api import ControlAPI

        check_fd_limit(self.limits)
        self.receiver.start()
        self.policy.start()
        host, port = ServeConfig.split(self.config.serve.http)
        self.api = ControlAPI(self, host, port, token=self._token, limits=self.limits).start()
        if self.config.serve.mirror_job:
            threading.Thread(target=self._replay_mirror, name="fc-mirror", daemon=True).start()
        log.info("node: push on %s:%d, control API on http://%s:%d", *self.receiver.address, *self.api.address)
        env = self.config.serve.auth_token_env
        if self._token is None:
            log.warning("node: unauthenticated ($%s is unset): any process on this host may push state and call the "
                        "control API; listening on loopback only", env)
        else:
            log.info("node: pushes and control POSTs need the token from $%s", env)

    def _replay_mirror(self) -> None:
        """Mirror capture from the configured files or live interface: decode -> replica -> RAM, snapshots by the policy."""
        import glob

        from flowcheck.capture.mirror.decode import Decoded, decode, read_all
        from flowcheck.capture.mirror.job import load_job
        from flowcheck.capture.mirror.pipeline import MirrorSession
        from flowcheck.capture.mirror.stats import counted

        serve = self.config.serve
        self.mirror = {"state": "running", "job": serve.mirror_job}
        try:
            job = load_job(serve.mirror_job)
            pcaps = sorted(glob.glob(serve.mirror_pcaps)) if serve.mirror_pcaps else []
            partition, part = self._mirror_part(job)
            session = MirrorSession(job, self.store, on_step=self._on_step, init=serve.mirror_init, **part,
                                    on_stale=lambda it, why: self.request_resync(f"mirror capture, iteration {it}: {why}"))
            self.mirror_report = session.report
            info = self.mirror_info = Decoded()
            if serve.mirror_interface:
                self.mirror["interface"] = serve.mirror_interface
                allreduces = self._live_mirror(job, info, partition)
            else:
                frames = read_all(pcaps)
                self.mirror_stats.read(frames)
                allreduces = decode(job, frames, info, partition=partition)
            report = session.run(counted(allreduces, self.mirror_stats, info))
            self.mirror.update(state="done", iterations=report.iterations, stale=len(report.stale),
                               resyncs=report.resyncs, step=report.steps[-1] if report.steps else None,
                               placed_bytes=info.placed_bytes)
            if not serve.mirror_interface:
                self.mirror["pcaps"] = len(pcaps)
        except Exception as e:  # noqa: BLE001 - reported on /status; the node keeps serving pushes
            log.exception("node: mirror capture failed")
            self.mirror.update(state="failed", error=f"{type(e).__name__}: {e}")

    def _mirror_part(self, job):
        """(Partition, Replica keywords) of this node's share of the mirror capture (serve.mirror_partition)."""
        from flowcheck.capture.mirror.partition import NormExchange, Partition

        cfg = self.config.serve.mirror_partition
        partition = Partition(cfg.index, cfg.of)
        if partition.whole:
            return None, {}
        norms = NormExchange(cfg.exchange, partition, cfg.exchange_wait_s) if job.clip_grad_norm is not None else None
        self.mirror.update(partition={"index": cfg.index, "of": cfg.of})
        return partition, {"owned": partition.owned(job), "norms": norms}

    def _live_mirror(self, job, info, partition=None):
        """Allreduces decoded as the mirror port's frames arrive, until the node stops."""
        from flowcheck.capture.mirror.live import live_frames
        from flowcheck.capture.mirror.streaming import StreamingDecoder

        def read():
            def dropped(n: int) -> None:
                self.mirror_stats.frames_dropped += n
                log.warning("node: the kernel dropped %d mirrored frames (the capture fell behind)", n)

            for frames in live_frames(self.config.serve.mirror_interface, stop=self._stopped, idle=True,
                                      on_drops=dropped):
                self.mirror_stats.read(frames)
                yield frames

        decoder = StreamingDecoder(job, info, settle_s=self.config.serve.mirror_settle_s, clock=time.time_ns,
                                   partition=partition, workers=self.config.serve.mirror_decode_workers)
        return decoder.run(read())

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        try:
            self.receiver.close()
            self.policy.stop(wait=True)
            if self.api is not None:
                self.api.stop()
        finally:
            if self.object_lease is not None:
                self.object_lease.release()
            self.lease.release()  # last: nothing of this node writes the run any more
            self._finished.set()

    def wait(self) -> None:
        """Until ``stop()`` (from another thread: a signal handler's) has finished."""
        self._finished.wait()

    # ---- what the API reports -----------------------------------------------------------
    def request_resync(self, reason: str) -> dict[str, Any]:
        """Ask the trainer for a full state; ``reason`` may come from a client: it is kept on one line, and short."""
        reason = oneline(reason)[:MAX_REASON]
        self.resync = {"reason": reason, "since": time.time()}
        self.resync_requests += 1
        log.warning("node: full state push (resync) requested: %s", reason,
                    extra={"event": "resync_requested", "step": self.store.memory.step, "reason": reason})
        self.store.memory.mark_stale(f"resync requested: {reason}")
        return self.resync

    def memory_bytes(self) -> int:
        """Bytes of the RAM state held (0 before the first full push)."""
        return self.store.memory.state_bytes

    def steps(self) -> dict[str, list[int]]:
        out = {t.name: t.steps() for t in self.store.tiers(include_memory=False)}
        mem = self.store.memory.step
        out["memory"] = [] if mem is None else [mem]
        return out

    def branches(self) -> dict[str, Any]:
        """The run's branches: which is current, each one's head and fork point (flowcheck/branches.py).

        Lists the local tier now and takes the object tier as its last promotion or GC saw it, so /status
        and a scrape never wait on a slow object store."""
        hist = self.store.history(live={"local"})
        out = {}
        for b in hist.branches():
            fork = hist.fork(b)
            out[b] = {"head": hist.head(b), "steps": hist.own_steps(b),
                      "fork": None if fork is None else {"branch": fork.branch, "step": fork.step}}
        return {"current": hist.current(), "branches": out}

    def status(self) -> dict[str, Any]:
        mem = self.store.memory
        ps, rs = self.policy.stats, self.receiver.stats
        return {
            "run": self.config.run, "node": self.config.node, "pid": os.getpid(), "uptime_s": time.time() - self.started,
            "memory": {"step": mem.step, "stale": mem.stale, "parent": None if mem.head is None else mem.head.step,
                       "cow_copies": mem.cow_copies, "cow_waits": mem.cow_waits, "bytes": self.memory_bytes(),
                       # of the state (and of states snapshots still hold), bytes in trainers' segments the node adopted
                       # or in its receive buffers; receive_buffer_bytes: TCP receive buffers, in use or kept for reuse
                       "lent_bytes": mem.lent_bytes,
                       "receive_buffer_bytes": self.receiver.pool.lent_bytes + self.receiver.pool.pooled_bytes},
            "tiers": {name: (steps[-1] if steps else None) for name, steps in self.steps().items()},
            "lineage": self.branches(),
            "push": {"frames": rs.frames, "bytes": rs.bytes, "steps": rs.steps, "rejected": rs.rejected,
                     "aborted_steps": rs.aborted_steps, "last_step": rs.last_step, "errors": rs.errors[-5:],
                     "kept_bytes": rs.kept_bytes, "resends_asked": rs.resends_asked,
                     # an aborted push leaves the previous complete step as the RAM state: which one, and why
                     "last_aborted": rs.last_aborted, "adopted_segments": rs.adopted_segments,
                     "receiving": self.receiver.receiving,
                     # the launch of the job pushes are taken from (older launches' pushes are refused)
                     "launch": self.receiver.launches.to_json(),
                     "senders": {str(k): v for k, v in sorted(rs.senders.items())}},
            "policy": {"local_snapshots": ps.local_snapshots[-5:], "promotions": ps.promotions[-5:],
                       "coalesced": ps.coalesced, "errors": ps.errors[-5:]},
            "resync": self.resync,
            "mirror": self.mirror,
            "auth": "none" if self._token is None else "token",
            "connections": self.connections(),
            "lease": self.lease.path,
        }

    def connections(self) -> dict[str, dict[str, int]]:
        """Per listener: connections open, refused at serve.max_connections, and (push) closed for taking too long;
        aiohttp closes slow HTTP connections itself, uncounted."""
        out = {"push": self.receiver.connections.as_json()}
        if self.api is not None:
            out["http"] = {k: v for k, v in self.api.connections.as_json().items() if k != "timed_out"}
        return out

    def metrics(self) -> tuple[bytes, str]:
        """Prometheus text exposition (body, content type); the families are listed in docs/node.md ("Reading the metrics")."""
        return self._metrics.render()
