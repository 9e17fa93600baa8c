"""Requests to a node's control API from Python (the demo, the benchmarks, tests), with the node's token."""
from __future__ import annotations

import urllib.request


def control_request(url: str, method: str = "GET", *, token: str | None = None) -> urllib.request.Request:
    """A request for ``url`` (``http://HOST:PORT/path``) the node's access checks take: a POST carries
    ``Content-Type: application/json`` and no body (urllib would label it a form), and ``token`` goes in
    ``Authorization: Bearer`` (pass ``read_token(config.serve.auth_token_env)``)."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    data = None
    if method == "POST":
        headers["Content-Type"] = "application/json"
        data = b""
    return urllib.request.Request(url, method=method, data=data, headers=headers)
