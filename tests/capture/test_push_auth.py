"""Only holders of the node's token write its state: pushes as an attacker sends them, against a real node.

The issue's attack: a local process sent a one-tensor "backdoor" state that the node took into RAM,
snapshotted, signed and made ``latest``.  With ``FLOWCHECK_NODE_TOKEN`` set on the node, that frame, one
signed with another token, a signed frame altered in flight and a captured frame replayed are all refused
before their payload is read, counted in ``flowcheck_push_rejected_total``; RAM and the store keep the
trainer's state.  The authorised trainer's pushes land bit for bit (here and in every push suite).
"""
from __future__ import annotations

import contextlib
import copy
import os
import socket
import struct

import numpy as np
import pytest
import torch
import xxhash

from flowcheck.capture.push.auth import DEFAULT_TOKEN_ENV, UNAUTHENTICATED_HEADER, PushSigner, push_mac
from flowcheck.capture.push.wire import MAGIC, encode_header, recv_header, send_frame
from flowcheck.errors import AuthError
from flowcheck.store import open_store
from flowcheck.torch.checkpointer import Checkpointer, generation_at

from ..node.test_metrics import scrape, value
from .conftest import NodeProcess
from .test_push_node import _expected, _header_like, _model, _stored, _train_step


def _backdoor(step: int = 999) -> tuple[dict, bytes]:
    """A well-formed push of a one-tensor state, as the attacker in the issue sent it."""
    payload = np.full(4, 6.66, dtype=np.float32).tobytes()
    header = {"kind": "push", "run": "gpt", "step": step, "sender": 0, "senders": 1, "source_layout": {},
              "tensors": [{"name": "backdoor", "dtype": "float32", "shape": [4]}],
              "shards": [{"tensor": "backdoor", "offsets": [0], "shape": [4], "at": 0}], "scalars": {},
              "payload": {"bytes": len(payload), "digest": "xxh3-128:" + xxhash.xxh3_128_hexdigest(payload)}}
    return header, payload


def _send(node: NodeProcess, header: dict, payload: bytes | None, hello: dict | None = None) -> dict:
    """One raw connection: an optional hello (the node's answer is ignored), one frame, the node's answer."""
    with socket.create_connection(("127.0.0.1", node.push_port), timeout=20) as s:
        if hello is not None:
            send_frame(s, hello)
            recv_header(s)
        send_frame(s, header, payload)
        return recv_header(s)


def _refused(answer: dict, why: str) -> None:
    assert answer["kind"] == "error" and answer.get("reason") == "unauthorised", answer
    assert why in answer["message"], answer["message"]


@pytest.fixture
def trained(node):
    """A node holding the trainer's step 1 in RAM and in the local tier: (node, model, opt, gen, ck, step-1 digest)."""
    model, opt = _model()
    gen = torch.Generator().manual_seed(11)
    ck = Checkpointer(model, opt, node=node.url, run="gpt", transport="tcp", timeout_s=20)
    _train_step(model, opt, gen)
    ck.save(1)
    assert ck.flush(20), ck.stats.last_error
    node.wait_step(1)
    code, body = node.post("/snapshot")
    assert code == 200 and body["step"] == 1, body
    yield node, model, opt, gen, ck, body["digest"]
    ck.close()


def _unchanged(node: NodeProcess, model, opt, digest: str, rejected: int) -> None:
    """RAM still holds the trainer's step 1 (a snapshot now is the same state), nothing else was stored."""
    status = node.get("/status")
    assert status["memory"]["step"] == 1 and not status["memory"]["stale"], status["memory"]
    assert status["push"]["rejected"] == rejected and status["push"]["steps"] == 1, status["push"]
    assert value(scrape(node), "flowcheck_push_rejected_total") == rejected
    code, body = node.post("/snapshot")
    assert code == 200 and body == {"step": 1, "digest": digest, "tier": "local"}, body
    store = open_store(node.config)
    assert store.local.steps() == [1] and store.locate("latest")[1] == 1
    want, got = _expected(model, opt), _stored(node, 1)
    assert set(got) == set(want) and all(np.array_equal(got[n], want[n]) for n in want)


def test_the_backdoor_push_is_refused_without_the_token_and_ram_and_store_keep_the_trainers_state(trained):
    node, model, opt, _, _, digest = trained
    header, payload = _backdoor()
    # as in the issue: no hello, no signature
    _refused(_send(node, header, payload), "sent no hello on this connection")
    # greeted, but unsigned
    _refused(_send(node, header, payload, hello={"kind": "hello", "run": "gpt", "nonce": "00" * 16}), "not signed")
    # a signature made up without the token
    forged = {**header, "auth": {"seq": 1, "mac": "0" * 64}}
    _refused(_send(node, forged, payload, hello={"kind": "hello", "run": "gpt"}), "signature does not match")
    _unchanged(node, model, opt, digest, rejected=3)
    assert node.token not in node.tail()  # the node never logs its token


