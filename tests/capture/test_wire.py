"""The push frame format: what a damaged or foreign frame gets (a clear WireError), never a stored step."""
from __future__ import annotations

import socket
import struct

import pytest

from flowcheck.node.receiver import parse_part
from flowcheck.capture.push.wire import MAGIC, MAX_HEADER, WireError, encode_header, recv_header, send_frame


def _pair():
    return socket.socketpair()


def test_a_frame_round_trips():
    a, b = _pair()
    with a, b:
        send_frame(a, {"kind": "hello", "x": [1, 2]})
        assert recv_header(b) == {"kind": "hello", "x": [1, 2]}


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"HTTP/1.1 200 OK\r\n\r\n", "magic"),
        (MAGIC + struct.pack("<I", MAX_HEADER + 1), "exceeds"),
        (encode_header({"kind": "push"})[:-1] + b"\x00", "CRC32C"),
    ],
)
def test_foreign_or_damaged_frames_are_refused(raw, match):
    a, b = _pair()
    with a, b:
        a.sendall(raw)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises((WireError, ConnectionError), match=match):
            recv_header(b)


def _part(**over):
    header = {
        "kind": "push", "run": "gpt", "step": 1,
        "tensors": [{"name": "w", "dtype": "float32", "shape": [4, 2]}],
        "shards": [{"tensor": "w", "offsets": [0, 0], "shape": [2, 2], "at": 0},
                   {"tensor": "w", "offsets": [2, 0], "shape": [2, 2], "at": 16}],
        "payload": {"bytes": 32, "digest": "xxh3-128:" + "0" * 32},
    }
    header.update(over)
    return header


def test_a_well_formed_part_parses():
    layout, refs, size = parse_part(_part())
    assert size == 32 and [r.at for r in refs] == [0, 16] and layout.spec("w").shape == (4, 2)


@pytest.mark.parametrize(
    "over, match",
    [
        ({"payload": {"bytes": 31}}, "payload of 31 bytes"),
        ({"shards": [{"tensor": "w", "offsets": [3, 0], "shape": [2, 2], "at": 0}], "payload": {"bytes": 16}}, "outside"),
        ({"shards": [{"tensor": "w", "offsets": [0, 0], "shape": [2, 2], "at": 8}], "payload": {"bytes": 16}}, "back to back"),
        ({"tensors": [{"name": "../etc", "dtype": "float32", "shape": [1]}]}, "not allowed"),
        ({"tensors": [{"name": "w", "dtype": "complex999", "shape": [4, 2]}]}, "dtype"),
        ({"shards": "nope"}, "push header"),
    ],
)
def test_malformed_parts_name_what_is_wrong(over, match):
    with pytest.raises(WireError, match=match):
        parse_part(_part(**over))
