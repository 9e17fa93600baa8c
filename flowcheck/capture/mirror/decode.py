"""Captures -> allreduces: read, parse (native), reassemble, pick the ring connections, assemble.

``decode`` is what ``flowcheck decode`` prints and what ``flowcheck capture`` feeds the updater;
the report follows the contract in ../shared/specs/nccl-roce-wire.md ("What flowcheck decode
reports").
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from flowcheck.capture.mirror import roce
from flowcheck.capture.mirror.anomalies import Anomaly, Duplicates, NoRingConnection, PsnGap
from flowcheck.capture.mirror.assemble import Allreduce, Assembler, RingStream
from flowcheck.capture.mirror.gc_pause import gc_paused
from flowcheck.capture.mirror.job import Job
from flowcheck.capture.mirror.partition import Partition
from flowcheck.capture.mirror.pcap import Frames, read_capture
from flowcheck.capture.mirror.streams import MessageTable, Msg, StreamInfo, StreamRole, ring_streams
from flowcheck.errors import CaptureError, JobError


@dataclass
class Decoded:
    """Everything decode learned besides the allreduces themselves."""

    channels: int = 0
    streams: list[StreamRole] = field(default_factory=list)  # what every stream was taken for
    anomalies: list[Anomaly] = field(default_factory=list)
    packets: dict = field(default_factory=dict)
    skipped_sends: list[dict] = field(default_factory=list)
    placed_bytes: int = 0  # data bytes merged into allreduce vectors (a scaled-out node places only its part's)


def read_all(paths: Sequence[str]) -> Frames:
    """Every frame of every capture, in one buffer (copies of one stream from several mirrors dedupe by PSN)."""
    if not paths:
        raise CaptureError("no capture given: pass --pcap FILE [FILE ...]")
    parts = [read_capture(p) for p in paths]
    return parts[0] if len(parts) == 1 else concat_frames(parts, ",".join(os.path.basename(p) for p in paths))


def concat_frames(parts: Sequence[Frames], source: str) -> Frames:
    """The frames of ``parts`` in order, in one new buffer."""
    bufs = [np.frombuffer(f.buf, np.uint8) for f in parts]
    shifts = np.cumsum([0] + [b.nbytes for b in bufs[:-1]])
    return Frames(
        buf=np.concatenate(bufs) if bufs else np.zeros(0, np.uint8),
        offsets=np.concatenate([f.offsets + s for f, s in zip(parts, shifts)]) if parts else np.zeros(0, np.int64),
        lengths=np.concatenate([f.lengths for f in parts]) if parts else np.zeros(0, np.int32),
        ts_ns=np.concatenate([f.ts_ns for f in parts]) if parts else np.zeros(0, np.int64),
        source=source,
    )


def decode(job: Job, frames: Frames, info: Decoded | None = None, *, workers: int = 1,
           partition: Partition | None = None) -> Iterator[Allreduce]:
    """Allreduces in capture order (each settled: every stream has moved past it or ended); ``workers``: threads
    for the native first pass and for the merge of final sends (the output does not depend on it); ``partition``: place only that part's
    parameters (flowcheck.capture.mirror.partition; the others' elements stay missing and do not count)."""
    info = info if info is not None else Decoded()
    with gc_paused():
        window = decode_window(job, frames, info, workers=workers, partition=partition)
    if window.assembler is None:
        return
    for ar in window.assembler.assemble(window.rings):
        info.placed_bytes = window.assembler.placed_bytes
        yield ar
    info.placed_bytes = window.assembler.placed_bytes
    info.skipped_sends = window.assembler.skipped


@dataclass
class Window:
    """One capture (or a streaming decode's window) parsed and reassembled, its ring connections found."""

    packets: roce.Packets
    streams: list[StreamInfo]
    rings: list[RingStream]
    assembler: Assembler | None  # None: no ring connection in it


def decode_window(job: Job, frames: Frames, info: Decoded, resume: dict[str, int] | None = None, *,
                  workers: int = 1, partition: Partition | None = None) -> Window:
    """Parse and reassemble ``frames`` (on ``workers`` threads; the assembler merges on as many) and find their ring
    connections (``resume``: see ``ring_streams``)."""
    if job.protocol == "ll128":
        raise JobError("protocol ll128: the decoder does not place LL128 lines yet (the schedule and the native "
                       "unpack exist, the line-to-element mapping is unverified); capture with NCCL_PROTO=LL or Simple")
    packets, r = roce.parse_reassemble(frames, workers=workers)
    info.packets = {**packets.status_counts, "opcodes": packets.opcode_counts}
    buf = np.frombuffer(frames.buf, np.uint8)
    streams = _stream_infos(frames, packets, r, buf, info.anomalies)
    rings, channels, roles = ring_streams(job, streams, buf, info.anomalies, resume)
    info.channels, info.streams = channels, roles
    for s in streams:  # the rings hold what the sends need: the message columns go now (RAM, and the collector's scans)
        if s.message_count is None:
            s.message_count, s.messages = len(s.messages), []
    if not rings:
        info.anomalies.append(NoRingConnection())
        return Window(packets, streams, [], None)
    return Window(packets, streams, rings, Assembler(job, channels, partition, workers=workers, anomalies=info.anomalies))


def packet_anomalies(r: roce.Reassembly, anomalies: list[Anomaly], *, tails: bool = True) -> None:
    """The reassembler's PSN gaps and duplicates, per stream, as anomalies (``tails``: with the gaps after a
    stream's last packet up to the end its message must have)."""
    for sid, s in enumerate(r.streams):
        name = r.stream_name(sid)
        for a, b in r.gaps_of(sid, None if tails else roce.GAP_HOLE):
            anomalies.append(PsnGap(name, (a, b), b - a))
        if int(s["n_duplicates"]):
            anomalies.append(Duplicates(name, int(s["n_duplicates"])))


def _stream_infos(frames: Frames, packets: roce.Packets, r: roce.Reassembly, buf: np.ndarray,
                  anomalies: list[Anomaly]) -> list[StreamInfo]:
    """The reassembler's tables as StreamInfo/Msg objects; its PSN gaps and
    duplicates become anomalies.  Only streams with a write that closes a send can be ring connections: their
    messages become a ``MessageTable`` (message ids: positions in the candidates' run, by stream then PSN); the
    others (flow-control posts, ACK-only) are counted."""
    m = r.messages
    derived = _derived_columns(r, frames.ts_ns)
    writes = np.flatnonzero(m["kind"] == roce.KIND_WRITE)
    writes = writes[np.lexsort((m["first_psn"][writes], m["stream"][writes]))]  # by stream, then PSN
    stream_of = m["stream"][writes].astype(np.int64)
    candidate = np.zeros(len(r.streams), bool)
    candidate[stream_of[derived["closing"][writes]]] = True
    sel = writes[candidate[stream_of]]  # the candidates' writes: their columns become lists (~half of all messages)
    cols, arrays = _columns(m, derived, sel)
    position = np.full(len(m), -1, np.int64)
    position[sel] = np.arange(len(sel))
    missing: dict[int, list[tuple[int, int]]] = {}
    for mid, a, b in zip(position[r.missing["message"]].tolist(), r.missing["start"].tolist(), r.missing["end"].tolist()):
        if mid >= 0:
            missing.setdefault(mid, []).append((a, b))
    writes_per_stream = np.bincount(stream_of, minlength=len(r.streams)).tolist()
    run_end = np.cumsum(np.bincount(stream_of[candidate[stream_of]], minlength=len(r.streams))).tolist()
    build = partial(_msg, cols, segments=r.segments, ll_flags=packets.table["ll_flag"], missing=missing)
    packet_anomalies(r, anomalies)
    out = []
    for sid, s in enumerate(r.streams):
        if candidate[sid]:
            start = run_end[sid - 1] if sid else 0
            msgs, count = MessageTable(list(range(start, run_end[sid])), cols, arrays, r.segments, build), None
        else:  # no write closes a send (flow-control posts): it cannot be a ring connection, its messages are not needed
            msgs, count = [], writes_per_stream[sid]
        out.append(StreamInfo(name=r.stream_name(sid), src_mac=_mac(s["src_mac"]), dst_mac=_mac(s["dst_mac"]),
                              src_ip=_ip(s["src_ip"]), dst_ip=_ip(s["dst_ip"]), qpn=int(s["dqpn"]), messages=msgs,
                              message_count=count, first_frame=int(s["first_frame"])))
    return out


def _derived_columns(r: roce.Reassembly, ts_ns: np.ndarray) -> dict[str, np.ndarray]:
    """What decode reads of every message besides the reassembler's own columns (int64, -1 where unknown)."""
    m = r.messages
    seg_start, n_segs = m["seg_start"].astype(np.int64), m["n_segs"].astype(np.int64)
    dma_len, has_imm, imm, pmtu = m["dma_len"], m["has_imm"].astype(bool), m["imm"].astype(np.int64), m["pmtu"].astype(np.int64)
    size = np.where(has_imm, imm, dma_len)  # the immediate, else the RETH length (< 0: neither known)
    span = m["last_psn"] - m["first_psn"] + 1
    # more packets than its size allows: the reassembler merged sends whose boundary packets were all lost
    merged = (has_imm | (dma_len >= 0)) & (pmtu > 0) & (span > np.maximum(1, -(-size // np.maximum(pmtu, 1))))
    length = np.where((dma_len >= 0) & ~merged, dma_len, -1)
    # a message whose last packet was lost, or whose end was inferred (or cut), may have carried the
    # immediate: close the send rather than merge on
    closes = has_imm | ((m["flags"] & _OPEN_END) != 0) | merged
    gappy = np.zeros(len(m), bool)
    gappy[r.missing["message"]] = True
    return {
        "length": length, "imm": np.where(has_imm & ~merged, imm, -1), "closes": closes, "placeable": ~merged,
        "seg_start": seg_start, "seg_end": seg_start + n_segs, "t0": ts_ns[m["first_frame"]].astype(np.int64),
        # one whole send per message (streams.MessageTable.whole_sends): its immediate known, nothing of it missing
        "whole": has_imm & ~merged & ~gappy,
        # what streams._role asks first: a write that carries data (or is empty by its RETH) and closes a send
        # (_msg may also close a message with missing bytes at its end: such messages count as closing here)
        "closing": (closes | gappy) & ((n_segs > 0) | (length == 0)),
    }


def _columns(m: np.ndarray, derived: dict[str, np.ndarray], sel: np.ndarray) -> tuple[dict[str, list], dict[str, np.ndarray]]:
    """Messages ``sel``'s columns as Python lists (what _msg reads, None where unknown) and the int64 arrays the column
    path reads (streams.MessageTable)."""
    def nullable(v: np.ndarray) -> list:
        return [x if x >= 0 else None for x in v.tolist()]

    d = {k: v[sel] for k, v in derived.items()}
    own = {k: m[k][sel] for k in ("first_psn", "last_psn", "va", "complete", "ll_uniform", "first_frame", "last_frame",
                                  "ll_flag")}
    cols = {
        "first_psn": own["first_psn"].tolist(), "last_psn": own["last_psn"].tolist(), "va": nullable(own["va"]),
        "length": nullable(d["length"]), "imm": nullable(d["imm"]), "seg_start": d["seg_start"].tolist(),
        "seg_end": d["seg_end"].tolist(), "complete": own["complete"].tolist(), "closes": d["closes"].tolist(),
        "placeable": d["placeable"].tolist(), "uniform": own["ll_uniform"].tolist(),
        "first_frame": own["first_frame"].tolist(), "last_frame": own["last_frame"].tolist(), "t0": d["t0"].tolist(),
        "flag": nullable(own["ll_flag"]), "whole": d["whole"].tolist(),
    }
    arrays = {"first_psn": own["first_psn"].astype(np.int64), "last_psn": own["last_psn"].astype(np.int64),
              "imm": d["imm"], "seg_start": d["seg_start"], "seg_end": d["seg_end"],
              "flag": np.maximum(own["ll_flag"].astype(np.int64), -1), "t0": d["t0"]}
    return cols, arrays


def _msg(cols: dict[str, list], mid: int, segments: np.ndarray, ll_flags: np.ndarray,
         missing: dict[int, list[tuple[int, int]]]) -> Msg:
    """Message ``mid`` of the reassembler's table (``cols``: its columns as lists, computed for all at once;
    ``ll_flags``: the packet table's ll_flag column; ``missing``: the byte ranges each message lacks)."""
    a, b = cols["seg_start"][mid], cols["seg_end"][mid]
    segs = segments[a:b]
    missing = missing.get(mid)
    length, closes = cols["length"][mid], cols["closes"][mid]
    if missing:
        closes = closes or any(e < 0 or (length is not None and e >= length) for _, e in missing)
        missing = [(s, e if e >= 0 else (length if length is not None else -1)) for s, e in missing]
    return Msg(
        first_psn=cols["first_psn"][mid], last_psn=cols["last_psn"][mid], va=cols["va"][mid], length=length,
        imm=cols["imm"][mid], segments=segs, flags=ll_flags[segs["frame"]], missing=missing or (),
        complete=cols["complete"][mid], closes=closes,
        info={"frames": [cols["first_frame"][mid], cols["last_frame"][mid]], "t0": cols["t0"][mid]},
        placeable=cols["placeable"][mid], flag=cols["flag"][mid], uniform=cols["uniform"][mid],
    )


_OPEN_END = int(roce.MessageFlag.END_UNKNOWN | roce.MessageFlag.END_INFERRED)


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
        "anomalies": [a.to_json() for a in info.anomalies],
        "channels": info.channels,
        "streams": [s.to_json() for s in info.streams],
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
