"""Reassembled RDMA WRITE messages -> NCCL sends on the job's ring connections.

An NCCL send (one step on a connection) is one RDMA WRITE whose immediate is its size, or —
split by the NIC/driver as in the rdma32 capture — several writes to consecutive addresses
closed by a write with immediate (possibly 0 bytes).  The LL flag in every line is the
connection's step counter, so a send's step is read from its data, and a send that was lost
entirely shows up as a gap in the steps instead of shifting everything after it.

Which streams are ring connections is decided by structure: the sender and receiver are ring
neighbours in the job, the stream carries sends closed by immediates, and (LL) its lines carry
consistent flags.  Flow-control posts (32-byte writes without immediate), ACK-only streams, UD
management datagrams and Simple-protocol p2p streams are counted, never decoded as gradients.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice

import numpy as np

from flowcheck.capture.mirror import roce
from flowcheck.capture.mirror.assemble import RingStream, WireSend
from flowcheck.capture.mirror.job import Job


@dataclass(slots=True)  # many of them: no per-object __dict__ for the garbage collector to walk
class Msg:
    """One reassembled RDMA WRITE message (what the reassembler reports)."""

    first_psn: int  # unwrapped
    last_psn: int
    va: int | None  # None when the FIRST packet (with the RETH) was lost
    length: int | None  # RETH DMA length; None when unknown
    imm: int | None  # immediate (the send size for NCCL); None when absent or lost with the LAST
    segments: np.ndarray  # roce.SEGMENT rows: offset into the capture buffer, length, msg_offset (byte offset in message)
    flags: np.ndarray  # per segment: the LL flag of its first line (int64; -1: shorter than a line)
    missing: Sequence[tuple[int, int]]  # byte ranges [start, end) inside the message not captured
    complete: bool
    closes: bool  # the message ended with an immediate (LAST_IMM / ONLY_IMM) — or we cannot tell
    info: dict = field(default_factory=dict)
    placeable: bool = True  # False: where its bytes go inside the send is unknown (see split_by_flag)
    flag: int | None = None  # the LL flag of its first captured line (None: no whole line); see first_flags
    uniform: bool = False  # True: no two consecutive segments carry different LL flags (split_by_flag: nothing to cut)


class MessageTable(Sequence):
    """A stream's write messages as the reassembler's columns (lists indexed by message id); ``Msg`` objects are built
    only for the messages asked for.  Most ring connections consist of *whole sends* only — every message carries its
    immediate, nothing of it is missing, and (LL) its lines carry one flag — and those become ``WireSend``s straight from
    the columns (``_table_ring_stream``), which is what group_sends + _ring_stream would make of their Msg objects."""

    __slots__ = ("mids", "cols", "segments", "build")

    def __init__(self, mids: list[int], cols: dict[str, list], segments: np.ndarray, build: Callable[[int], Msg]) -> None:
        self.mids, self.cols, self.segments, self.build = mids, cols, segments, build  # cols["seg_start"/"seg_end"]: rows of segments

    def __len__(self) -> int:
        return len(self.mids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.build(mid) for mid in self.mids[i]]
        return self.build(self.mids[i])

    def __iter__(self) -> Iterator[Msg]:
        return map(self.build, self.mids)

    def whole_sends(self, ll: bool) -> bool:
        """Every message is one whole send (see the class docstring): group_sends would make one Send of each."""
        whole, uniform = self.cols["whole"], self.cols["uniform"]
        return all(whole[m] for m in self.mids) and (not ll or all(uniform[m] for m in self.mids))


def first_flags(flags: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> list[int | None]:
    """For each run flags[starts[i]:starts[i]+counts[i]], its first flag >= 0 (None when there is none)."""
    n = len(flags)
    at = np.where(flags >= 0, np.arange(n), n)
    nxt = np.append(np.minimum.accumulate(at[::-1])[::-1], n)  # index of the next segment with a flag
    first = nxt[np.minimum(starts, n)]
    found = first < starts + counts
    vals = np.where(found, np.append(flags, -1)[first], -1)
    return [None if v < 0 else v for v in vals.tolist()]


def segment_flags(buf: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """The LL flag of every segment's first line (bytes 4..8, little-endian), -1 for segments under 16 bytes."""
    return roce.segment_flags(buf, segments)