def test_a_push_signed_with_another_token_is_refused(trained):
    node, model, opt, _, _, digest = trained
    header, payload = _backdoor()
    with socket.create_connection(("127.0.0.1", node.push_port), timeout=20) as s:
        send_frame(s, {"kind": "hello", "run": "gpt", "nonce": "ab" * 16})
        nonce = recv_header(s)["nonce"]  # the attacker gets a challenge, but signs it with a token of its own
        header["auth"] = {"seq": 1, "mac": push_mac("the-attackers-own-token-0123", nonce, 1, header)}
        send_frame(s, header, payload)
        _refused(recv_header(s), "token differs from the node's")
    _unchanged(node, model, opt, digest, rejected=1)


def test_a_trainer_with_a_wrong_or_no_token_sends_nothing_and_is_told_why(trained, monkeypatch):
    node, model, opt, gen, _, digest = trained
    wrong = Checkpointer(model, opt, node=node.url, run="gpt", timeout_s=10, hook=False,
                         token="not-the-nodes-token-but-long-enough")
    monkeypatch.delenv(DEFAULT_TOKEN_ENV)
    none = Checkpointer(model, opt, node=node.url, run="gpt", timeout_s=10, hook=False)
    _train_step(model, opt, gen)
    try:
        for ck, why in ((wrong, "cannot prove it holds this trainer's token"), (none, f"export {DEFAULT_TOKEN_ENV}")):
            assert ck.save(2)
            assert not ck.flush(20)
            assert "AuthError" in ck.stats.last_error and why in ck.stats.last_error, ck.stats.last_error
            assert node.token not in ck.stats.last_error
    finally:
        wrong.close()
        none.close()
    # each trainer gave up at the handshake, before sending a frame: RAM and the store still hold step 1
    status = node.get("/status")
    assert status["memory"]["step"] == 1 and status["push"]["rejected"] == 0, status
    assert open_store(node.config).local.steps() == [1]
    assert node.post("/snapshot")[1]["digest"] == digest


def test_a_captured_push_replayed_or_altered_is_refused(trained):
    """A valid signed frame of step 2, captured; the trainer moves on to step 3; the capture is replayed on a new
    connection (greeted or not) and on its own, and sent with its step changed: all refused, RAM stays at step 3."""
    node, model, opt, gen, ck, _ = trained
    _train_step(model, opt, gen)
    ck.save(2)
    assert ck.flush(20), ck.stats.last_error
    header = _header_like(ck, step=2)
    view = bytes(memoryview(ck._host.regions[ck._held].numpy())[: ck.stats.buffer_bytes])
    header["payload"]["digest"] = "xxh3-128:" + xxhash.xxh3_128_hexdigest(view)
    with socket.create_connection(("127.0.0.1", node.push_port), timeout=20) as s:
        signer = PushSigner.handshake(s, node.token, "gpt", "node")
        captured = copy.deepcopy(signer.sign(header))
        send_frame(s, captured, view)
        assert recv_header(s)["kind"] == "ack"
        node.wait_step(2)
        _train_step(model, opt, gen)
        ck.save(3)
        assert ck.flush(20), ck.stats.last_error
        node.wait_step(3)
        send_frame(s, captured, view)  # the same frame again on its own connection
        _refused(recv_header(s), "sequence 1, expected 2")
    _refused(_send(node, captured, view), "sent no hello")
    _refused(_send(node, captured, view, hello={"kind": "hello", "run": "gpt"}), "replayed from another connection")
    altered = {**captured, "step": 4}
    _refused(_send(node, altered, view, hello={"kind": "hello", "run": "gpt"}), "the frame was altered")
    status = node.get("/status")
    assert status["memory"]["step"] == 3 and not status["memory"]["stale"] and status["push"]["rejected"] == 4
    want = _expected(model, opt)
    got = _stored(node, 3)
    assert all(np.array_equal(got[n], want[n]) for n in want)


def test_an_altered_shared_memory_header_is_refused(node):
    """The MAC covers the header naming the segment and its generation: pointing a signed frame at another
    segment or generation breaks it (the trainer's own shared-memory pushes land, bit for bit)."""
    model, opt = _model()
    gen = torch.Generator().manual_seed(12)
    with Checkpointer(model, opt, node=node.url, run="gpt", transport="shm", timeout_s=20) as ck:
        _train_step(model, opt, gen)
        ck.save(1)
        assert ck.flush(20), ck.stats.last_error
        node.wait_step(1)
        header = _header_like(ck, step=2)
        held = ck._held  # the segment the node adopted step 1 from
        header["payload"] = {"bytes": header["payload"]["bytes"], "shm": ck._host.segments[held].name,
                             "generation": ck._host.generations[held],
                             "generation_at": generation_at(ck.stats.buffer_bytes)}
        for field, bad in (("shm", "psm_someone_elses"), ("generation", ck._host.generations[held] + 2)):
            with socket.create_connection(("127.0.0.1", node.push_port), timeout=20) as s:
                signed = PushSigner.handshake(s, node.token, "gpt", "node").sign(copy.deepcopy(header))
                signed["payload"][field] = bad
                send_frame(s, signed)
                _refused(recv_header(s), "the frame was altered")
        assert node.get("/status")["memory"]["step"] == 1
        _train_step(model, opt, gen)
        ck.save(2)
        assert ck.flush(20), ck.stats.last_error
        node.wait_step(2)
        want, got = _expected(model, opt), _stored(node, 2)
        assert all(np.array_equal(got[n], want[n]) for n in want)


