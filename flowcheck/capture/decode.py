"""Captures -> allreduces: read, parse (native), reassemble, pick the ring connections, assemble.

``decode`` is what ``flowcheck decode`` prints and what ``flowcheck capture`` feeds the updater;
the report follows the contract in ../shared/specs/nccl-roce-wire.md ("What flowcheck decode
reports").
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from flowcheck.capture import roce
from flowcheck.capture.assemble import Allreduce, Assembler
from flowcheck.capture.job import Job
from flowcheck.capture.pcap import Frames, read_capture
from flowcheck.capture.streams import Msg, StreamInfo, ring_streams
from flowcheck.errors import CaptureError


@dataclass
class Decoded:
    """Everything decode learned besides the allreduces themselves."""

    channels: int = 0
    streams: list[dict] = field(default_factory=list)
    anomalies: list[dict] = field(default_factory=list)
    packets: dict = field(default_factory=dict)
    skipped_sends: list[dict] = field(default_factory=list)


def read_all(paths: Sequence[str]) -> Frames:
    """Every frame of every capture, in one buffer (copies of one stream from several mirrors dedupe by PSN)."""
    if not paths:
        raise CaptureError("no capture given: pass --pcap FILE [FILE ...]")
    parts = [read_capture(p) for p in paths]
    if len(parts) == 1:
        return parts[0]
    bufs = [np.frombuffer(f.buf, np.uint8) for f in parts]
    shifts = np.cumsum([0] + [b.nbytes for b in bufs[:-1]])
    return Frames(
        buf=np.concatenate(bufs),
        offsets=np.concatenate([f.offsets + s for f, s in zip(parts, shifts)]),
        lengths=np.concatenate([f.lengths for f in parts]),
        ts_ns=np.concatenate([f.ts_ns for f in parts]),
        source=",".join(os.path.basename(p) for p in paths),
    )


def decode(job: Job, frames: Frames, info: Decoded | None = None) -> Iterator[Allreduce]:
    """Allreduces in capture order (each settled: every stream has moved past it or ended)."""
    info = info if info is not None else Decoded()
    packets = roce.parse(frames)
    info.packets = dict(packets.counters)
    streams = _stream_infos(frames, packets, info.anomalies)
    buf = np.frombuffer(frames.buf, np.uint8)
    rings, channels, roles = ring_streams(job, streams, buf, info.anomalies)
    info.channels, info.streams = channels, roles
    if not rings:
        info.anomalies.append({"type": "no_ring_connection",
                               "detail": "no stream between ring neighbours of the job carries NCCL sends; "
                                         "check the ring members' MAC/IP addresses and the protocol"})
        return
    assembler = Assembler(job, channels)
    yield from assembler.assemble(rings)
    info.skipped_sends = assembler.skipped


def _stream_infos(frames: Frames, packets, anomalies: list[dict]) -> list[StreamInfo]:
    """The reassembler's tables as StreamInfo/Msg objects (plus its gap/duplicate reports as anomalies)."""
    table = roce.reassemble(frames, packets)
    anomalies.extend(table.anomalies)
    return [StreamInfo(name=s.name, src_mac=s.src_mac, dst_mac=s.dst_mac, src_ip=s.src_ip, dst_ip=s.dst_ip,
                       qpn=s.qpn, messages=[Msg(**m) for m in s.messages]) for s in table.streams]


def report(allreduces: list[Allreduce], info: Decoded) -> dict:
    return {
        "allreduces": [a.summary() for a in allreduces],
        "anomalies": info.anomalies,
        "channels": info.channels,
        "streams": info.streams,
        "packets": info.packets,
        "other_sends": len(info.skipped_sends),
    }


def dump(allreduces: list[Allreduce], directory: str) -> None:
    """``allreduce-<k>.npy`` (missing elements zero) and, when incomplete, ``allreduce-<k>.missing.npy``."""
    os.makedirs(directory, exist_ok=True)
    for a in allreduces:
        data = a.data.copy()
        data[a.copies == 0] = 0
        np.save(os.path.join(directory, f"allreduce-{a.index}.npy"), data)
        if not a.complete:
            np.save(os.path.join(directory, f"allreduce-{a.index}.missing.npy"), a.copies == 0)