@dataclass
class StreamInfo:
    """A (src, dst, QPN) stream with its messages in PSN order."""

    name: str
    src_mac: str
    dst_mac: str
    src_ip: str
    dst_ip: str
    qpn: int
    messages: list[Msg]
    ended: bool = True
    # messages the stream holds when ``messages`` leaves them out: a stream none of whose writes closes a send
    # (flow-control posts) can never be a ring connection, and decode does not build its messages
    message_count: int | None = None
    first_frame: int = -1  # the capture frame of its first packet


@dataclass(slots=True)  # many of them: no per-object __dict__ for the garbage collector to walk
class Send:
    """An NCCL send rebuilt from one or more messages."""

    size: int | None
    base_va: int | None
    parts: list[Msg]
    info: dict = field(default_factory=dict)


def group_sends(messages: Sequence[Msg], buf: np.ndarray, ll: bool) -> list[Send]:
    """Messages in PSN order -> sends: writes accumulate until a write carrying an immediate closes them.

    A change of LL flag between writes (or of step slot) also closes the open send, so a send whose
    closing write was lost is not merged into the next one.
    """
    sends: list[Send] = []
    open_parts: list[Msg] = []
    if ll:
        messages = [piece for m in messages for piece in split_by_flag(m, buf)]
    for m in messages:
        if open_parts and ll and m.flag is not None and open_parts[0].flag != m.flag:
            sends.append(_close(open_parts, None))
            open_parts = []
        open_parts.append(m)
        if m.closes:
            if len(open_parts) > 1 and m.imm is not None and m.imm != sum(p.length or 0 for p in open_parts):
                # the pieces do not add up to the size the immediate announces: something between them was
                # lost; keep them apart (sizes unknown) rather than place data at a guessed offset
                sends.append(_close(open_parts[:-1], None))
                open_parts = open_parts[-1:]
            sends.append(_close(open_parts, m.imm))
            open_parts = []
    if open_parts:
        sends.append(_close(open_parts, None))
    return sends


def split_by_flag(m: Msg, buf: np.ndarray) -> list[Msg]:
    """An LL message whose packets carry different flags is two sends the reassembler merged.

    That happens when the packets that delimit them (LAST_IMM of one, FIRST of the next) were both
    lost.  The pieces are split at each flag change: the first keeps the start (its bytes are placed),
    the last keeps the immediate (the size of *its* send); where a later piece's bytes go inside its
    send is unknown, so they are never placed (missing, never misplaced).
    """
    if m.uniform:
        return [m]
    f = m.flags
    cuts = (np.flatnonzero((f[:-1] >= 0) & (f[1:] >= 0) & (f[:-1] != f[1:])) + 1).tolist()
    if not cuts:
        return [m]
    bounds = [0, *cuts, len(m.segments)]
    pieces = []
    for k in range(len(bounds) - 1):
        a, b = bounds[k], bounds[k + 1]
        first, last = k == 0, k == len(bounds) - 2
        pieces.append(Msg(
            first_psn=m.first_psn, last_psn=m.last_psn, va=m.va if first else None, length=None,
            imm=m.imm if last else None, segments=m.segments[a:b], flags=f[a:b], missing=[], complete=False,
            closes=True if not last else m.closes, info={**m.info, "split": k}, placeable=first and m.placeable,
            flag=first_flags(f, np.array([a]), np.array([b - a]))[0],
        ))
    return pieces


