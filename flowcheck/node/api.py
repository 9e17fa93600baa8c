"""The node's HTTP control API (aiohttp, loopback by default): /status /steps /snapshot /resync /metrics.

Every request passes flowcheck/node/access.py first (Host, Origin, JSON-only POSTs, the bearer token).
Connections are bounded (flowcheck/node/limits.py): aiohttp closes one whose request head is not complete
within ``header_timeout_s`` (its keep-alive timer runs from the connection's start, and between requests),
reads an unread body for at most that long after answering, and the listener serves at most
``max_connections`` at once — one more gets a 503 and is closed at once.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

from flowcheck.errors import FlowcheckError
from flowcheck.node.limits import ConnectionLimits, ListenerStats, capped_site

log = logging.getLogger(__name__)

MAX_BODY = 64 << 10  # no endpoint reads a body; a client cannot make the node buffer more than this


class ControlAPI:
    """Runs an aiohttp app on its own event-loop thread next to the node's worker threads."""

    def __init__(self, node: Any, host: str, port: int, token: str | None = None,
                 limits: ConnectionLimits = ConnectionLimits()) -> None:
        self.node, self.host, self.port = node, host, port
        self._token, self.limits = token, limits
        self.connections = ListenerStats()
        self.loop = asyncio.new_event_loop()
        self.address: tuple[str, int] = (host, port)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="control-api", daemon=True)

    def start(self) -> ControlAPI:
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise FlowcheckError(f"control API cannot listen on {self.host}:{self.port}: {self._error}") from self._error
        return self

    def stop(self) -> None:
        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        from aiohttp import web

        from flowcheck.node.access import middleware

        asyncio.set_event_loop(self.loop)
        app = web.Application(middlewares=[middleware(self._token, self.host)], client_max_size=MAX_BODY)
        app.add_routes([
            web.get("/status", self._status), web.get("/steps", self._steps), web.post("/snapshot", self._snapshot),
            web.get("/resync", self._resync_get), web.post("/resync", self._resync), web.get("/metrics", self._metrics),
        ])
        timeout = self.limits.header_timeout_s
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=timeout, lingering_time=timeout)
        try:
            self.loop.run_until_complete(self._runner.setup())
            site = capped_site(self._runner, self.host, self.port, self.limits.max_connections, self.connections,
                               name="control API")
            self.loop.run_until_complete(site.start())
            self.address = tuple(self._runner.addresses[0][:2])  # the bound port when 0 was asked
        except BaseException as e:  # noqa: BLE001
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    @staticmethod
    def _json(data: Any, status: int = 200):
        from aiohttp import web

        return web.Response(text=json.dumps(data, default=str), status=status, content_type="application/json")

    async def _status(self, request):
        return self._json(self.node.status())

    async def _steps(self, request):
        return self._json(self.node.steps())

    async def _snapshot(self, request):
        """Persist the RAM state to the local tier now (what the policy does every K steps)."""
        try:
            # through the policy's local worker: after a snapshot in flight, timed like the policy's own
            m = await asyncio.get_running_loop().run_in_executor(None, self.node.policy.snapshot_now)
        except FlowcheckError as e:
            log.warning("POST /snapshot refused: %s", e, extra={"event": "snapshot_refused"})
            return self._json({"error": str(e)}, 409)
        return self._json({"step": m.step, "digest": m.digest(), "tier": "local"})

    async def _resync_get(self, request):
        return self._json({"resync": self.node.resync})

    async def _resync(self, request):
        reason = request.query.get("reason", "requested over the control API")
        return self._json({"resync": self.node.request_resync(reason)})

    async def _metrics(self, request):
        from aiohttp import web

        body, content_type = await asyncio.get_running_loop().run_in_executor(None, self.node.metrics)
        return web.Response(body=body, headers={"Content-Type": content_type})
