"""Push authentication: the node's shared token, the per-connection challenge, and each push frame's HMAC.

When the node has a token (``serve.auth_token_env``, ``FLOWCHECK_NODE_TOKEN`` by default) every push must
be signed with it.  A connection opens with the sender's ``hello`` carrying a fresh client nonce; the node
answers with a fresh node nonce and ``proof`` = HMAC(token, both nonces), so a trainer holding the token
never streams its state to a process that merely took the port.  The trainer answers with its own proof over
both nonces (an ``auth`` frame): until it did, the node reads no frame header over a few KiB from the connection
(``UNAUTHENTICATED_HEADER``), so a client without the token cannot make it buffer or parse anything large.
Every push header then carries ``auth: {seq, mac}`` with

    mac = HMAC-SHA256(token, "flowcheck-push-v1" | node nonce | seq | canonical JSON of the header less "auth")

The header names the run, step, sender, every shard and how the payload is checked (its xxh3-128 digest
over TCP; the shared-memory segment and its generation), so the MAC covers what the node will write.  The
node nonce makes a frame captured on one connection worthless on any other; ``seq`` (1, 2, 3, ... within a
connection) refuses a frame replayed inside its own.  No clocks are involved, and a restarted node or
trainer needs no remembered counters: every connection starts a new challenge.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
from typing import Any

from flowcheck.capture.push.wire import MAX_HEADER, recv_header, send_frame
from flowcheck.errors import AuthError, ConfigError, FlowcheckError

DEFAULT_TOKEN_ENV = "FLOWCHECK_NODE_TOKEN"
MIN_TOKEN_CHARS = 16  # a guessable token protects nothing; secrets.token_urlsafe(32) gives 43
_PUSH, _NODE, _TRAINER = b"flowcheck-push-v1\0", b"flowcheck-node-v1\0", b"flowcheck-trainer-v1\0"
# the largest frame header a connection may send before it proved it holds the token (a hello, an auth frame)
UNAUTHENTICATED_HEADER = 16 << 10


def read_token(env_var: str = DEFAULT_TOKEN_ENV) -> str | None:
    """The node token from the environment (never from a file or the config), or None when it is unset/empty."""
    value = os.environ.get(env_var)
    if not value:
        return None
    if len(value) < MIN_TOKEN_CHARS:
        raise ConfigError(f"${env_var}: expected a token of at least {MIN_TOKEN_CHARS} characters, found "
                          f"{len(value)}; make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return value


def canonical(header: dict[str, Any]) -> bytes:
    """The bytes a push MAC covers: the header less ``auth``, JSON with sorted keys and no spaces."""
    body = {k: v for k, v in header.items() if k != "auth"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def push_mac(token: str, node_nonce: str, seq: int, header: dict[str, Any]) -> str:
    msg = _PUSH + node_nonce.encode() + b"\0" + str(seq).encode() + b"\0" + canonical(header)
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def node_proof(token: str, client_nonce: str, node_nonce: str, tag: bytes = _NODE) -> str:
    msg = tag + client_nonce.encode() + b"\0" + node_nonce.encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def trainer_proof(token: str, client_nonce: str, node_nonce: str) -> str:
    """What the trainer's ``auth`` frame carries: HMAC over both nonces under its own tag (never the node's proof)."""
    return node_proof(token, client_nonce, node_nonce, _TRAINER)


class PushGate:
    """The node's side of one push connection: issues the challenge, then checks every push's MAC and sequence."""

    def __init__(self, token: str | None, env_var: str = DEFAULT_TOKEN_ENV) -> None:
        self.token, self.env_var = token, env_var
        self.nonce: str | None = None
        self.client: str | None = None  # the sender's hello nonce
        self.seq = 0
        self.authenticated = token is None  # a node without a token trusts its (loopback) senders

    @property
    def header_limit(self) -> int:
        """The largest frame header the connection may send now."""
        return MAX_HEADER if self.authenticated else UNAUTHENTICATED_HEADER

    def greet(self, hello: dict[str, Any]) -> dict[str, Any]:
        """The fields of the answer to ``hello``: a fresh nonce (restarting the sequence) and, with a token, the proof."""
        self.nonce, self.seq = secrets.token_hex(16), 0
        if self.token is None:
            return {"nonce": self.nonce, "auth": "none"}
        client = hello.get("nonce")
        self.client = client if isinstance(client, str) else None
        proof = node_proof(self.token, client, self.nonce) if self.client is not None else None
        return {"nonce": self.nonce, "auth": "token", "proof": proof}

    def authenticate(self, frame: dict[str, Any]) -> None:
        """Check the sender's ``auth`` frame (its proof over both nonces); AuthError if it does not hold the token."""
        if self.token is None:
            return
        if self.nonce is None or self.client is None:
            raise AuthError("auth refused: send hello (with a nonce) on this connection first")
        proof = frame.get("proof")
        want = trainer_proof(self.token, self.client, self.nonce)
        if not isinstance(proof, str) or not hmac.compare_digest(proof.encode(), want.encode()):
            raise AuthError(f"auth refused: the proof does not match this connection: the trainer's token differs "
                            f"from the node's (check ${self.env_var} on both sides)")
        self.authenticated = True

    def check(self, header: dict[str, Any]) -> None:
        """AuthError unless the push is signed for this connection, in sequence; a no-op on a node without a token."""
        if self.token is None:
            return
        how = f"set ${self.env_var} to the node's token in the trainer's environment (flowcheck.torch.Checkpointer signs)"
        if self.nonce is None:
            raise AuthError(f"push refused: this node requires its token, and the sender sent no hello on this "
                            f"connection, so nothing it sends can be signed; {how}")
        auth = header.get("auth")
        seq = auth.get("seq") if isinstance(auth, dict) else None
        mac = auth.get("mac") if isinstance(auth, dict) else None
        if isinstance(seq, bool) or not isinstance(seq, int) or not isinstance(mac, str):
            raise AuthError(f"push refused: the frame is not signed (expected auth: {{seq, mac}}); {how}")
        try:
            want = push_mac(self.token, self.nonce, seq, header)
        except (TypeError, ValueError) as e:
            raise AuthError(f"push refused: the header cannot be signed ({e})") from e
        if not hmac.compare_digest(mac.encode(), want.encode()):
            raise AuthError("push refused: the signature does not match this connection: the trainer's token differs "
                            "from the node's, the frame was altered, or it is replayed from another connection")
        if seq != self.seq + 1:
            raise AuthError(f"push refused: frame sequence {seq}, expected {self.seq + 1}: a replayed or reordered frame")
        self.seq = seq


