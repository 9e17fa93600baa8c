"""A node under a connection flood: half-sent HTTP requests and silent push connections are closed in bounded
time, excess ones refused at once; /status answers, a trainer's push lands bit-exact, the log stays small and
a client's text cannot forge a log line (flowcheck/node/limits.py, flowcheck/logs.py)."""
from __future__ import annotations

import os
import re
import socket
import time
import urllib.parse

import numpy as np
import torch

from flowcheck.torch.checkpointer import Checkpointer
from tests.capture.conftest import NodeProcess
from tests.capture.test_push_node import _expected, _model, _stored, _train_step

HEADER_TIMEOUT_S = 5.0
CAP = 200


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _until(check, timeout: float, every: float = 0.2):
    """``check()``'s first truthy result within ``timeout`` seconds, else AssertionError with its last one."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError as e:  # a refused or reset request while the flood holds the listener
            last = e
        if last and not isinstance(last, OSError):
            return last
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s: {last!r}")


def _flood(node: NodeProcess) -> list[socket.socket]:
    """300 HTTP requests cut off mid-head (50 of them: a complete head with a missing body), 300 silent push connections."""
    socks = []
    for i in range(300):
        s = socket.create_connection(("127.0.0.1", node.http_port))
        if i < 50:
            s.sendall(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\npartial body")
        else:
            s.sendall(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: never fini")
        socks.append(s)
    for _ in range(300):
        socks.append(socket.create_connection(("127.0.0.1", node.push_port)))
    return socks


def test_a_flood_of_half_sent_requests_and_silent_connections_never_blocks_the_node_nor_fills_its_log(tmp_path):
    node = NodeProcess(str(tmp_path), nofile=1024,
                       serve={"header_timeout_s": HEADER_TIMEOUT_S, "max_connections": CAP}).start()
    socks = []
    try:
        pid = node.proc.pid
        fds_before, log_before = _fds(pid), os.path.getsize(node.log_path)
        t0 = time.monotonic()
        socks = _flood(node)
        _until(lambda: _fds(pid) > fds_before + CAP, 30, every=0.05)  # the node accepted them, up to its cap each
        # the control API answers within a bound: the flood's connections are closed after header_timeout_s
        _until(lambda: node.get("/status"), 3 * HEADER_TIMEOUT_S + 5)
        # and a trainer's push lands, bit for bit (a save refused while the listener is full is retried)
        model, opt = _model()
        gen = torch.Generator().manual_seed(11)
        ck = Checkpointer(model, opt, node=node.url, run="gpt", transport="tcp", timeout_s=5)
        step = 0

        def pushed():
            nonlocal step
            step += 1
            _train_step(model, opt, gen)
            ck.save(step)
            return ck.flush(10) and ck._job.error is None

        _until(pushed, 3 * HEADER_TIMEOUT_S + 10, every=0.5)
        ck.close()
        node.wait_step(step)
        want, got = _expected(model, opt), _stored(node, step)
        assert set(want) == set(got) and all(np.array_equal(want[n], got[n]) for n in want)
        assert time.monotonic() - t0 < 180  # bounded (generous: a loaded 2-core CI machine runs slow)
        # every connection of the flood is closed by the node, its descriptors freed (ours are still open)
        _until(lambda: _fds(pid) <= fds_before + 5, 3 * HEADER_TIMEOUT_S + 5)
        conns = node.get("/status")["connections"]
        assert conns["http"]["refused"] >= 300 - CAP, conns
        # every silent push connection was refused at the cap or timed out (how many of each depends on how fast
        # the node accepts them on a loaded machine: early ones may time out before the last arrive)
        assert conns["push"]["refused"] + conns["push"]["timed_out"] >= 300, conns
        metrics = node.get("/metrics")["text"]
        assert re.search(r'flowcheck_connections_refused_total\{listener="http"\} [1-9]', metrics)
    finally:
        for s in socks:
            s.close()
        node.stop()
    grown = os.path.getsize(node.log_path) - log_before
    log = open(node.log_path, errors="replace").read()
    assert grown < 1 << 20, f"the node wrote {grown} bytes of log"
    refusals = [line for line in log.splitlines()
                if "push: connection from" in line and "refused" in line and "suppressed" not in line]
    assert 1 <= len(refusals) <= 10, refusals[:12]  # the same warning at most 10 times a minute ...
    assert re.search(r"suppressed \d+ similar messages .*push: connection from", log), log[-3000:]  # ... then counted


def test_a_silent_push_connection_is_closed_after_the_header_timeout_and_a_trainers_idle_one_is_reopened(tmp_path):
    node = NodeProcess(str(tmp_path), serve={"header_timeout_s": 1.0, "idle_timeout_s": 1.5}).start()
    try:
        silent = socket.create_connection(("127.0.0.1", node.push_port))
        silent.settimeout(10)
        t0 = time.monotonic()
        assert silent.recv(1) == b""  # the node closed it
        assert 0.8 < time.monotonic() - t0 < 30  # closed after header_timeout_s, not left open
        silent.close()
        model, opt = _model()
        gen = torch.Generator().manual_seed(12)
        ck = Checkpointer(model, opt, node=node.url, run="gpt", transport="tcp", timeout_s=5)
        for step in (1, 2):
            _train_step(model, opt, gen)
            assert ck.save(step)
            assert ck.flush(10), ck.stats.last_error
            time.sleep(3)  # past idle_timeout_s: the node closes the trainer's connection between the saves
        assert ck.stats.failures == 0, ck.stats.last_error  # the second save reconnected instead of failing
        ck.close()
        node.wait_step(2)
        assert node.get("/status")["connections"]["push"]["timed_out"] >= 2
    finally:
        node.stop()


def test_a_resync_reason_with_a_newline_is_logged_escaped_on_one_line(tmp_path):
    node = NodeProcess(str(tmp_path)).start()
    try:
        forged = "disk full\n[ERROR] forged: node compromised\r\n2026-01-01 00:00:00,000 ERROR fake"
        status, body = node.post("/resync?reason=" + urllib.parse.quote(forged))
        assert status == 200, body
        assert "\n" not in body["resync"]["reason"] and "\\n[ERROR] forged" in body["resync"]["reason"]
    finally:
        node.stop()
    lines = open(node.log_path, errors="replace").read().splitlines()
    assert not any(line.startswith(("[ERROR] forged", "2026-01-01")) for line in lines), lines
    logged = [line for line in lines if "resync) requested" in line]
    assert len(logged) == 1 and "disk full\\n[ERROR] forged: node compromised\\r\\n2026-01-01" in logged[0], logged
