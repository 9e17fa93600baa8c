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
from flowcheck.errors import CaptureError, JobError


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
    if job.protocol == "ll128":
        raise JobError("protocol ll128: the decoder does not place LL128 lines yet (the schedule and the native "
                       "unpack exist, the line-to-element mapping is unverified); capture with NCCL_PROTO=LL or Simple")
    packets = roce.parse(frames)
    info.packets = {**packets.status_counts, "opcodes": packets.opcode_counts}
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
    """The reassembler's tables as StreamInfo/Msg objects; its PSN gaps and duplicates become anomalies."""
    r = roce.reassemble(frames, packets)
    by_stream: dict[int, list[int]] = {}
    writes = np.flatnonzero(r.messages["kind"] == roce.KIND_WRITE)
    for mid in writes:
        by_stream.setdefault(int(r.messages["stream"][mid]), []).append(int(mid))
    missing: dict[int, list[tuple[int, int]]] = {}
    for row in r.missing:
        missing.setdefault(int(row["message"]), []).append((int(row["start"]), int(row["end"])))
    out = []
    for sid, s in enumerate(r.streams):
        name = r.stream_name(sid)
        for a, b in r.gaps_of(sid):
            anomalies.append({"type": "psn_gap", "stream": name, "psn": [a, b], "packets": b - a})
        if int(s["n_duplicates"]):
            anomalies.append({"type": "duplicates", "stream": name, "packets": int(s["n_duplicates"])})
        msgs = [_msg(r, mid, missing.get(mid, []), frames.ts_ns) for mid in sorted(by_stream.get(sid, []), key=lambda m: r.messages["first_psn"][m])]
        out.append(StreamInfo(name=name, src_mac=_mac(s["src_mac"]), dst_mac=_mac(s["dst_mac"]), src_ip=_ip(s["src_ip"]),
                              dst_ip=_ip(s["dst_ip"]), qpn=int(s["dqpn"]), messages=msgs))
    return out


def _msg(r, mid: int, missing: list[tuple[int, int]], ts_ns: np.ndarray) -> Msg:
    m = r.messages[mid]
    length = int(m["dma_len"]) if m["dma_len"] >= 0 else None
    segs = r.segments_of(mid)
    flags = roce.MessageFlag(int(m["flags"]))
    imm = int(m["imm"]) if m["has_imm"] else None
    size = imm if imm is not None else length
    span = int(m["last_psn"]) - int(m["first_psn"]) + 1
    pmtu = int(m["pmtu"])
    # more packets than its size allows: the reassembler merged sends whose boundary packets were all lost
    merged = size is not None and pmtu > 0 and span > max(1, -(-size // pmtu))
    if merged:
        length, imm = None, None
    return Msg(
        first_psn=int(m["first_psn"]), last_psn=int(m["last_psn"]),
        va=int(m["va"]) if m["va"] >= 0 else None, length=length,
        imm=imm,
        segments=[(int(o), int(n), int(at)) for o, n, at in zip(segs["offset"], segs["length"], segs["msg_offset"])],
        missing=[(a, b if b >= 0 else (length if length is not None else -1)) for a, b in missing],
        complete=bool(m["complete"]),
        # a message whose last packet was lost may have carried the immediate: close the send rather than merge on
        # an end that was inferred (or cut) may have carried the immediate: close the send rather than merge on
        closes=bool(m["has_imm"]) or bool(flags & (roce.MessageFlag.END_UNKNOWN | roce.MessageFlag.END_INFERRED))
        or merged or any(b < 0 or (length is not None and b >= length) for _, b in missing),
        info={"frames": [int(m["first_frame"]), int(m["last_frame"])], "t0": int(ts_ns[int(m["first_frame"])])},
        placeable=not merged,
    )


def _mac(a: np.ndarray) -> str:
    return ":".join(f"{b:02x}" for b in bytes(a))


def _ip(a: np.ndarray) -> str:
    import ipaddress

    raw = bytes(a)
    ip = ipaddress.IPv6Address(raw)
    return str(ip.ipv4_mapped) if ip.ipv4_mapped else str(ip)


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
