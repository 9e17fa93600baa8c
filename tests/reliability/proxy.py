"""A fault-injecting HTTP reverse proxy for S3 tests: 500, 503 SlowDown, resets, stalls, truncated bodies.

It runs an aiohttp server on 127.0.0.1 in its own thread and event loop and forwards every
request to an upstream (the moto S3 server).  Each request draws from a seeded RNG whether,
and how, it fails; ``Faults`` sets a rate per kind and may restrict faults to some requests.
Counters record every request and every injected fault by kind and by S3 operation, so a
test can report "faults injected / survived".

    with FaultProxy(moto_url, Faults(error_500=0.05, reset=0.05), seed=1) as proxy:
        ... point the client at proxy.url ...
        proxy.set_faults(Faults())  # heal
"""
from __future__ import annotations

import asyncio
import random
import re
import threading
from collections import Counter
from dataclasses import dataclass

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web
from yarl import URL

KINDS = ("500", "503", "reset", "stall", "truncate")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "expect",
               "proxy-connection", "content-length"}
_ERROR = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
          "<RequestId>FAULTPROXY{n:08d}</RequestId><HostId>faultproxy</HostId></Error>")


@dataclass(frozen=True)
class Faults:
    """Per-request probabilities of each fault (their sum at most 1) and where they apply.

    ``stall_s``: how long a stalled request hangs before the proxy gives up on it (longer than
    the client's read timeout).  ``after_apply``: the fraction of resets and truncations that
    strike after upstream carried the request out (the client cannot tell it did).  ``methods`` /
    ``path``: only requests with one of these HTTP methods / whose path+query matches this regex
    can fail (None: any).  ``max_faults``: stop injecting after this many (None: never stop).
    """

    error_500: float = 0.0
    slowdown_503: float = 0.0
    reset: float = 0.0
    stall: float = 0.0
    truncate: float = 0.0
    stall_s: float = 5.0
    after_apply: float = 0.5
    max_faults: int | None = None
    methods: frozenset[str] | None = None
    path: str | None = None

    @classmethod
    def mixed(cls, rate: float, **kw) -> Faults:
        """``rate`` of all requests fail, spread evenly over the five kinds."""
        each = rate / len(KINDS)
        return cls(each, each, each, each, each, **kw)

    @classmethod
    def everything(cls, kind: str, **kw) -> Faults:
        """Every request fails with one kind."""
        return cls(**{_FIELD[kind]: 1.0}, **kw)

    def rates(self) -> list[tuple[str, float]]:
        return [(k, getattr(self, _FIELD[k])) for k in KINDS]

    def applies(self, method: str, path_qs: str) -> bool:
        if self.methods is not None and method not in self.methods:
            return False
        return self.path is None or re.search(self.path, path_qs) is not None


_FIELD = {"500": "error_500", "503": "slowdown_503", "reset": "reset", "stall": "stall", "truncate": "truncate"}


def operation(method: str, query: dict, headers) -> str:
    """The S3 operation of a request, from its method, query and headers (for the counters)."""
    if method == "PUT":
        if "partNumber" in query:
            return "UploadPart"
        if "x-amz-copy-source" in headers:
            return "CopyObject"
        return "PutObject(If-None-Match)" if headers.get("If-None-Match") == "*" else "PutObject"
    if method == "POST":
        if "uploads" in query:
            return "CreateMultipartUpload"
        if "uploadId" in query:
            return "CompleteMultipartUpload"
        return "DeleteObjects" if "delete" in query else "POST"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in query else "DeleteObject"
    if method == "GET":
        if "uploads" in query:
            return "ListMultipartUploads"
        if "list-type" in query or "prefix" in query or "delimiter" in query:
            return "ListObjects"
        return "GetObject(range)" if "Range" in headers else "GetObject"
    return method  # HEAD and anything else