def _close(parts: list[Msg], imm: int | None) -> Send:
    if len(parts) == 1:
        m = parts[0]
        size = imm if imm is not None else m.length
        return Send(size, m.va, parts)
    known = [p.va for p in parts if p.va is not None and (p.length or 0) > 0]
    base = min(known) if known else None
    if imm is None:  # an unterminated split send: its size is unknown unless the pieces are all there
        return Send(None, base, parts)
    return Send(imm, base, parts)


def ll_lines(buf: np.ndarray, off: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(data words, flag words) of the LL lines in buf[off:off+length] (whole 16-byte lines only)."""
    n = length // 16
    lines = buf[off:off + n * 16].view("<u4").reshape(n, 4)
    return lines[:, [0, 2]].reshape(-1), lines[:, [1, 3]].reshape(-1)


def send_step(send: Send, buf: np.ndarray, ll: bool) -> int | None:
    if not ll:
        return None
    return next((m.flag for m in send.parts if m.flag is not None), None)


class SendPlacer:
    """``WireSend.place`` of one send: merges it into its allreduce's ``data`` and ``copies`` slices and returns
    (elements seen, elements differing).

    Every placeable message of the send is one part, at its offset inside the send (its VA minus the send's
    base VA when the send has several).  LL: every line's two flags must equal the send's flag; a segment
    with a bad line is dropped whole (reported), so a corrupted packet can only make data missing, never
    wrong.  Placement, whole-element ranges and the merge are one native call (``roce.merge_send``).
    A slotted object rather than a closure: one per send, and few objects for the garbage collector.
    """

    __slots__ = ("send", "buf", "ll", "flag", "anomalies", "where")

    def __init__(self, send: Send, buf: np.ndarray, ll: bool, flag: int | None, anomalies: list[dict], where: dict):
        self.send, self.buf, self.ll, self.flag, self.anomalies, self.where = send, buf, ll, flag, anomalies, where

    def __call__(self, data: np.ndarray, copies: np.ndarray) -> tuple[int, int]:
        return self.done(roce.merge_sends([self.job(data, copies)])[0])

    def job(self, data: np.ndarray, copies: np.ndarray) -> roce.MergeJob:
        """The merge of this send into ``data``/``copies`` as a ``roce.merge_sends`` job (the Assembler batches the
        final sends of an allreduce into few native calls, on several threads); ``done`` takes its result."""
        send = self.send
        multi = len(send.parts) > 1
        parts = []
        for m in send.parts:
            if not m.placeable or (m.va is None and multi) or not len(m.segments):
                continue  # a piece whose place in the send is unknown: its bytes stay missing
            parts.append((m.segments, m.va - send.base_va if multi and send.base_va is not None else 0))
        return roce.merge_job(self.buf, parts, self.flag, self.ll, data, copies)

    def done(self, merged: roce.Merged) -> tuple[int, int]:
        """Reports the LL segments ``merged`` left out; (elements seen, elements differing)."""
        for status, nbytes in merged.unplaced:
            if status < 0:
                self.anomalies.append({**self.where, "type": "ll_misaligned_segment", "bytes": nbytes})
            else:
                self.anomalies.append({**self.where, "type": "ll_bad_flags", "lines": status})
        return merged.seen, merged.differing


def ring_streams(job: Job, streams: Sequence[StreamInfo], buf: np.ndarray, anomalies: list[dict],
                 resume: dict[str, int] | None = None) -> tuple[list[RingStream], int, list[dict]]:
    """The job's ring connections among the streams: (ring streams, channels, what every stream was taken for).

    ``resume`` (a streaming decode's next window): per stream name, the 24-bit PSN its first unused send starts
    at; the sends before it were taken by allreduces already decoded and are left out.
    """
    ll = job.protocol in ("ll", "ll128")
    links: dict[tuple[int, int], list[tuple[StreamInfo, list[Send]]]] = {}
    roles = []
    for s in streams:
        src, dst = job.position_of(s.src_mac, s.src_ip), job.position_of(s.dst_mac, s.dst_ip)
        role = _role(job, s, src, dst, buf, ll)
        roles.append({"stream": s.name, "role": role,
                      "messages": len(s.messages) if s.message_count is None else s.message_count})
        if role == "ring":
            whole = isinstance(s.messages, MessageTable) and s.messages.whole_sends(ll)
            links.setdefault((src, dst), []).append((s, s.messages if whole else group_sends(s.messages, buf, ll)))
    if not links:
        return [], job.channels or 0, roles
    counts = {k: len(v) for k, v in links.items()}
    channels = job.channels or min(counts.values())
    out = []
    for (src, _), items in sorted(links.items()):
        items.sort(key=lambda it: it[0].qpn)  # NCCL connects channel 0 first: data QPNs increase with the channel
        if len(items) != channels:
            anomalies.append({"type": "channel_count", "link": f"{src}->{(src + 1) % job.nranks}",
                              "data_connections": len(items), "channels": channels})
        for ch, (s, sends) in enumerate(items[:channels]):
            mark = resume.get(s.name) if resume else None
            if isinstance(sends, MessageTable):  # whole sends only: straight from the columns
                out.append(_table_ring_stream(s, src, ch, sends, buf, ll, anomalies, mark))
                continue
            if mark is not None:
                sends = [x for x in sends if not _precedes(x.parts[0].first_psn, mark)]
            out.append(_ring_stream(s, src, ch, sends, buf, ll, anomalies))
    return out, channels, roles


def _precedes(psn: int, mark: int) -> bool:
    """PSN ``psn`` comes before ``mark`` (24-bit sequence numbers, compared across a wrap)."""
    return 0 < (mark - psn) & 0xFFFFFF < 0x800000


def _role(job: Job, s: StreamInfo, src: int | None, dst: int | None, buf: np.ndarray, ll: bool) -> str:
    if src is None or dst is None:
        return "foreign"
    writes = (m for m in s.messages if len(m.segments) or m.length == 0)
    head = list(islice(writes, 8))  # the first writes decide; the others are built only while none closes a send
    if not head or not (any(m.closes for m in head) or any(m.closes for m in writes)):
        return "control"  # flow-control posts (no immediate), ACK-only
    if dst != (src + 1) % job.nranks:
        return "p2p"
    if ll:
        flags = [m.flag for m in head if m.flag is not None]
        sized = [m for m in head if m.length and m.length % 16 == 0]
        if not flags or not sized or any(_line_flags_vary(m, buf) for m in head[:4]):
            return "p2p"  # Simple-protocol p2p: raw data, no LL flags
    return "ring"


def _line_flags_vary(m: Msg, buf: np.ndarray) -> bool:
    if len(m.segments) and m.segments["length"][0] >= 16:
        _, flags = ll_lines(buf, int(m.segments["offset"][0]), min(int(m.segments["length"][0]), 256))
        return bool((flags != flags[0]).any())
    return False


class TablePlacer(SendPlacer):
    """``SendPlacer`` of a send that is one whole message of a ``MessageTable`` (its segments are rows a:b)."""

    __slots__ = ("segments", "a", "b")

    def __init__(self, segments: np.ndarray, a: int, b: int, buf: np.ndarray, ll: bool, flag: int | None,
                 anomalies: list[dict], where: dict):
        self.segments, self.a, self.b = segments, a, b
        self.send, self.buf, self.ll, self.flag, self.anomalies, self.where = None, buf, ll, flag, anomalies, where

    def job(self, data: np.ndarray, copies: np.ndarray) -> roce.MergeJob:
        parts = [(self.segments[self.a:self.b], 0)] if self.b > self.a else []
        return roce.merge_job(self.buf, parts, self.flag, self.ll, data, copies)

    def row(self, lo: int, hi: int) -> tuple[int, int, int, int, int, int]:
        """This send's merge into elements [lo, hi) of its allreduce as a ``roce.merge_rows`` row (what ``job`` does)."""
        return (self.a, self.b, 0, -1 if self.flag is None else self.flag, lo, hi)


def _table_ring_stream(s: StreamInfo, position: int, channel: int, t: MessageTable, buf: np.ndarray, ll: bool,
                       anomalies: list[dict], mark: int | None) -> RingStream:
    """``_ring_stream`` of a connection whose messages are whole sends (``MessageTable.whole_sends``): one send per
    message, its size the immediate, its step the LL flag (or counted on), from the table's columns."""
    c = t.cols
    first_psn, last_psn, imm, t0, flag = c["first_psn"], c["last_psn"], c["imm"], c["t0"], c["flag"]
    mids = t.mids if mark is None else [m for m in t.mids if not _precedes(first_psn[m], mark)]
    flags = [flag[m] for m in mids] if ll else [None] * len(mids)
    head = next((i for i, f in enumerate(flags) if f is not None), None)
    counter = flags[head] - head - 1 if head is not None else 0
    segments, seg_start, seg_end, frame, last_frame = t.segments, c["seg_start"], c["seg_end"], c["first_frame"], c["last_frame"]
    by_step: dict[int, WireSend] = {}
    name = s.name
    for m, f in zip(mids, flags):
        step = f if f is not None else counter + 1
        counter = step
        where = {"stream": name, "psn": [first_psn[m], last_psn[m]], "flag": step, "t0": t0[m]}
        if step in by_step:
            anomalies.append({**where, "type": "step_seen_twice"})
            continue
        placer = TablePlacer(segments, seg_start[m], seg_end[m], buf, ll, f, anomalies, where)
        by_step[step] = WireSend(step, imm[m], placer, where, psn=first_psn[m] & 0xFFFFFF, frame=frame[m],
                                 last_frame=last_frame[m])
    return _ring(s, position, channel, by_step, anomalies)


def _ring(s: StreamInfo, position: int, channel: int, by_step: dict[int, WireSend], anomalies: list[dict]) -> RingStream:
    first = min(by_step) if by_step else 1
    last = max(by_step) if by_step else 0
    for gap in sorted(set(range(first, last + 1)) - set(by_step)):
        anomalies.append({"type": "send_lost", "stream": s.name, "step": gap})
    return RingStream(s.name, position, channel, by_step, first, last, s.ended)


def _ring_stream(s: StreamInfo, position: int, channel: int, sends: list[Send], buf: np.ndarray, ll: bool,
                 anomalies: list[dict]) -> RingStream:
    by_step: dict[int, WireSend] = {}
    flags = [send_step(send, buf, ll) for send in sends]
    # Simple, or an LL send with no line captured (an empty chunk's 0-byte send): the step after the previous
    # send's; sends before the first that carries a flag count back from it (a capture, or a streaming
    # decode's window, may begin with an empty send)
    head = next((i for i, f in enumerate(flags) if f is not None), None)
    counter = flags[head] - head - 1 if head is not None else 0
    for send, flag in zip(sends, flags):
        step = flag if flag is not None else counter + 1
        counter = step
        parts = send.parts
        if len(parts) == 1:  # most sends are one write: no generator per field
            info = parts[0].info
            t0, (frame, last_frame) = info.get("t0"), info["frames"]
        else:
            t0 = min((m.info["t0"] for m in parts if "t0" in m.info), default=None)
            frame, last_frame = min(m.info["frames"][0] for m in parts), max(m.info["frames"][1] for m in parts)
        where = {"stream": s.name, "psn": [parts[0].first_psn, parts[-1].last_psn], "flag": step, "t0": t0}
        if step in by_step:
            anomalies.append({**where, "type": "step_seen_twice"})
            continue
        by_step[step] = WireSend(step, send.size, SendPlacer(send, buf, ll, flag, anomalies, where), where,
                                 psn=parts[0].first_psn & 0xFFFFFF, frame=frame, last_frame=last_frame)
    return _ring(s, position, channel, by_step, anomalies)
