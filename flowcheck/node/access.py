"""Who may call the control API: Host and Origin checks, JSON-only POSTs, and the node's bearer token.

Checked in this order, so a browser page can do nothing whatever the token: a ``Host`` that is not this
node's address is refused (403: DNS rebinding points an attacker's name at 127.0.0.1), as is an ``Origin``
that is not the node's own (403: a page elsewhere posting cross-origin); a POST must carry
``Content-Type: application/json`` or no body at all (415: HTML forms and ``text/plain`` "simple requests"
skip CORS preflights).  Then, with a token, a POST needs ``Authorization: Bearer <token>`` (401), compared
in constant time; a GET needs it from a non-loopback peer, or whenever one is presented.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import socket
from typing import Any

_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}
_WILDCARD = {"", "0.0.0.0", "::"}


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1); a name is not resolved."""
    host = host.strip("[]").lower()
    if host in _LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def allowed_hosts(bound: str) -> set[str]:
    """Host names (lower case, no port) a request may name besides loopback: the bound address; on a wildcard
    bind also this machine's names (any IP literal is accepted then too: an address cannot be rebound)."""
    bound = bound.strip("[]").lower()
    if bound not in _WILDCARD:
        return {bound}
    return {socket.gethostname().lower(), socket.getfqdn().lower()}


def _host_name(host_header: str) -> str:
    """``[::1]:7378`` -> ``::1``; ``node1:7378`` -> ``node1``."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def refusal(request: Any, token: str | None, bound: str, names: set[str]) -> tuple[int, str] | None:
    """(HTTP status, reason) when ``request`` must be refused, else None."""
    host_header = request.headers.get("Host")
    if host_header is not None:
        host = _host_name(host_header)
        if not (is_loopback(host) or host in names or (bound.strip("[]") in _WILDCARD and _ip_literal(host))):
            return 403, (f"Host {host_header!r} is not this node's address (a DNS-rebound name?); "
                         f"call it by {bound or 'its address'} or localhost")
    origin = request.headers.get("Origin")
    if origin is not None and (host_header is None or origin.lower() != f"http://{host_header}".lower()):
        return 403, f"cross-origin request from {origin!r} refused: the control API takes no requests from web pages"
    if request.method == "POST":
        ctype = request.headers.get("Content-Type")
        has_body = bool(request.content_length) or "chunked" in request.headers.get("Transfer-Encoding", "").lower()
        if ctype is not None and ctype.split(";", 1)[0].strip().lower() != "application/json":
            return 415, f"a POST takes Content-Type: application/json (or no body), found {ctype!r}"
        if ctype is None and has_body:
            return 415, "a POST with a body needs Content-Type: application/json"
    if token is None:
        return None
    presented = request.headers.get("Authorization")
    if request.method in ("GET", "HEAD") and presented is None and is_loopback(request.remote or ""):
        return None  # read-only pages stay open on loopback
    scheme, _, value = (presented or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
        return 401, ("unauthorised: this node requires 'Authorization: Bearer <token>' with the token from its "
                     "environment (missing or wrong)")
    return None


def middleware(token: str | None, bound: str):
    """The aiohttp middleware applying ``refusal`` to every request."""
    from aiohttp import web

    names = allowed_hosts(bound)

    @web.middleware
    async def guard(request, handler):
        refused = refusal(request, token, bound, names)
        if refused is None:
            return await handler(request)
        status, reason = refused
        headers = {"WWW-Authenticate": 'Bearer realm="flowcheck"'} if status == 401 else None
        return web.Response(text=json.dumps({"error": reason}), status=status, content_type="application/json",
                            headers=headers)

    return guard
