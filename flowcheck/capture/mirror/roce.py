"""RoCEv2 packets -> streams -> RDMA messages, and NCCL payload unpacking (native hot path).

``parse`` turns every frame into one row of ``Packets.table`` (status, addresses, BTH and
extension-header fields, payload location).  ``reassemble`` demultiplexes OK packets into
streams (src IP, dst IP, destination QP), places SEND/WRITE packets by PSN, and forms
messages with their payload segments, the byte ranges lost inside them and the PSN gaps of
each stream.  ``parse_reassemble`` does both in one native call, each parse thread demultiplexing the rows it
writes (what decode uses).  ``ll_unpack`` / ``ll128_unpack`` / ``simple_copy`` copy a message's payload out; ``merge_send``
places a decoded send straight into its allreduce (first copy wins, later copies compared).

Table fields (numpy structured arrays).  PSNs in the reassembly tables are unwrapped to int64:
a stream's first SEND/WRITE packet (capture order) keeps its 24-bit PSN, each later one moves
by its signed 24-bit distance from the previous one, so wraps and reordering (< 2^23) are
absorbed; ``psn & 0xFFFFFF`` is the wire value.

- ``PACKET``: status (``Status``), ip_version, vlan (-1 none), src_mac/dst_mac (6 u1),
  src_ip/dst_ip (16 u1, IPv4 as ::ffff:a.b.c.d), sport, hop_limit, traffic_class, bth_offset
  (0: no BTH), opcode, se, migreq, pad, pkey, dqpn, ackreq, psn, has_reth/va/rkey/dma_len,
  has_aeth/aeth, has_deth/qkey/src_qpn, has_imm/imm (the ImmDt bytes as a little-endian u32),
  payload_off (absolute offset in ``frames.buf``, -1 unless OK), payload_len (pad and ICRC stripped),
  ll_flag (the u32 at payload bytes 4..8 — an LL line's flag — read in the same pass; -1 unless OK and >= 16 bytes).
- ``STREAM``: src/dst ip and mac, dqpn, sport, vlan, ip_version (of its first packet),
  first_frame, last_frame, n_packets, n_writes, n_sends, n_acks, n_reads, n_ud, n_other (CNP),
  n_requests (placed SEND/WRITE packets), n_duplicates, n_messages, pmtu, psn_first, psn_last.
- ``MESSAGE``: stream, kind (``KIND_SEND``/``KIND_WRITE``), first_psn, last_psn, n_packets (seen),
  n_expected (-1 unknown), va (-1: FIRST lost), rkey, dma_len (-1 unknown; a complete SEND's
  length), has_imm/imm, first_opcode/last_opcode (of the packets seen), bytes_seen, complete,
  flags (``MessageFlag``), pmtu, first_frame, last_frame, seg_start/n_segs (rows in ``segments``).
- ``SEGMENT``: message, offset (absolute in ``frames.buf``), length, msg_offset, frame, psn.
- ``MISSING``: message, start, end — bytes [start, end) of an incomplete message no packet
  carried; end -1 means "to the message's unknown end".
- ``GAP``: stream, start, end (PSNs [start, end) never seen), kind: ``GAP_HOLE`` between two
  packets seen, ``GAP_TAIL`` after the last packet seen up to the end its message must have.

Message boundaries when packets are lost: a message starts at a FIRST/ONLY; when the FIRST is
lost it starts right after the previous message's end (its LAST, or the end its RETH length
implies) — ``START_INFERRED``; before any boundary is known (the capture began mid-message)
offsets count from the first packet seen — ``START_UNKNOWN``.  Packets with no boundary between
them belong to one message, even across a PSN hole.  RDMA READ requests are counted, not placed
(they consume one PSN per response packet, which the requester stream does not show).
"""
from __future__ import annotations

import ipaddress
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from enum import IntEnum, IntFlag
from typing import NamedTuple

import numpy as np

from flowcheck import _mirror
from flowcheck.capture.mirror.frames import opcode_name
from flowcheck.capture.mirror.pcap import Frames
from flowcheck.errors import CaptureError


def _dtype(name: str) -> np.dtype:
    fields, itemsize = _mirror.layouts()[name]
    names, formats, offsets = zip(*fields)
    return np.dtype({"names": list(names), "formats": list(formats), "offsets": list(offsets), "itemsize": itemsize})


PACKET, STREAM, MESSAGE, SEGMENT, MISSING, GAP = (
    _dtype(n) for n in ("packet", "stream", "message", "segment", "missing", "gap")
)
KIND_SEND, KIND_WRITE = 0, 1
GAP_HOLE, GAP_TAIL = 0, 1


