"""The run lease: one writer node per run and local tier (``<local root>/<run>/.lease.json``).

Two nodes serving one run would interleave two trainings into one lineage, and audit would call it
clean.  So ``flowcheck serve`` takes the lease at start: an exclusive ``flock`` on the file, which the
kernel drops when the process dies however it dies (``kill -9`` included), so a crashed node's lease is
simply taken over.  The file's JSON (node, pid, host, started, refreshed_at) is only for the message a
second node prints; it is rewritten in place (never renamed: the lock belongs to the inode) every
``REFRESH_S`` while held.  A cluster's nodes each have their own local tier, so each holds its own lease.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import logging
import os
import socket
import threading
import time
from typing import Any

from flowcheck.errors import LeaseHeldError, TierError

log = logging.getLogger(__name__)

LEASE = ".lease.json"
REFRESH_S = 10.0


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class RunLease:
    """The lease on ``<local_root>/<run>``; ``acquire()`` takes it or raises LeaseHeldError naming the holder."""

    def __init__(self, local_root: str, run: str, node: str) -> None:
        self.folder = os.path.join(local_root, run)
        self.path = os.path.join(self.folder, LEASE)
        self.run, self.node = run, node
        self._fd: int | None = None
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None
        self._record: dict[str, Any] = {}

    def acquire(self) -> RunLease:
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise TierError(e.errno, f"run lease {self.path}: cannot open it ({e.strerror}); check the local tier's "
                                     "path and permissions") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise LeaseHeldError(self._held_message(holder)) from None
        except OSError as e:
            os.close(fd)
            raise TierError(e.errno, f"run lease {self.path}: cannot lock it ({e.strerror}); the local tier's "
                                     "filesystem must support flock") from e
        previous = _read(fd)
        if previous.get("pid") and not previous.get("released_at"):
            log.warning("node: took over the lease of run %s from node %s (pid %s on %s, since %s): that process is "
                        "gone without releasing it", self.run, previous.get("node"), previous.get("pid"),
                        previous.get("host"), previous.get("started"))
        self._fd = fd
        self._record = {"run": self.run, "node": self.node, "pid": os.getpid(), "host": socket.gethostname(),
                        "started": _now()}
        self._write(refreshed_at=self._record["started"])
        self._refresher = threading.Thread(target=self._refresh, name="fc-lease", daemon=True)
        self._refresher.start()
        return self

    def release(self) -> None:
        """Mark the lease released and unlock it (the file stays: removing it would race a node opening it)."""
        if self._fd is None:
            return
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(5)
        with contextlib.suppress(OSError):
            self._write(refreshed_at=_now(), released_at=_now())
        os.close(self._fd)  # closing the last descriptor drops the flock
        self._fd = None

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                self._write(refreshed_at=_now())
            except OSError as e:  # the lock still holds; only the record a second node would print is stale
                log.warning("node: cannot refresh the run lease %s: %s", self.path, e)

    def _write(self, **fields: Any) -> None:
        data = json.dumps({**self._record, **fields}, indent=1).encode() + b"\n"
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    def _held_message(self, holder: dict[str, Any]) -> str:
        who = (f"node {holder.get('node')!r} (pid {holder.get('pid')} on host {holder.get('host')}, since "
               f"{holder.get('started')}, last refreshed {holder.get('refreshed_at')})") if holder.get("pid") else \
            "another process (its lease record is unreadable or being written)"
        return (f"run {self.run!r} in local tier {os.path.dirname(self.folder)} is already served by {who}: one node "
                f"writes a run at a time (lease {self.path}).  Stop that node (SIGTERM; its lease is freed when it "
                f"exits, also when killed), or serve another run or local root")


def _read(fd: int) -> dict[str, Any]:
    """The lease record in ``fd`` ({} if empty or mid-write: only the message depends on it)."""
    for _ in range(3):
        try:
            raw = os.pread(fd, 1 << 16, 0)
            record = json.loads(raw) if raw.strip() else {}
            return record if isinstance(record, dict) else {}
        except (OSError, ValueError):
            time.sleep(0.05)
    return {}


STALE_S = 6 * REFRESH_S  # an object-tier lease not refreshed this long is a dead node's (clock skew included)


class ObjectLease:
    """The lease on a run in the object tier (``<url>/<run>/.lease.json``): one node per run and object store.

    Two nodes with separate local roots (each with its own local lease) sharing one object URL would interleave two
    trainings' steps in one run.  An object store has no lock a dying process drops, so this lease is a record
    refreshed every REFRESH_S: a node finding another node's record refreshed within STALE_S refuses to start,
    naming it; a stale or released record is taken over, and so is one naming this node's own local root (this
    node holds that root's lease, so the node that wrote the record is gone).  A cluster's nodes share their run on purpose and take
    none (their steps are committed together, flowcheck/tiers/cluster.py)."""

    NAME = LEASE

    def __init__(self, tier: Any, run: str, node: str, local_root: str) -> None:
        self.tier, self.run = tier, run
        self._record = {"run": run, "node": node, "id": os.urandom(8).hex(), "pid": os.getpid(),
                        "host": socket.gethostname(), "local_root": os.path.abspath(local_root), "started": _now()}
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def acquire(self) -> ObjectLease:
        try:
            holder = self._holder()
        except TierError as e:  # unreachable now: the node starts, and the refresher writes the lease when it can
            log.warning("node: cannot read the object-tier lease of run %s (%s); taking it when the store answers",
                        self.run, e)
            holder = None
        if holder and holder.get("id") != self._record["id"] and not holder.get("released_at") \
                and holder.get("local_root") != self._record["local_root"] \
                and time.time() - _parse(holder.get("refreshed_at")) < STALE_S:
            raise LeaseHeldError(
                f"run {self.run!r} in object tier {self.tier.url} is already served by node {holder.get('node')!r} "
                f"(pid {holder.get('pid')} on host {holder.get('host')}, local root {holder.get('local_root')}, last "
                f"refreshed {holder.get('refreshed_at')}): one node writes a run's object tier at a time.  Stop that "
                "node, or give this one another run name or object URL (a cluster lists its nodes in cluster.nodes)")
        if holder and holder.get("pid") and not holder.get("released_at"):
            log.warning("node: took over the object-tier lease of run %s from node %s (on %s): not refreshed since %s",
                        self.run, holder.get("node"), holder.get("host"), holder.get("refreshed_at"))
        if holder is not None:
            self._write(refreshed_at=_now())
        self._refresher = threading.Thread(target=self._refresh, name="fc-object-lease", daemon=True)
        self._refresher.start()
        return self

    def release(self) -> None:
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(5)
            with contextlib.suppress(Exception):
                if (self._holder() or {}).get("id") == self._record["id"]:
                    self._write(refreshed_at=_now(), released_at=_now())

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                holder = self._holder()
                if holder and holder.get("id") != self._record["id"]:
                    log.error("node: node %s (on %s) took over the object-tier lease of run %s: this node stalled "
                              "past %.0f s; stop one of them", holder.get("node"), holder.get("host"), self.run, STALE_S)
                    return
                self._write(refreshed_at=_now())
            except Exception as e:  # noqa: BLE001 - the object store may be briefly unreachable; next refresh retries
                log.warning("node: cannot refresh the object-tier lease of run %s: %s", self.run, e)

    def _holder(self) -> dict[str, Any]:
        raw = self.tier.get_record(self.NAME)
        try:
            record = json.loads(raw) if raw else {}
        except ValueError:
            return {}
        return record if isinstance(record, dict) else {}

    def _write(self, **fields: Any) -> None:
        self.tier.put_record(self.NAME, json.dumps({**self._record, **fields}, indent=1).encode() + b"\n")


def _parse(stamp: Any) -> float:
    """Unix seconds of an ISO time in a lease record (0: none or unreadable, i.e. stale)."""
    try:
        return dt.datetime.fromisoformat(stamp).timestamp()
    except (TypeError, ValueError):
        return 0.0
