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
from functools import partial
from itertools import islice

import numpy as np

from flowcheck.capture.mirror import roce
from flowcheck.capture.mirror.anomalies import Anomaly, ChannelCount, SendLost, StepSeenTwice, unplaced_anomaly
from flowcheck.capture.mirror.assemble import RingStream, WireSend
from flowcheck.capture.mirror.job import Job
from flowcheck.capture.mirror.send_columns import SendColumns


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
    immediate, nothing of it is missing, and (LL) its lines carry one flag — and those become ``send_columns.SendColumns``
    straight from the columns (``_table_ring_stream``): the sends group_sends + _ring_stream would make of their Msg
    objects, as arrays."""

    __slots__ = ("mids", "cols", "arrays", "segments", "build")

    def __init__(self, mids: list[int], cols: dict[str, list], arrays: dict[str, np.ndarray], segments: np.ndarray,
                 build: Callable[[int], Msg]) -> None:
        # cols["seg_start"/"seg_end"]: rows of segments; arrays: the columns _table_ring_stream reads as int64 arrays
        # (first_psn, last_psn, imm, flag, t0; -1 where cols hold None)
        self.mids, self.cols, self.arrays, self.segments, self.build = mids, cols, arrays, segments, build

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


@dataclass(frozen=True)
class StreamRole:
    """What decode took a stream for (``Decoded.streams``): ring | p2p | control | foreign, and its write messages."""

    stream: str
    role: str
    messages: int

    def to_json(self) -> dict:
        return {"stream": self.stream, "role": self.role, "messages": self.messages}


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

    def __init__(self, send: Send, buf: np.ndarray, ll: bool, flag: int | None, anomalies: list[Anomaly], where: dict):
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
            self.anomalies.append(unplaced_anomaly(self.where, status, nbytes))
        return merged.seen, merged.differing


def ring_streams(job: Job, streams: Sequence[StreamInfo], buf: np.ndarray, anomalies: list[Anomaly],
                 resume: dict[str, int] | None = None) -> tuple[list[RingStream], int, list[StreamRole]]:
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
        roles.append(StreamRole(s.name, role, len(s.messages) if s.message_count is None else s.message_count))
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
            anomalies.append(ChannelCount(f"{src}->{(src + 1) % job.nranks}", len(items), channels))
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
                 anomalies: list[Anomaly], where: dict):
        self.segments, self.a, self.b = segments, a, b
        self.send, self.buf, self.ll, self.flag, self.anomalies, self.where = None, buf, ll, flag, anomalies, where

    def job(self, data: np.ndarray, copies: np.ndarray) -> roce.MergeJob:
        parts = [(self.segments[self.a:self.b], 0)] if self.b > self.a else []
        return roce.merge_job(self.buf, parts, self.flag, self.ll, data, copies)

    def row(self, lo: int, hi: int) -> tuple[int, int, int, int, int, int]:
        """This send's merge into elements [lo, hi) of its allreduce as a ``roce.merge_rows`` row (what ``job`` does)."""
        return (self.a, self.b, 0, -1 if self.flag is None else self.flag, lo, hi)


