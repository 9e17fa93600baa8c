"""Bounds on the node's listeners (push and HTTP): how long a connection may take, how many may be open.

Every socket the node accepts is either doing something or closed within a bound: a connection must
send a complete push frame header or HTTP request head within ``header_timeout_s`` (of connecting, or of
the previous frame); only a trainer whose push was accepted may then sit idle between saves, up to
``idle_timeout_s``.  Each listener holds at most ``max_connections`` at once; one more is answered with a
short refusal and closed at once, and counted.  So a flood of half-open or silent connections costs the
node a bounded number of file descriptors for a bounded time, and never its ability to answer.
``BoundedTCPServer`` is the push listener's socket server, ``capped_site`` the control API's aiohttp site;
each receiver applies the timeouts to its own protocol.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    """A node's ``serve.header_timeout_s``, ``idle_timeout_s`` and ``max_connections``, as its listeners use them."""

    header_timeout_s: float = 10.0
    idle_timeout_s: float = 900.0
    max_connections: int = 256
    header_memory_bytes: int = 256 << 20  # push frame headers being read at once, over all connections

    @classmethod
    def of(cls, serve: Any) -> ConnectionLimits:
        """The limits a ``ServeConfig`` sets."""
        return cls(serve.header_timeout_s, serve.idle_timeout_s, serve.max_connections,
                   int(serve.header_memory_mib * (1 << 20)))


class HeaderMemory:
    """The bytes of push frame headers the node reads and parses at once, bounded over all connections: a header
    waits for room (until its connection's header deadline), so a flood of large headers cannot exhaust the node."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, nbytes: int, deadline: float) -> Iterator[None]:
        """Room for ``nbytes`` while the block runs; TimeoutError if none frees by ``deadline``."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.used + nbytes <= self.limit,
                                       timeout=max(deadline - time.monotonic(), 0)):
                raise TimeoutError(f"no room to read a {nbytes}-byte frame header: {self.used} of {self.limit} bytes "
                                   "(serve.header_memory_mib) in use by other connections")
            self.used += nbytes
        try:
            yield
        finally:
            with self._cond:
                self.used -= nbytes
                self._cond.notify_all()


FD_RESERVE = 256  # descriptors the node needs besides its connections: tier files, zarr writers, the object store


def check_fd_limit(limits: ConnectionLimits) -> None:
    """Warn when both listeners at their cap would leave the node fewer than FD_RESERVE descriptors (``ulimit -n``)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * limits.max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning("node: the file descriptor limit (ulimit -n %d) is below 2 x serve.max_connections (%d) + %d for "
                    "the node's own files: raise it to %d or lower serve.max_connections", soft,
                    limits.max_connections, FD_RESERVE, need)


@dataclass
class ListenerStats:
    """Connections of one listener: open now, refused at the cap, closed for taking too long (counters)."""

    open: int = 0
    refused: int = 0
    timed_out: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def admit(self, limit: int) -> bool:
        """Count a new connection in, unless ``limit`` are open already (then count it refused)."""
        with self._lock:
            if self.open >= limit:
                self.refused += 1
                return False
            self.open += 1
            return True

    def closed(self) -> None:
        with self._lock:
            self.open -= 1

    def timeout(self) -> None:
        """Count a connection closed for taking too long (``closed`` counts it out as well)."""
        with self._lock:
            self.timed_out += 1

    def as_json(self) -> dict[str, int]:
        return {"open": self.open, "refused": self.refused, "timed_out": self.timed_out}


class BoundedTCPServer(socketserver.ThreadingTCPServer):
    """A thread per connection, at most ``limits.max_connections`` of them: one more is told so by ``busy(sock,
    limit)`` (without blocking) and closed at once.  ``name`` starts its log lines ("push")."""

    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 128  # a burst of connects waits in the kernel, not refused by a 5-deep backlog

    def __init__(self, address, handler, limits: ConnectionLimits, stats: ListenerStats, *, name: str,
                 busy: Callable[[socket.socket, int], None]) -> None:
        self.limits, self.connections, self.name, self.busy = limits, stats, name, busy
        super().__init__(address, handler)

    def get_request(self):
        try:
            return super().get_request()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                log.warning("%s: cannot accept a connection: %s (serve.max_connections above the fd limit?)",
                            self.name, e)
                time.sleep(0.1)  # the listener stays readable: without a pause the accept loop would spin
            raise

    def process_request(self, request, client_address) -> None:
        if not self.connections.admit(self.limits.max_connections):
            log.warning("%s: connection from %s:%s refused: %d open, the limit (serve.max_connections)", self.name,
                        *client_address[:2], self.limits.max_connections)
            with contextlib.suppress(OSError):
                request.setblocking(False)  # a peer that reads nothing cannot hold the accept loop
                self.busy(request, self.limits.max_connections)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread for it (RuntimeError: can't start new thread): it is not served
            self.connections.closed()
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.closed()

    def handle_error(self, request, client_address) -> None:
        # socketserver would print the traceback to stderr, past the log's rate limit and format
        log.warning("%s: connection from %s:%s failed", self.name, *client_address[:2], exc_info=True)


_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: application/json\r\n"
         b"Content-Length: %d\r\n\r\n%s")


def capped_site(runner, host: str, port: int, limit: int, stats: ListenerStats, *, name: str):
    """An aiohttp TCP site serving at most ``limit`` connections; one more is answered 503 and closed at once.

    Counted by a protocol wrapper of our own, not aiohttp's list of connections: asyncio accepts a burst of
    connections before any of them is registered there, so that list would let a burst past the limit."""
    from aiohttp import web

    body = json.dumps({"error": f"node busy: {limit} {name} connections open (serve.max_connections); "
                                "retry later"}).encode()

    class Refused(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            transport.write(_BUSY % (len(body), body))
            transport.close()

    class Site(web.TCPSite):
        async def start(self) -> None:
            await web.BaseSite.start(self)  # registers the site with its runner
            server = self._runner.server

            def connection() -> asyncio.Protocol:
                if stats.admit(limit):
                    return _Counted(server(), stats)
                log.warning("%s: a connection refused: %d open, the limit (serve.max_connections)", name, limit)
                return Refused()

            self._server = await asyncio.get_running_loop().create_server(connection, self._host, self._port,
                                                                          backlog=self._backlog)

    return Site(runner, host, port, backlog=128)


class _Counted(asyncio.Protocol):
    """aiohttp's request handler for one connection, counted in ``stats`` until the connection is lost."""

    def __init__(self, handler: asyncio.Protocol, stats: ListenerStats) -> None:
        self.handler, self.stats = handler, stats

    def connection_made(self, transport) -> None:
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.handler.data_received(data)

    def eof_received(self):
        return self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()

    def connection_lost(self, exc) -> None:
        self.stats.closed()
        self.handler.connection_lost(exc)