def test_a_node_without_a_token_warns_takes_any_push_and_a_trainer_with_a_token_will_not_push_to_it(tmp_path,
                                                                                                      monkeypatch):
    """Unset on the node: today's behaviour (loopback only, one warning); the backdoor lands there, which is
    what the token prevents.  A trainer that has a token refuses a node that cannot prove it holds it."""
    node = NodeProcess(str(tmp_path), env={DEFAULT_TOKEN_ENV: None}).start()
    try:
        assert node.get("/status")["auth"] == "none"
        assert node.tail().count("unauthenticated") == 1 and f"${DEFAULT_TOKEN_ENV} is unset" in node.tail()
        header, payload = _backdoor(step=5)
        assert _send(node, header, payload)["kind"] == "ack"
        node.wait_step(5)
        model, opt = _model()
        ck = Checkpointer(model, opt, node=node.url, run="gpt", timeout_s=10, token=os.environ[DEFAULT_TOKEN_ENV])
        try:
            ck.save(6)
            assert not ck.flush(20)
            assert "runs without a token" in ck.stats.last_error, ck.stats.last_error
        finally:
            ck.close()
        monkeypatch.delenv(DEFAULT_TOKEN_ENV)  # unset on the trainer too: today's behaviour
        with Checkpointer(model, opt, node=node.url, run="gpt", timeout_s=10, hook=False) as tokenless:
            tokenless.save(7)
            assert tokenless.flush(20), tokenless.stats.last_error
        node.wait_step(7)
    finally:
        node.stop()


def test_the_handshake_errors_name_the_fix():
    """PushSigner against a node answer that does not fit: the error says what to set."""
    a, b = socket.socketpair()
    with a, b:
        send_frame(b, {"kind": "ack", "nonce": "cd" * 16, "auth": "token", "proof": "0" * 64})
        with pytest.raises(AuthError, match="requires a token"):
            PushSigner.handshake(a, None, "gpt", "node:1")


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def test_a_flood_of_large_unauthenticated_headers_is_refused_unread_and_node_memory_stays_bounded(trained):
    """40 connections announce a 60 MiB header (half of them after a hello, none holding the token): each is refused
    from its first 12 bytes, before the node reads or parses anything, and the node's memory does not grow."""
    node, model, opt, _, _, digest = trained
    before = _rss(node.proc.pid)
    socks = []
    try:
        for i in range(40):
            s = socket.create_connection(("127.0.0.1", node.push_port), timeout=20)
            socks.append(s)
            if i % 2:
                send_frame(s, {"kind": "hello", "run": "gpt", "nonce": "cd" * 16})
                recv_header(s)
            s.sendall(MAGIC + struct.pack("<I", 60 << 20) + b"{" * (256 << 10))
        for s in socks:
            answer = recv_header(s)
            assert answer["kind"] == "error" and "has not authenticated" in answer["message"], answer
            with contextlib.suppress(OSError):
                s.sendall(b"x" * (4 << 20))  # the node reads no more of it: the connection is closed
    finally:
        for s in socks:
            s.close()
    assert _rss(node.proc.pid) - before < 24 << 20
    _unchanged(node, model, opt, digest, rejected=40)


def test_a_wrong_trainer_proof_is_refused_and_a_proven_trainer_sends_headers_past_the_unauthenticated_bound(node):
    with socket.create_connection(("127.0.0.1", node.push_port), timeout=20) as s:
        send_frame(s, {"kind": "hello", "run": "gpt", "nonce": "ef" * 16})
        recv_header(s)
        send_frame(s, {"kind": "auth", "proof": "0" * 64})
        _refused(recv_header(s), "auth refused: the proof does not match")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(150)])
    opt = torch.optim.AdamW(model.parameters())
    with Checkpointer(model, opt, node=node.url, run="gpt", transport="tcp", timeout_s=20) as ck:
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        ck.save(1)
        assert ck.flush(20), ck.stats.last_error
        assert len(encode_header(_header_like(ck, 1))) > UNAUTHENTICATED_HEADER
    node.wait_step(1)
