"""The push wire format between a trainer's Checkpointer and a checkpoint node.

A frame is ``MAGIC | u32 header length | header JSON | u32 CRC32C of the header | payload``.  The
header names the run, step, sender, its part of the step, every shard (canonical name, global shape,
role, offsets, shape, byte offset in the payload) and how the payload is checked; the payload is the
shards' bytes back to back — over the socket (``tcp://``, with the payload's xxh3-128 ``digest``), or left
in a shared-memory segment the node reads in place (``shm`` payloads, same host: no copy through the
socket; an even ``generation`` counter at ``generation_at`` in the segment, odd while the trainer writes,
must read the same before and after the node's copy).  The node answers every frame
with a small JSON reply frame (``ack`` or ``error``).  A damaged header or payload is refused, never
stored.  A sender opens each connection with a ``hello``, answered with the node's challenge; a node with
a token takes only pushes whose header carries ``auth`` (flowcheck/capture/push/auth.py).
"""
from __future__ import annotations

import json
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import google_crc32c

from flowcheck.errors import FormatError

MAGIC = b"FCPUSH1\x00"
MAX_HEADER = 64 << 20  # a header lists every shard; 64 MiB is far beyond any real model's table
_LEN = struct.Struct("<I")


class WireError(FormatError):
    """A frame that is not what the protocol says: bad magic, header, CRC, digest or length."""


@dataclass(frozen=True)
class Frame:
    header: dict[str, Any]
    payload: memoryview | None = None


@dataclass(frozen=True)
class PushHeader:
    """A push frame's header, as the trainer builds it (flowcheck/torch/push_client.py) and the node reads it
    (flowcheck/node/receiver.py).  The MAC covers its JSON (flowcheck/capture/push/auth.py)."""

    run: str
    step: int
    sender: int  # this rank's place among the step's senders
    senders: int
    source_layout: dict[str, int]  # {tp, pp, dp, vpp} of the trainer
    tensors: list[dict[str, Any]]  # every canonical tensor: {name, dtype, shape, role}
    shards: list[dict[str, Any]]  # this part's boxes: {tensor, offsets, shape, at[, kept]}
    payload: dict[str, Any]  # {bytes, and digest (TCP) or shm, generation, generation_at, lease_at}
    scalars: dict[str, Any] = field(default_factory=dict)
    parent: Any = None  # {step, manifest_digest}, {step}, ROOT, or None (the node continues its lineage)
    base: str | None = None  # the node state holding the kept shards' bytes
    launch: dict[str, Any] | None = None  # {id, started}: flowcheck/capture/push/launch.py
    trainer: dict[str, Any] | None = None  # what the sender reports of its saves (shown on /status)

    def to_json(self) -> dict[str, Any]:
        out = {"kind": "push", "run": self.run, "step": self.step, "sender": self.sender, "senders": self.senders,
               "source_layout": self.source_layout, "tensors": self.tensors, "shards": self.shards,
               "scalars": self.scalars, "parent": self.parent, "payload": self.payload}
        out.update({k: v for k, v in (("base", self.base), ("launch", self.launch), ("trainer", self.trainer))
                    if v is not None})
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> PushHeader:
        """The header of a push frame; WireError naming the first field that is not what the protocol says."""
        def want(name: str, ok: bool, expected: str) -> None:
            if not ok:
                raise WireError(f"push header: {name}: expected {expected}, found {raw.get(name)!r:.80}")

        step, sender, senders = raw.get("step"), raw.get("sender", 0), raw.get("senders", 1)
        want("run", isinstance(raw.get("run"), str), "a run name")
        want("step", type(step) is int and step >= 0, "a non-negative integer")
        want("senders", type(senders) is int and senders >= 1, "a positive integer")
        want("sender", type(sender) is int and 0 <= sender < senders, f"0 <= sender < senders ({senders!r})")
        want("source_layout", isinstance(raw.get("source_layout", {}), dict), "an object {tp, pp, dp, vpp}")
        for name, kind in (("tensors", list), ("shards", list), ("payload", dict)):
            want(name, isinstance(raw.get(name), kind), "a list" if kind is list else "an object")
        want("scalars", isinstance(raw.get("scalars") or {}, dict), "an object")
        want("base", raw.get("base") is None or isinstance(raw.get("base"), str), "a node state id")
        trainer = raw.get("trainer")
        return cls(raw["run"], step, sender, senders, raw.get("source_layout", {}), raw["tensors"], raw["shards"],
                   raw["payload"], raw.get("scalars") or {}, raw.get("parent"), raw.get("base"), raw.get("launch"),
                   trainer if isinstance(trainer, dict) else None)


def encode_header(header: dict[str, Any]) -> bytes:
    raw = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    return MAGIC + _LEN.pack(len(raw)) + raw + _LEN.pack(google_crc32c.value(raw))


def send_frame(sock: socket.socket, header: dict[str, Any], payload: memoryview | bytes | None = None) -> None:
    sock.sendall(encode_header(header))
    if payload is not None and len(payload):
        sock.sendall(payload)


def recv_exact(sock: socket.socket, n: int, into: memoryview | None = None,
               deadline: float | None = None) -> memoryview:
    """Exactly n bytes (into ``into`` when given); ConnectionError if the peer closes early.

    ``deadline`` (``time.monotonic()``): TimeoutError unless all n arrive by then — a peer trickling a byte
    at a time cannot hold the reader past it (the socket's own timeout bounds only each wait)."""
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {n} bytes arrived in time")
            sock.settimeout(left)
        k = sock.recv_into(buf[got:n], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return buf[:n]


def recv_header(sock: socket.socket, deadline: float | None = None) -> dict[str, Any]:
    """The next frame's header; ``deadline``: see ``recv_exact``."""
    return recv_header_body(sock, recv_header_size(sock, deadline), deadline)


def recv_header_size(sock: socket.socket, deadline: float | None = None, limit: int = MAX_HEADER) -> int:
    """The next frame's header length, read from its first bytes; WireError past ``limit`` (nothing more is read)."""
    head = bytes(recv_exact(sock, len(MAGIC) + 4, deadline=deadline))
    if head[: len(MAGIC)] != MAGIC:
        raise WireError(f"expected frame magic {MAGIC!r}, found {head[:len(MAGIC)]!r}: not a flowcheck push peer")
    (size,) = _LEN.unpack(head[len(MAGIC):])
    if size > limit:
        raise WireError(f"frame header of {size} bytes exceeds the {limit}-byte limit"
                        + ("" if limit == MAX_HEADER else " of a connection that has not authenticated (hello, auth)"))
    return size


def recv_header_body(sock: socket.socket, size: int, deadline: float | None = None) -> dict[str, Any]:
    """The header of ``size`` bytes whose length ``recv_header_size`` read, checked and parsed."""
    raw = bytes(recv_exact(sock, size + 4, deadline=deadline))
    body, crc = raw[:size], _LEN.unpack(raw[size:])[0]
    if google_crc32c.value(body) != crc:
        raise WireError("frame header fails its CRC32C: damaged in transit")
    try:
        header = json.loads(body)
    except ValueError as e:
        raise WireError(f"frame header is not JSON ({e})") from e
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise WireError(f"frame header: expected an object with a 'kind', found {type(header).__name__}")
    return header


def reply(sock: socket.socket, kind: str, **fields: Any) -> None:
    send_frame(sock, {"kind": kind, **fields})


# a push header's ``parent`` for a state that descends from nothing stored: a fresh start (a new root lineage); an
# older node reads it as "no parent given" and chains the state to what its RAM state descends from
ROOT = "root"