class FaultProxy:
    """A reverse proxy on 127.0.0.1 injecting faults into a configurable fraction of requests."""

    def __init__(self, upstream: str, faults: Faults | None = None, *, seed: int = 0) -> None:
        self.upstream = upstream.rstrip("/")
        self._faults = faults or Faults()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # operation -> requests seen
        self.methods: Counter[str] = Counter()  # HTTP method -> requests seen
        self.injected: Counter[str] = Counter()  # fault kind -> times injected
        self.injected_by_op: Counter[tuple[str, str]] = Counter()  # (operation, kind) -> times injected
        self.applied_then_failed = 0  # resets/truncations after upstream carried the request out
        self._base = 0
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake: asyncio.Event | None = None

    # ---- control (any thread) ---------------------------------------------------
    def set_faults(self, faults: Faults) -> None:
        """Change the faults from now on; stalled requests are released (and dropped) at once."""
        with self._lock:
            self._faults = faults
            self._base = sum(self.injected.values())  # max_faults counts from here
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._release_stalls)

    def heal(self) -> None:
        self.set_faults(Faults())

    def totals(self) -> dict:
        """A plain summary: requests by operation and method, faults by kind and by operation."""
        with self._lock:
            return {
                "requests": sum(self.requests.values()),
                "by_method": dict(self.methods),
                "by_operation": dict(self.requests),
                "faults": dict(self.injected),
                "faults_total": sum(self.injected.values()),
                "faults_by_operation": {f"{op} {kind}": n for (op, kind), n in sorted(self.injected_by_op.items())},
                "applied_then_failed": self.applied_then_failed,
            }

    def start(self) -> FaultProxy:
        ready = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._serve, args=(ready, failure), name="fault-proxy", daemon=True)
        self._thread.start()
        ready.wait(30)
        if failure or not self.url:
            raise RuntimeError(f"fault proxy did not start: {failure[0] if failure else 'timeout'}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None and not self._loop.is_closed():
            self.set_faults(Faults())
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(30)
        self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- the server (its own thread and loop) -------------------------------------
    _stopping: asyncio.Event | None = None

    def _serve(self, ready: threading.Event, failure: list) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main(ready))
        except BaseException as e:  # noqa: BLE001 - reported to start()
            failure.append(e)
            ready.set()
        finally:
            loop.close()

    async def _main(self, ready: threading.Event) -> None:
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        async with ClientSession(connector=TCPConnector(limit=128), auto_decompress=False,
                                 timeout=ClientTimeout(total=120)) as session:
            self._session = session
            ready.set()
            await self._stopping.wait()
            await runner.cleanup()

    def _draw(self, method: str, op: str, path_qs: str) -> tuple[str | None, bool, Faults]:
        """(fault kind or None, whether it strikes after upstream applied the request, the faults)."""
        with self._lock:
            faults = self._faults
            self.requests[op] += 1
            self.methods[method] += 1
            if not faults.applies(method, path_qs) or (
                    faults.max_faults is not None and sum(self.injected.values()) - self._base >= faults.max_faults):
                return None, False, faults
            x, after = self._rng.random(), self._rng.random() < faults.after_apply
            for kind, rate in faults.rates():
                if x < rate:
                    return kind, after, faults
                x -= rate
            return None, False, faults

    def _count(self, kind: str, op: str, applied: bool = False) -> None:
        with self._lock:
            self.injected[kind] += 1
            self.injected_by_op[(op, kind)] += 1
            self.applied_then_failed += applied

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        op = operation(request.method, request.query, request.headers)
        kind, after, faults = self._draw(request.method, op, request.path_qs)
        if kind in ("500", "503"):
            self._count(kind, op)
            return self._error(request, kind)
        if kind == "stall":
            self._count(kind, op)
            await self._stall(faults.stall_s)
            if request.transport is None or request.transport.is_closing():
                raise asyncio.CancelledError  # the client gave up: nothing to answer
            kind = None  # still connected after the stall: answer late, for real
        if kind == "reset" and not after:
            self._count(kind, op)
            return self._reset(request)
        status, headers, payload = await self._forward(request, body)
        if kind == "reset":
            self._count(kind, op, applied=True)
            return self._reset(request)
        if kind == "truncate" and len(payload) >= 2 and request.method != "HEAD":
            self._count(kind, op, applied=True)
            return await self._truncated(request, status, headers, payload)
        resp = web.StreamResponse(status=status, headers=headers)
        if request.method != "HEAD":
            resp.content_length = len(payload)
        await resp.prepare(request)
        if request.method != "HEAD":
            await resp.write(payload)
        await resp.write_eof()
        return resp

    async def _forward(self, request: web.Request, body: bytes):
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        url = URL(self.upstream + request.raw_path, encoded=True)
        async with self._session.request(request.method, url, headers=headers, data=body,
                                         skip_auto_headers=("Content-Type", "Accept-Encoding", "User-Agent")) as up:
            payload = await up.read()
            out = [(k, v) for k, v in up.headers.items() if k.lower() not in _HOP_BY_HOP]
            if request.method == "HEAD" and "Content-Length" in up.headers:
                out.append(("Content-Length", up.headers["Content-Length"]))  # HEAD's size is the object's
            return up.status, out, payload

    async def _stall(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    def _release_stalls(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()  # stalls from now on wait on a fresh event

    def _error(self, request: web.Request, kind: str) -> web.Response:
        code, message, status = (("InternalError", "We encountered an internal error. Please try again.", 500)
                                 if kind == "500" else ("SlowDown", "Please reduce your request rate.", 503))
        text = "" if request.method == "HEAD" else _ERROR.format(code=code, message=message, n=sum(self.injected.values()))
        return web.Response(status=status, text=text, content_type="application/xml")

    @staticmethod
    def _reset(request: web.Request) -> web.Response:
        if request.transport is not None:
            request.transport.abort()  # RST-like: the connection dies with no response
        raise asyncio.CancelledError

    async def _truncated(self, request: web.Request, status: int, headers, payload: bytes) -> web.StreamResponse:
        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_length = len(payload)  # promise the whole body ...
        await resp.prepare(request)
        await resp.write(payload[: self._cut(len(payload))])  # ... send part of it, then hang up
        request.transport.abort()
        raise asyncio.CancelledError

    def _cut(self, n: int) -> int:
        with self._lock:
            return self._rng.randrange(1, n)