def _table_ring_stream(s: StreamInfo, position: int, channel: int, t: MessageTable, buf: np.ndarray, ll: bool,
                       anomalies: list[Anomaly], mark: int | None) -> RingStream:
    """``_ring_stream`` of a connection whose messages are whole sends (``MessageTable.whole_sends``), as columns
    (``send_columns.SendColumns``): one send per message, its size the immediate, its step the LL flag (or counted
    on from the previous send's), the first of two sends at one step kept."""
    a = t.arrays
    mids = np.asarray(t.mids, np.int64)
    if mark is not None:
        mids = mids[~_precede(a["first_psn"][mids], mark)]
    steps = _steps(a["flag"][mids] if ll else np.full(len(mids), -1, np.int64))
    if len(steps) < 2 or bool((steps[1:] > steps[:-1]).all()):  # the usual case: one message per step, in order
        unique, first = steps, np.arange(len(steps))
    else:
        unique, first = np.unique(steps, return_index=True)  # the first message at each step
    at = mids[first]
    columns = {"steps": unique, "size": a["imm"][at], "seg_a": a["seg_start"][at], "seg_b": a["seg_end"][at],
               "flag": a["flag"][at] if ll else np.full(len(at), -1, np.int64), "first_psn": a["first_psn"][at],
               "last_psn": a["last_psn"][at], "t0": a["t0"][at]}
    sends = SendColumns(s.name, columns, np.argsort(first), t.segments, buf, ll, anomalies, partial(_table_send, t, at))
    again = np.ones(len(mids), bool)
    again[first] = False
    for k in np.flatnonzero(again).tolist():
        m = int(mids[k])
        anomalies.append(StepSeenTwice(s.name, (t.cols["first_psn"][m], t.cols["last_psn"][m]), int(steps[k]),
                                       t.cols["t0"][m]))
    first_step, last_step = (int(unique[0]), int(unique[-1])) if len(unique) else (1, 0)
    if last_step - first_step + 1 > len(unique):  # steps missing in between
        for gap in np.setdiff1d(np.arange(first_step, last_step + 1), unique).tolist():
            anomalies.append(SendLost(s.name, gap))
    return RingStream(s.name, position, channel, sends, first_step, last_step, s.ended)


def _steps(flags: np.ndarray) -> np.ndarray:
    """Each send's step: its LL flag (>= 0), else the step after the previous send's; sends before the first flag
    count back from it (all -1, as Simple: 1, 2, ...) — ``_ring_stream``'s counter, as arrays."""
    n = len(flags)
    has = flags >= 0
    if not has.any():
        return np.arange(1, n + 1, dtype=np.int64)
    k = np.maximum.accumulate(np.where(has, np.arange(n), -1))  # the last send with a flag, at or before each
    k = np.where(k < 0, int(np.argmax(has)), k)
    return flags[k] + (np.arange(n) - k)


def _precede(psn: np.ndarray, mark: int) -> np.ndarray:
    """``_precedes`` of every PSN in ``psn``."""
    d = (mark - psn) & 0xFFFFFF
    return (d > 0) & (d < 0x800000)


def _table_send(t: MessageTable, mids: np.ndarray, sends: SendColumns, i: int) -> WireSend:
    """Entry ``i`` of a column connection (message ``mids[i]`` of ``t``) as the per-send path's ``WireSend``."""
    c, m = t.cols, int(mids[i])
    where = sends.where(i)
    placer = TablePlacer(t.segments, c["seg_start"][m], c["seg_end"][m], sends.buf, sends.ll, c["flag"][m] if sends.ll else None,
                         sends.anomalies, where)
    return WireSend(where["flag"], c["imm"][m], placer, where, psn=c["first_psn"][m] & 0xFFFFFF, frame=c["first_frame"][m],
                    last_frame=c["last_frame"][m])


def _ring(s: StreamInfo, position: int, channel: int, by_step: dict[int, WireSend], anomalies: list[Anomaly]) -> RingStream:
    first = min(by_step) if by_step else 1
    last = max(by_step) if by_step else 0
    for gap in sorted(set(range(first, last + 1)) - set(by_step)):
        anomalies.append(SendLost(s.name, gap))
    return RingStream(s.name, position, channel, by_step, first, last, s.ended)


def _ring_stream(s: StreamInfo, position: int, channel: int, sends: list[Send], buf: np.ndarray, ll: bool,
                 anomalies: list[Anomaly]) -> RingStream:
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
            anomalies.append(StepSeenTwice.at(where))
            continue
        by_step[step] = WireSend(step, send.size, SendPlacer(send, buf, ll, flag, anomalies, where), where,
                                 psn=parts[0].first_psn & 0xFFFFFF, frame=frame, last_frame=last_frame)
    return _ring(s, position, channel, by_step, anomalies)
