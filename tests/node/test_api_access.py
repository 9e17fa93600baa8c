"""The control API as an attacker calls it, against a real node: no token, a web page's requests, a rebound name.

POST /resync marks the RAM state stale (the node then refuses to snapshot it) — the write a browser on
the host could make before.  Every refused request here is checked to have left the state as it was.
"""
from __future__ import annotations

import http.client
import json
import socket

import pytest
import yaml

from flowcheck.capture.push.auth import DEFAULT_TOKEN_ENV
from flowcheck.config import load
from flowcheck.errors import ConfigError

from ..capture.conftest import NodeProcess


def call(node: NodeProcess, method: str, path: str, headers: dict | None = None, body: bytes | None = None,
         host: str = "127.0.0.1") -> tuple[int, dict | str]:
    """One raw HTTP request, headers exactly as given (http.client adds Host unless one is given)."""
    conn = http.client.HTTPConnection(host, node.http_port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        text = r.read().decode()
    finally:
        conn.close()
    return r.status, json.loads(text) if text.startswith("{") else text


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def node(tmp_path):
    n = NodeProcess(str(tmp_path)).start()
    yield n
    n.stop()


def _not_stale(node: NodeProcess) -> None:
    status = node.get("/status")
    assert status["resync"] is None and not status["memory"]["stale"], status


def test_a_post_without_the_token_or_with_a_wrong_one_is_401(node):
    assert call(node, "POST", "/resync")[0] == 401
    code, body = call(node, "POST", "/resync", bearer("not-the-nodes-token-0123456"))
    assert code == 401 and "Authorization: Bearer" in body["error"]
    assert call(node, "POST", "/resync", {"Authorization": f"Basic {node.token}"})[0] == 401
    assert call(node, "POST", "/snapshot")[0] == 401
    _not_stale(node)
    code, body = call(node, "POST", "/resync", bearer(node.token))
    assert code == 200 and body["resync"]["reason"] == "requested over the control API"
    assert node.get("/status")["resync"] is not None


def test_a_web_page_cannot_post_even_with_the_token(node):
    """A foreign Origin (a page elsewhere), a form or text/plain body (CORS "simple requests"), a rebound
    Host: refused whatever the token."""
    auth = bearer(node.token)
    code, body = call(node, "POST", "/resync", {**auth, "Origin": "http://evil.example"})
    assert code == 403 and "cross-origin" in body["error"]
    assert call(node, "POST", "/resync", {**auth, "Origin": "null"})[0] == 403
    code, body = call(node, "POST", "/resync", {**auth, "Content-Type": "text/plain"}, b"x")
    assert code == 415 and "application/json" in body["error"]
    assert call(node, "POST", "/resync", {**auth, "Content-Type": "application/x-www-form-urlencoded"}, b"a=1")[0] == 415
    assert call(node, "POST", "/resync", {**auth, "Content-Type": "multipart/form-data; boundary=x"}, b"--x--")[0] == 415
    assert call(node, "POST", "/resync", {**auth, "Content-Length": "2"}, b"{}")[0] == 415  # a body, no type
    code, body = call(node, "POST", "/resync", {**auth, "Host": f"evil.example:{node.http_port}"})
    assert code == 403 and "DNS-rebound" in body["error"]
    code, _ = call(node, "GET", "/status", {"Host": f"rebind.evil.example:{node.http_port}"})
    assert code == 403  # a rebound page cannot read the status either
    _not_stale(node)
    # what a legitimate client sends: same-origin or no Origin, JSON or no body, a local Host, the token
    assert call(node, "POST", "/resync", {**auth, "Origin": f"http://127.0.0.1:{node.http_port}"})[0] == 200
    assert call(node, "POST", "/resync?reason=test", {**auth, "Content-Type": "application/json"}, b"{}")[0] == 200
    assert call(node, "POST", "/resync", {**auth, "Host": f"localhost:{node.http_port}"})[0] == 200
    assert node.get("/status")["resync"]["reason"] == "requested over the control API"


def test_reads_stay_open_on_loopback_and_take_the_token(node):
    for path in ("/status", "/metrics", "/steps"):
        assert call(node, "GET", path)[0] == 200, path
        assert call(node, "GET", path, bearer(node.token))[0] == 200, path
        assert call(node, "GET", path, bearer("a-wrong-token-for-this-node-0"))[0] == 401, path
    status = call(node, "GET", "/status")[1]
    assert status["auth"] == "token" and node.token not in json.dumps(status)
    assert node.token not in call(node, "GET", "/metrics")[1]
    assert node.token not in node.tail()


def _outward_address() -> str | None:
    """A non-loopback address of this host (the one its default route uses), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent, the kernel only picks a route
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_beyond_loopback_reads_need_the_token_too(tmp_path):
    addr = _outward_address()
    if addr is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    node = NodeProcess(str(tmp_path))
    with open(node.config) as f:
        text = f.read().replace(f"http: 127.0.0.1:{node.http_port}", f"http: 0.0.0.0:{node.http_port}")
    with open(node.config, "w") as f:
        f.write(text)
    node.start()
    try:
        assert call(node, "GET", "/status", host=addr)[0] == 401
        assert call(node, "GET", "/status", bearer(node.token), host=addr)[0] == 200
        assert call(node, "GET", "/status")[0] == 200  # on loopback it stays open
    finally:
        node.stop()


def test_a_node_without_a_token_keeps_loopback_behaviour_but_still_refuses_web_pages(tmp_path):
    node = NodeProcess(str(tmp_path), env={DEFAULT_TOKEN_ENV: None}).start()
    try:
        assert call(node, "POST", "/resync", {"Origin": "http://evil.example"})[0] == 403
        assert call(node, "POST", "/resync", {"Content-Type": "text/plain"}, b"x")[0] == 415
        assert call(node, "POST", "/resync", {"Host": "evil.example"})[0] == 403
        _not_stale(node)
        assert call(node, "POST", "/resync")[0] == 200  # loopback, no token configured: today's behaviour
    finally:
        node.stop()


@pytest.mark.parametrize("listener", ["push", "http"])
def test_a_node_without_a_token_refuses_to_listen_beyond_loopback(tmp_path, monkeypatch, listener):
    from flowcheck.node.service import Node

    monkeypatch.delenv(DEFAULT_TOKEN_ENV)
    serve = {"push": "127.0.0.1:0", "http": "127.0.0.1:0", listener: "0.0.0.0:0"}
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump({"run": "r1", "tiers": {"local": {"root": str(tmp_path / "local")}}, "serve": serve}))
    with pytest.raises(ConfigError, match=rf"serve\.{listener} \(0\.0\.0\.0:0\): not a loopback address.*"
                                          rf"export {DEFAULT_TOKEN_ENV}="):
        Node(load(str(path)))
    monkeypatch.setenv(DEFAULT_TOKEN_ENV, "short")
    with pytest.raises(ConfigError, match="at least 16 characters"):
        Node(load(str(path)))
    monkeypatch.setenv(DEFAULT_TOKEN_ENV, "a-token-of-enough-length-42")
    node = Node(load(str(path))).start()  # with a token it may
    try:
        assert node.status()["auth"] == "token"
    finally:
        node.stop()