class Status(IntEnum):
    OK = 0
    NOT_ROCE = 1  # not UDP to 4791 (ARP, TCP, PTP, LLDP, ...): ignored
    BAD_ICRC = 2
    MALFORMED = 3  # truncated or inconsistent headers, unknown opcode, wrong pad


class MessageFlag(IntFlag):
    START_INFERRED = 1
    START_UNKNOWN = 2
    END_INFERRED = 4
    END_UNKNOWN = 8
    BAD_LENGTH = 16


@dataclass(frozen=True)
class Packets:
    """One ``PACKET`` row per frame, plus counts per status and per opcode (frames with a BTH)."""

    table: np.ndarray
    status_counts: dict[str, int]
    opcode_counts: dict[str, int]

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, field: str) -> np.ndarray:
        return self.table[field]


PARALLEL_MIN_FRAMES = 8192  # fewer frames than this per worker are parsed on the calling thread


def parse(frames: Frames, *, check_icrc: bool = True, workers: int = 1) -> Packets:
    """Parse every frame; never raises on frame contents (bad frames get a status).

    ``workers`` > 1 parses contiguous frame ranges on that many threads (the native parse releases the GIL and
    every row depends on its frame alone, so the table is the same as one thread's)."""
    table, offsets, lengths = _frame_columns(frames)
    k = _ranges(frames, workers)
    bounds = [len(frames) * i // k for i in range(k + 1)]

    def part(i: int) -> np.ndarray:
        a, b = bounds[i], bounds[i + 1]
        return _mirror.parse(frames.buf, offsets[a:b], lengths[a:b], table[a:b], check_icrc)

    try:
        if k == 1:
            counts = part(0)
        else:
            with ThreadPoolExecutor(k, thread_name_prefix="parse") as pool:
                counts = sum(pool.map(part, range(k)))
    except ValueError as e:
        raise CaptureError(f"{frames.source}: {e}") from e
    return _packets(table, counts)


def parse_reassemble(frames: Frames, *, check_icrc: bool = True, pmtu: int | None = None,
                     workers: int = 1) -> tuple[Packets, Reassembly]:
    """``parse`` then ``reassemble`` of the same frames, the same results, in one native call: each parse thread
    demultiplexes the rows it writes while they are in cache, instead of one thread reading the whole packet table
    again afterwards (a decode's use: it needs both)."""
    _check_workers(workers)
    table, offsets, lengths = _frame_columns(frames)
    try:
        counts, out = _mirror.parse_reassemble(frames.buf, offsets, lengths, table, check_icrc, pmtu or 0,
                                               _ranges(frames, workers), workers)
    except ValueError as e:
        raise CaptureError(f"{frames.source}: {e}") from e
    return _packets(table, counts), _reassembly(out, table)


def _frame_columns(frames: Frames) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An empty packet table for the frames, and their offsets and lengths as the native parse takes them."""
    return (np.empty(len(frames), dtype=PACKET), np.ascontiguousarray(frames.offsets, dtype=np.int64),
            np.ascontiguousarray(frames.lengths, dtype=np.int32))


def _ranges(frames: Frames, workers: int) -> int:
    """How many contiguous frame ranges ``workers`` threads parse."""
    return max(1, min(workers, len(frames) // PARALLEL_MIN_FRAMES))


def _packets(table: np.ndarray, counts: np.ndarray) -> Packets:
    status, ops = counts[:len(Status)], counts[len(Status):]
    return Packets(
        table,
        {s.name: int(status[s]) for s in Status},
        {opcode_name(op): int(ops[op]) for op in np.flatnonzero(ops)},
    )


@dataclass(frozen=True)
class Reassembly:
    """Streams, messages and their payload segments; ``stream_of``/``message_of`` map each frame
    to its row (-1: none — not OK, or a duplicate, ACK, READ or UD packet for ``message_of``)."""

    streams: np.ndarray
    messages: np.ndarray
    segments: np.ndarray
    missing: np.ndarray
    gaps: np.ndarray
    stream_of: np.ndarray
    message_of: np.ndarray
    opcodes: np.ndarray  # the packet table's opcode column (a view): for opcode_counts, counted when asked

    @cached_property
    def opcode_counts(self) -> np.ndarray:
        """(n_streams, 256) packets per stream and opcode (decode does not need them: a gather over every packet row,
        ~4% of a decode, paid only by who asks)."""
        member = self.stream_of >= 0
        cell = self.stream_of[member].astype(np.int64) * 256 + self.opcodes[member]
        return np.bincount(cell, minlength=len(self.streams) * 256).reshape(len(self.streams), 256)

    def segments_of(self, message: int) -> np.ndarray:
        m = self.messages[message]
        return self.segments[m["seg_start"] : m["seg_start"] + m["n_segs"]]

    def missing_of(self, message: int) -> list[tuple[int, int]]:
        rows = self.missing[self.missing["message"] == message]
        return [(int(a), int(b)) for a, b in zip(rows["start"], rows["end"])]

    def gaps_of(self, stream: int, kind: int | None = None) -> list[tuple[int, int]]:
        """PSN ranges [start, end) of a stream never seen; ``kind`` GAP_HOLE or GAP_TAIL, None for both."""
        rows = self.gaps[self.gaps["stream"] == stream]
        if kind is not None:
            rows = rows[rows["kind"] == kind]
        return [(int(a), int(b)) for a, b in zip(rows["start"], rows["end"])]

    def messages_of(self, stream: int) -> np.ndarray:
        """Message ids of a stream in PSN order."""
        return np.flatnonzero(self.messages["stream"] == stream)

    def stream_name(self, stream: int) -> str:
        """``src_mac->dst_mac qpn=0x..`` (how the ground-truth files name flows)."""
        s = self.streams[stream]
        mac = lambda a: ":".join(f"{b:02x}" for b in a)  # noqa: E731
        return f"{mac(s['src_mac'])}->{mac(s['dst_mac'])} qpn={int(s['dqpn']):#x}"

    def find_stream(self, src_ip: str, dst_ip: str, dqpn: int) -> int | None:
        key = (ip16(src_ip), ip16(dst_ip))
        for i, s in enumerate(self.streams):
            if (s["src_ip"].tobytes(), s["dst_ip"].tobytes()) == key and int(s["dqpn"]) == dqpn:
                return i
        return None


def ip16(ip: str) -> bytes:
    """An address as the 16 bytes the tables hold (IPv4 mapped into ::ffff:0:0/96)."""
    a = ipaddress.ip_address(ip)
    return a.packed if a.version == 6 else b"\0" * 10 + b"\xff\xff" + a.packed


def reassemble(frames: Frames, packets: Packets, *, pmtu: int | None = None, workers: int = 1) -> Reassembly:
    """Streams and RDMA messages of the OK packets; ``pmtu`` overrides the per-stream inference; ``workers``: native
    threads, each reassembling whole streams (the tables are the same as one thread's)."""
    if len(packets) != len(frames):
        raise ValueError(f"{len(packets)} packet rows for {len(frames)} frames")
    _check_workers(workers)
    return _reassembly(_mirror.reassemble(np.ascontiguousarray(packets.table), pmtu or 0, workers), packets.table)


def _check_workers(workers: int) -> None:
    if not 1 <= workers <= 256:
        raise ValueError(f"workers must be 1..256, got {workers}")


def _reassembly(out: dict, table: np.ndarray) -> Reassembly:
    return Reassembly(
        out["streams"].view(STREAM), out["messages"].view(MESSAGE), out["segments"].view(SEGMENT),
        out["missing"].view(MISSING), out["gaps"].view(GAP), out["stream_of"], out["message_of"], table["opcode"],
    )


class Unpacked(NamedTuple):
    flag: int | None  # the flag every line should carry (None: no line seen)
    lines: int
    bad_lines: int  # lines whose flags differ (torn or stale data) or are cut short


def ll_unpack(frames: Frames, segments: np.ndarray, out, expected_flag: int | None = None) -> Unpacked:
    """NCCL LL: copy the 8 data bytes of every 16-byte line {data0, flag, data1, flag} of the
    segments into ``out`` at message offset / 2; check every flag equals ``expected_flag`` (or
    the first line's).  ``out`` is any writable buffer sized for the whole message's data."""
    flag, lines, bad = _mirror.ll_unpack(frames.buf, _segments(segments), out, _flag(expected_flag))
    return Unpacked(flag if flag >= 0 else None, lines, bad)


def ll128_unpack(frames: Frames, segments: np.ndarray, out, expected_flag: int | None = None) -> Unpacked:
    """NCCL LL128: 128-byte lines of 120 data bytes then a u64 flag; data lands at offset / 128 * 120."""
    flag, lines, bad = _mirror.ll128_unpack(frames.buf, _segments(segments), out, _flag(expected_flag))
    return Unpacked(flag if flag >= 0 else None, lines, bad)


def simple_copy(frames: Frames, segments: np.ndarray, out) -> int:
    """NCCL Simple: copy the raw payload of the segments into ``out`` at their message offsets."""
    return _mirror.simple_copy(frames.buf, _segments(segments), out)


class Merged(NamedTuple):
    seen: int  # whole elements this send delivered
    differing: int  # of those, elements that already had a copy and differ from it bitwise
    unplaced: list[tuple[int, int]]  # LL segments not placed: (-1, their bytes) misaligned, (bad lines, 0)


def merge_send(buf: np.ndarray, parts: list[tuple[np.ndarray, int]], flag: int | None, ll: bool, data: np.ndarray,
               copies: np.ndarray) -> Merged:
    """Merge one final send into its allreduce, natively and in one call.

    ``parts`` are (``Reassembly.segments`` rows, shift) of the send's placeable messages: each segment's
    payload goes to the send's data bytes at msg_offset + shift (LL: every line's flags must equal ``flag``,
    8 data bytes per 16-byte line at (msg_offset + shift) / 2; a segment with a bad or misaligned line is
    not placed).  The whole elements inside a placed segment's byte range are present.  For each present
    element of ``data`` (the send's slice of the allreduce vector) and ``copies`` (uint8, valid copies per
    element): the first copy wins, a later one is compared bitwise (a difference counts), the count goes up
    (saturating at 255).  ``flag`` None: no line can be valid.
    """
    seen, differing, unplaced = _mirror.merge_send(buf, parts, _flag(flag), ll, data, copies)
    return Merged(seen, differing, unplaced)


MergeJob = tuple  # (buf, parts, flag, ll, data, copies): merge_send's arguments, as SendPlacer.job builds them


def merge_job(buf: np.ndarray, parts: list[tuple[np.ndarray, int]], flag: int | None, ll: bool, data: np.ndarray,
              copies: np.ndarray) -> MergeJob:
    """merge_send's arguments as one job for ``merge_sends`` (the flag checked here)."""
    return (buf, parts, _flag(flag), ll, data, copies)


def merge_sends(jobs: list[MergeJob]) -> list[Merged]:
    """``merge_send`` of every job, in order, in one native call that releases the GIL once for all of them.

    Jobs whose destinations overlap must go in one call, in the order their copies count (the first wins);
    calls over disjoint destinations may run on different threads at once (Assembler does, by send range).
    """
    return [Merged(*r) for r in _mirror.merge_sends(jobs)]


def merge_rows(buf: np.ndarray, segments: np.ndarray, rows: np.ndarray, ll: bool, data: np.ndarray,
               copies: np.ndarray) -> list[Merged]:
    """``merge_sends`` for sends that are each a run of one ``Reassembly.segments`` table, given as int64 rows
    (seg_start, seg_end, shift, flag, lo, hi) — flag -1: no line valid — merged into ``data[lo:hi]`` /
    ``copies[lo:hi]`` of one allreduce, in row order, in one native call (no Python object per send)."""
    seen, differing, unplaced = _merge_rows(buf, segments, rows, ll, data, copies)
    if not len(unplaced):  # the usual case: every segment placed
        return [Merged(a, b, []) for a, b in zip(seen.tolist(), differing.tolist())]
    bad: dict[int, list[tuple[int, int]]] = {}
    for k, status, nbytes in unplaced:
        bad.setdefault(k, []).append((status, nbytes))
    return [Merged(a, b, bad.get(k, [])) for k, (a, b) in enumerate(zip(seen.tolist(), differing.tolist()))]


def merge_row_columns(buf: np.ndarray, segments: np.ndarray, rows: np.ndarray, ll: bool, data: np.ndarray,
                      copies: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
    """``merge_rows`` without an object per row: (seen int64[n], differing int64[n], [(row, status, bytes)] of the LL
    segments left unplaced)."""
    return _merge_rows(buf, segments, rows, ll, data, copies)


def _merge_rows(buf, segments, rows, ll, data, copies):  # one native call under both names (benchmarks time each)
    return _mirror.merge_rows(buf, _segments(segments), np.ascontiguousarray(rows, dtype=np.int64), ll, data, copies)


def segment_flags(buf: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """The LL flag of every segment's first line (bytes 4..8, little-endian; int64), -1 for segments under 16 bytes."""
    return _mirror.segment_flags(buf, _segments(segments))


def _segments(segments: np.ndarray) -> np.ndarray:
    if segments.dtype != SEGMENT:
        raise ValueError(f"expected rows of Reassembly.segments, got dtype {segments.dtype}")
    return np.ascontiguousarray(segments)


def _flag(expected: int | None) -> int:
    if expected is not None and not 0 <= expected < 1 << 63:
        raise ValueError(f"expected_flag must be a non-negative integer, got {expected}")
    return -1 if expected is None else expected