class PushSigner:
    """The trainer's side of one push connection: greets the node, checks its proof, signs each push header."""

    def __init__(self, token: str | None, node_nonce: str | None) -> None:
        self.token, self.node_nonce = token, node_nonce
        self.seq = 0
        self.hello: dict[str, Any] = {}  # the node's answer to hello (what it offers, e.g. ``kept_shards``)

    @classmethod
    def handshake(cls, sock: socket.socket, token: str | None, run: str, where: str,
                  env_var: str = DEFAULT_TOKEN_ENV) -> PushSigner:
        """Send ``hello``, read the node's answer; AuthError when the node and this trainer disagree on the token."""
        client = secrets.token_hex(16)
        send_frame(sock, {"kind": "hello", "run": run, "nonce": client})
        answer = recv_header(sock)
        if answer.get("kind") != "ack":
            raise FlowcheckError(f"node at {where} refused the hello: {answer.get('message')}")
        mode, nonce, proof = answer.get("auth", "none"), answer.get("nonce"), answer.get("proof")
        if token is None:
            if mode == "token":
                raise AuthError(f"the node at {where} requires a token: export {env_var}=<the node's token> in the "
                                "trainer's environment (or pass Checkpointer(token=...))")
            return cls(None, None)._greeted(answer)
        if mode != "token" or not isinstance(nonce, str):
            raise AuthError(f"the node at {where} runs without a token, but this trainer has one (${env_var}): it cannot "
                            f"prove it is your node; set the same {env_var} on the node, or unset it here")
        if not isinstance(proof, str) or not hmac.compare_digest(proof.encode(), node_proof(token, client, nonce).encode()):
            raise AuthError(f"the node at {where} cannot prove it holds this trainer's token: the tokens differ "
                            f"(check {env_var} on both sides) or another process holds the port")
        send_frame(sock, {"kind": "auth", "proof": trainer_proof(token, client, nonce)})
        ok = recv_header(sock)
        if ok.get("kind") != "ack":
            raise AuthError(f"the node at {where} refused this trainer's proof: {ok.get('message')}")
        return cls(token, nonce)._greeted(answer)

    def _greeted(self, answer: dict[str, Any]) -> PushSigner:
        self.hello = answer
        return self

    def sign(self, header: dict[str, Any]) -> dict[str, Any]:
        """``header`` with ``auth`` set (unchanged without a token).  The MAC is taken over the header as the node
        will parse it (a JSON round trip: tuples become lists, keys strings), so both sides hash the same bytes."""
        if self.token is None:
            return header
        self.seq += 1
        parsed = json.loads(json.dumps(header, allow_nan=False))
        header["auth"] = {"seq": self.seq, "mac": push_mac(self.token, self.node_nonce, self.seq, parsed)}
        return header
