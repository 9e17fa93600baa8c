"""Shared simulator runs (one per session: training dominates test time) and a tiny RDMA message reader."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pytest

from flowcheck.capture.mirror import roce
from flowcheck.capture.mirror.pcap import Frames, read_capture
from flowcheck.simulate import SimOptions, simulate

ALL_PORTS = "0:out,1:out,2:out,0:in,1:in,2:in,1:both"


@pytest.fixture(scope="session")
def sim_dir(tmp_path_factory):
    """A 3-rank, 2-channel LL run with every port of every rank mirrored, no injection."""
    out = str(tmp_path_factory.mktemp("sim") / "run")
    result = simulate(SimOptions(out=out, dp=3, iters=6, channels=2, mirror=ALL_PORTS, seed=7), keep_finals=True)
    return result


def mac_text(row_mac: np.ndarray) -> str:
    return ":".join(f"{b:02x}" for b in row_mac)


@dataclass
class Message:
    va: int
    dma_len: int
    imm: int | None
    psns: list[int] = field(default_factory=list)
    data: bytearray = field(default_factory=bytearray)


def messages(frames: Frames) -> dict[tuple[str, str, int], list[Message]]:
    """RDMA WRITE messages per (src MAC, dst MAC, dest QPN), in frame order (the capture must be lossless)."""
    table = roce.parse(frames).table
    assert (table["status"] == roce.Status.OK).all(), "every simulator frame must parse as a valid RoCE frame"
    out: dict[tuple[str, str, int], list[Message]] = {}
    open_msg: dict[tuple[str, str, int], Message] = {}
    buf = frames.buf
    for row in table:
        op = int(row["opcode"])
        if not 6 <= op <= 11:
            continue
        key = (mac_text(row["src_mac"]), mac_text(row["dst_mac"]), int(row["dqpn"]))
        if op in (6, 10, 11):
            open_msg[key] = Message(int(row["va"]), int(row["dma_len"]), None)
        msg = open_msg[key]
        msg.psns.append(int(row["psn"]))
        off, n = int(row["payload_off"]), int(row["payload_len"])
        msg.data += buf[off:off + n].tobytes()
        if op in (8, 9, 10, 11):
            msg.imm = int(row["imm"]) if row["has_imm"] else None
            out.setdefault(key, []).append(open_msg.pop(key))
    return out


def ll_decode(data: bytes) -> tuple[bytes, np.ndarray]:
    """(data bytes, flags of every line) of an LL payload."""
    lines = np.frombuffer(data, dtype="<u4").reshape(-1, 4)
    return lines[:, 0::2].tobytes(), np.concatenate([lines[:, 1], lines[:, 3]])


def pcap(result, port: str) -> Frames:
    return read_capture(result.pcaps[port])


def file_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def tree_bytes(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            out[os.path.relpath(p, root)] = file_bytes(p)
    return out
