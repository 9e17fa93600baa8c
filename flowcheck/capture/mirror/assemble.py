"""Allreduce assembly: ring sends on mirrored streams -> complete, verified gradient buckets.

Input is one ``RingStream`` per mirrored ring connection (sender position, channel) holding
its sends by NCCL step.  Allreduces are found by *structure*: the job says, for allreduce k,
how many sends of which wire sizes each connection carries (flowcheck.capture.mirror.ring); a send
that does not fit is another collective and is skipped, never counted blindly.  The final
(allgather) sends of every matched allreduce are copied into the allreduce's vector: the
first valid copy of each element wins, later copies are compared (a mismatch is an anomaly
and the allreduce is not trusted), and the exact element ranges nobody delivered stay
recorded as missing.  A gradient with holes is never handed out.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial

import numpy as np

from flowcheck.capture.mirror import roce
from flowcheck.capture.mirror.anomalies import Anomaly, TrailingResend
from flowcheck.capture.mirror.gc_pause import gc_paused
from flowcheck.capture.mirror.job import Job
from flowcheck.capture.mirror.partition import Partition
from flowcheck.capture.mirror.ring import PatternColumns, RingParams, Send, pattern_columns, ring_pattern
from flowcheck.capture.mirror.send_columns import (ColumnSources, SendColumns, Taken, fits, merge_groups, merge_taken,
                                                   run_groups)

NUMPY = {"float32": np.float32, "bfloat16": np.uint16, "int32": np.int32}


@dataclass(slots=True)  # one per send on every ring connection
class WireSend:
    """One NCCL send seen on a connection (one step): what arrived of it."""

    step: int  # NCCL step on its connection (the LL flag), or inferred
    size: int | None  # declared wire bytes (immediate or RETH length); None when both were lost
    # merge into the allreduce: place(data, copies) gets the send's slices of Allreduce.data and .copies, gives
    # each element it delivered whole that has no copy yet its value, compares those that have one (bitwise),
    # counts copies up (saturating at 255) and returns (elements seen, elements differing); see roce.merge_send
    place: Callable[[np.ndarray, np.ndarray], tuple[int, int]]
    info: dict = field(default_factory=dict)  # where it came from (stream, packets, psn) for reports
    psn: int = -1  # the 24-bit PSN of its first packet seen (a streaming decode resumes a connection there)
    frame: int = -1  # the capture frame of that packet
    last_frame: int = -1  # the capture frame of its last packet seen


@dataclass
class RingStream:
    """The sends of one ring connection: sender ring position -> successor, one channel."""

    name: str
    position: int
    channel: int
    sends: Mapping[int, WireSend]  # by step: a dict, or the connection's columns (send_columns.SendColumns)
    first_step: int
    last_step: int
    ended: bool = True  # no more sends will come (end of capture)


@dataclass
class Allreduce:
    """One allreduce being assembled."""

    index: int  # 1-based, capture order
    iteration: int
    bucket: int
    elements: int
    dtype: str
    data: np.ndarray
    copies: np.ndarray  # valid copies seen per element (saturating uint8)
    # one dict per final send taken (where from, what it delivered); send_columns.ColumnSources when merged from
    # column connections (built on first use: read latest_t0 / source_ranges for the few numbers a pipeline needs)
    sources: Sequence[dict] = field(default_factory=list)
    conflicts: list[dict] = field(default_factory=list)
    streams_done: set[str] = field(default_factory=set)
    # element ranges this node places (a scaled-out node's part, flowcheck.capture.mirror.partition); None: all
    owned: list[tuple[int, int]] | None = None
    placed_bytes: int = 0  # data bytes merged into ``data`` from the wire (every copy counts)

    @property
    def complete(self) -> bool:
        if self.owned is not None:
            return not self.conflicts and all(bool(self.copies[a:b].all()) for a, b in self.owned)
        return not self.conflicts and bool(self.copies.all())

    def missing(self) -> list[tuple[int, int]]:
        if self.owned is not None:
            return [(a + x, a + y) for a, b in self.owned for x, y in _runs(self.copies[a:b] == 0)]
        return _runs(self.copies == 0)

    def summary(self) -> dict:
        out = {"index": self.index, "iteration": self.iteration, "bucket": self.bucket, "elements": self.elements,
               "dtype": self.dtype, "complete": self.complete, "missing": [list(r) for r in self.missing()],
               "copies": {"min": int(self.copies.min()) if self.elements else 0,
                          "max": int(self.copies.max()) if self.elements else 0},
               "sources": list(self.sources), "conflicts": self.conflicts}
        if self.complete:
            out["sha256"] = hashlib.sha256(self.data.astype(self.data.dtype.newbyteorder("<"), copy=False).tobytes()).hexdigest()
        return out

    def latest_t0(self) -> int | None:
        """The latest capture time (ns) of a taken send's first packet (None: no send carries one)."""
        if isinstance(self.sources, ColumnSources):
            return self.sources.latest_t0()
        return max((s["t0"] for s in self.sources if s.get("t0") is not None), default=None)

    def source_ranges(self) -> Iterator[tuple[int, int, int]]:
        """(start, end, elements seen) of every source, in order."""
        if isinstance(self.sources, ColumnSources):
            return self.sources.ranges()
        return ((*s.get("range", (0, 0)), int(s.get("elements_seen", 0))) for s in self.sources)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) runs of True in a boolean vector."""
    if not mask.any():
        return []
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.view(np.int8), [0]))))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


class Schedule:
    """Allreduce k (1-based) -> (iteration, bucket, elements), from the job's bucket plans."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return self.start_at(1)

    def start_at(self, index: int) -> Iterator[tuple[int, int, int]]:
        """The schedule from allreduce ``index`` on (every iteration after the first has the same plan)."""
        first, later = len(self.job.plan(1)), len(self.job.plan(2))
        if index <= first or not later:
            iteration, skip = 1, index - 1
        else:
            iteration, skip = 2 + (index - 1 - first) // later, (index - 1 - first) % later
        while True:
            for b, bucket in enumerate(self.job.plan(iteration)):
                if skip:
                    skip -= 1
                    continue
                yield iteration, b, bucket.elements
            iteration += 1


class Matcher:
    """Finds allreduce k on one stream: the stream's steps that hold its sends."""

    def __init__(self, job: Job, params: RingParams) -> None:
        self.job, self.params = job, params

    def pattern(self, elements: int, position: int, channel: int) -> Sequence[Send]:
        return ring_pattern(elements, self.params, position, channel)

    def columns(self, elements: int, position: int, channel: int) -> PatternColumns:
        return pattern_columns(elements, self.params, position, channel)

    def fits(self, stream: RingStream, at: int, pattern: Sequence[Send]) -> bool | None:
        """True/False when the sends from step ``at`` do/don't have the pattern's sizes; None: cannot tell yet."""
        seen = 0
        for j, send in enumerate(pattern):
            step = at + j
            if step > stream.last_step:  # the capture ends inside this pattern
                return (seen > 0) if stream.ended else None
            ws = stream.sends.get(step)
            if ws is None or ws.size is None:
                continue  # lost entirely (or its size was): compatible with anything
            if ws.size != self.params.wire_bytes(send.count):
                return False
            seen += ws.size > 0  # an empty send fits anything; it is no evidence
        return seen > 0


@lru_cache(maxsize=32)
def final_starts(elements: int, params: RingParams, channel: int) -> dict[int, list[tuple[int, np.ndarray]]]:
    """Wire size -> (elements, first elements) of the final sends with elements of that size, of an allreduce of
    ``elements`` on ``channel``, from every ring position's schedule (remembered, as the patterns are: a decode asks
    for the same few after every allreduce)."""
    cols = [pattern_columns(elements, params, pos, channel) for pos in range(params.nranks)]
    lo = np.concatenate([c.final_lo for c in cols])
    count = np.concatenate([c.final_hi - c.final_lo for c in cols])
    size = np.concatenate([c.wire[c.finals] for c in cols])
    out: dict[int, list[tuple[int, np.ndarray]]] = {}
    for sz, n in sorted(set(zip(size.tolist(), count.tolist()))):
        out.setdefault(sz, []).append((n, np.unique(lo[(size == sz) & (count == n)])))
    return out


class Assembler:
    """Matches allreduces on every stream and fills their vectors; yields each when it is settled."""

    def __init__(self, job: Job, nchannels: int, partition: Partition | None = None, workers: int = 1,
                 anomalies: list[Anomaly] | None = None) -> None:
        self.job = job
        self.anomalies = anomalies if anomalies is not None else []  # where trailing re-sends are reported
        self.workers = workers  # threads for the merge of final sends (output does not depend on it)
        self.partition = partition if partition is not None and not partition.whole else None
        self.placed_bytes = 0  # data bytes merged into allreduce vectors (what a scaled-out node saves on)
        self.params = job.ring_params(nchannels)
        self.matcher = Matcher(job, self.params)
        self.dtype = NUMPY[job.dtype]
        self.skipped: list[dict] = []  # sends that belong to no allreduce (other collectives)
        self.cursors: dict[str, int] = {}  # per stream: the first step not taken by a yielded allreduce
        self.last: Allreduce | None = None  # the allreduce yielded last (a streaming decode carries it over)
        self._took: set[str] = set()  # the streams the allreduce yielded last was taken from

    def assemble(self, streams: list[RingStream], start: int = 1) -> Iterator[Allreduce]:
        """Allreduces in capture order from allreduce ``start`` (1-based: a streaming decode goes on where its last
        window stopped); each is yielded once every stream has moved past it or ended."""
        self.cursors = {s.name: s.first_step for s in streams}
        live = list(streams)
        for index, (iteration, bucket, elements) in enumerate(Schedule(self.job).start_at(start), start=start):
            with gc_paused():  # not across the yield: the consumer's own objects are not ours to hold back
                ar = self._next(live, index, iteration, bucket, elements)
            if ar is None:
                self._trailing(live)
                return
            yield ar

    def _next(self, live: list[RingStream], index: int, iteration: int, bucket: int, elements: int) -> Allreduce | None:
        """Allreduce ``index`` matched on the streams and merged; None: no stream holds it (or only re-sends)."""
        cursors = self.cursors
        # data uninitialised: the merges write every element they place, and what none placed is zeroed below
        # (zeroing every vector up front was ~4% of decode CPU)
        ar = Allreduce(index, iteration, bucket, elements, self.job.dtype,
                       np.empty(elements, self.dtype), np.zeros(elements, np.uint8))
        if self.partition is not None:
            ar.owned = self.partition.ranges(self.job, self.job.plan(iteration)[bucket])
        ats = {s.name: at for s in live if (at := self._find(s, cursors[s.name], elements)) is not None}
        self._skip_resends(live, ats, elements)
        if not ats:
            return None
        self._causal(live, ats, elements)
        if not ats or self._resent(live, ats, elements):
            return None
        taken: list = []
        for s in live:
            if s.name in ats:
                pattern = self.matcher.pattern(elements, s.position, s.channel)
                self._take(ar, s, ats[s.name], pattern, taken)
                cursors[s.name] = ats[s.name] + len(pattern)
        self._took = set(ats)
        self._merge(ar, taken)
        if not ar.copies.all():
            ar.data[ar.copies == 0] = 0  # missing elements read as zero, as they always have
        self.last = ar
        return ar

    def _resent(self, live: list[RingStream], ats: dict[str, int], elements: int) -> bool:
        """Whether the candidate is trailing sends that repeat final data of the last allreduce (an NCCL that
        re-sends final chunks, or adds a step re-sending the final chunk each rank received last) rather than an
        allreduce the capture cut off; ``_trailing`` then reports them as re-sends.

        Only a candidate that the end of the capture truncates on every stream is asked (schedule), and every send
        of it that delivers anything must be a re-send (``_repeats``: final values, PSNs that continue the
        connection) — the partial sums a new allreduce starts with never are.
        """
        trailing = []
        for s in live:
            if s.name not in ats:
                continue
            pattern = self.matcher.pattern(elements, s.position, s.channel)
            if self.last is None or not s.ended or ats[s.name] + len(pattern) - 1 <= s.last_step:
                return False
            trailing += [(s, step) for step in range(ats[s.name], s.last_step + 1)
                         if (ws := s.sends.get(step)) is not None and ws.size]
        verdicts = [self._repeats(s, step) for s, step in trailing]
        return not any(v is False for v in verdicts) and any(verdicts)

    def _repeats(self, s: RingStream, step: int) -> tuple[int, int] | bool | None:
        """The element range [a, b) of the last allreduce whose final values the send at ``step`` carries again
        (truthy), False: it carries other data or breaks the connection's PSN sequence, None: nothing to compare
        (it delivered nothing the last allreduce has, or only zeros, which any allreduce may carry).

        The evidence: the job's ring schedule says which element ranges the last allreduce's final sends cover on
        this channel (every position's, the chunk this rank received last among them); the send must have the wire
        size of one of them, every element it delivered that the last allreduce has must equal, bit for bit, that
        final value (a partial sum never does), and its first PSN must follow the previous send's last one on the
        connection.  Nothing of it is merged: elements the last allreduce lacks stay missing.
        """
        last, ws = self.last, s.sends[step]
        prev = s.sends.get(step - 1)
        if prev is not None and prev.info.get("psn") and ws.info.get("psn") and \
                prev.info["psn"][1] + 1 != ws.info["psn"][0]:
            return False
        blank, groups = False, self._final_starts(last.elements, s.channel).get(ws.size)
        if groups is None:
            return False  # no final send of the last allreduce has its size
        for count, starts in groups:  # (LL pads a line: counts that differ by an element can share a size)
            data, copies = np.zeros(count, self.dtype), np.zeros(count, np.uint8)
            if not ws.place(data, copies)[0]:
                return None
            bits, old = data.view(f"u{data.itemsize}"), last.data.view(f"u{data.itemsize}")
            got = np.flatnonzero(copies)
            # a few delivered elements against every candidate range at once; the whole send only where they agree
            probe = got[np.linspace(0, len(got) - 1, min(len(got), 8)).astype(np.int64)]
            at = starts[:, None] + probe[None, :]
            maybe = starts[((old[at] == bits[probe][None, :]) | (last.copies[at] == 0)).all(axis=1)]
            for start in maybe.tolist():
                both = (copies > 0) & (last.copies[start:start + count] > 0)  # what the last allreduce lacks: no evidence
                if not bits[both].any():
                    blank = True  # nothing to compare, or zeros (which any allreduce may carry)
                elif np.array_equal(bits[both], old[start:start + count][both]):
                    return start, start + count
        return None if blank else False

    def _final_starts(self, elements: int, channel: int) -> dict[int, list[tuple[int, np.ndarray]]]:
        """Wire size -> (elements, first elements) of the final sends of that size of an allreduce of ``elements`` on
        ``channel``, any ring position."""
        return final_starts(elements, self.params, channel)

    def _skip_resends(self, live: list[RingStream], ats: dict[str, int], elements: int) -> None:
        """Sends right after the last allreduce that re-send its final data (an NCCL that adds that step to every
        allreduce) are not the first step of the next one, even where they have its size: with equal chunk sizes the
        next allreduce would otherwise match one step early and take partial sums for final values.  They are reported
        as ``_trailing`` reports them, and the stream's search goes on after them."""
        if self.last is None:
            return
        for s in live:
            at, after = ats.get(s.name), self.cursors[s.name]
            if at != after or (s.name not in self._took and self._took):
                continue
            while at is not None and at == after and (ws := s.sends.get(at)) is not None and ws.size and \
                    (where := self._repeats(s, at)):
                self._report_resend(s, at, where, len(self.matcher.pattern(self.last.elements, s.position, s.channel))
                                    + 1 + at - self.cursors[s.name])
                after = at + 1
                at = self._find(s, after, elements)
            if at is None:
                del ats[s.name]
            else:
                ats[s.name] = at
            self.cursors[s.name] = after

    def _report_resend(self, s: RingStream, step: int, where: tuple[int, int], k: int) -> None:
        """The send at ``step`` re-sends final values of the last allreduce (elements ``where``; its ``k``-th step on
        the connection): ``resend_of`` on its skipped-send entry, a ``TrailingResend`` anomaly."""
        entry = next((e for e in reversed(self.skipped) if e["stream"] == s.name and e["step"] == step), None)
        if entry is None:
            ws = s.sends[step]
            entry = {"stream": s.name, "step": step, "wire_bytes": ws.size, **ws.info}
            self.skipped.append(entry)
        entry["resend_of"] = self.last.index
        self.anomalies.append(TrailingResend(s.name, step, self.last.index, k, where))

    def _trailing(self, live: list[RingStream]) -> None:
        """At the end of the capture, the sends after the last allreduce that re-send its final data are reported
        as re-sends (``resend_of`` among the skipped sends, a ``trailing_resend`` anomaly) and the cursors move past
        them.  A 0-byte send counts when it sits where the connection's re-send step would and the schedule's
        re-send there is the empty chunk, and a re-send with data was seen: it carries nothing to lose."""
        last = self.last
        if last is None or not all(s.ended for s in live):
            return
        found: list[tuple[RingStream, int, tuple[int, int]]] = []
        empty: list[tuple[RingStream, int]] = []
        after = {s.name: self.cursors[s.name] for s in live}  # the step after the last allreduce on each
        # the connections the last allreduce was taken from (a streaming decode's later window: all, each resuming
        # after its last used send)
        for s in [s for s in live if s.name in self._took] if self._took else live:
            for step in range(self.cursors[s.name], s.last_step + 1):
                ws = s.sends.get(step)
                if ws is None or ws.size is None:
                    break
                if ws.size == 0:
                    if step == self.cursors[s.name] and self._expected_resend_empty(last.elements, s):
                        empty.append((s, step))
                        continue
                    break
                where = self._repeats(s, step)
                if not where:
                    break
                found.append((s, step, where))
        if not found:
            return
        found += [(s, step, (0, 0)) for s, step in empty]
        n = {s.name: len(self.matcher.pattern(last.elements, s.position, s.channel)) for s in live}
        for s, step, where in sorted(found, key=lambda f: (f[0].name, f[1])):
            # k: its step in the allreduce's order on the connection, 1-based
            self._report_resend(s, step, where, n[s.name] + 1 + step - after[s.name])
            self.cursors[s.name] = max(self.cursors[s.name], step + 1)

    def _expected_resend_empty(self, elements: int, s: RingStream) -> bool:
        """The schedule's re-send step on this connection — the final chunk its sender received last, i.e. the last
        final send of its predecessor — carries no elements."""
        received = self.matcher.pattern(elements, (s.position - 1) % self.params.nranks, s.channel)
        return bool(received) and received[-1].count == 0

    def _causal(self, live: list[RingStream], ats: dict[str, int], elements: int) -> None:
        """Drop candidates that happen too early to be this allreduce.

        Sizes alone can be ambiguous (a parameter broadcast chunked like the allreduce looks the same on
        one connection).  The ring orders time, though: a rank sends its step j only after its predecessor's
        step j-1 reached it, so a candidate whose step j starts before the predecessor's step j-1 is some
        other collective; that stream's search moves on.
        """
        by_key = {(s.position, s.channel): s for s in live}
        for _ in range(64 * len(live)):
            bad = next((s for s in live if s.name in ats and self._too_early(s, by_key, ats, elements)), None)
            if bad is None:
                return
            nxt = self._find(bad, ats[bad.name] + 1, elements)
            if nxt is None:
                del ats[bad.name]
            else:
                ats[bad.name] = nxt

    def _too_early(self, s: RingStream, by_key: dict, ats: dict[str, int], elements: int) -> bool:
        pred = by_key.get(((s.position - 1) % self.params.nranks, s.channel))
        if pred is None or pred.name not in ats:
            return False
        n = len(self.matcher.pattern(elements, s.position, s.channel))
        for j in range(1, n):
            mine, theirs = s.sends.get(ats[s.name] + j), pred.sends.get(ats[pred.name] + j - 1)
            if not (mine and theirs and mine.size and theirs.size):
                continue  # an empty chunk's 0-byte send waits for nothing (seen in rdma32)
            t_mine, t_theirs = mine.info.get("t0"), theirs.info.get("t0")
            if t_mine is not None and t_theirs is not None:
                return t_mine <= t_theirs  # strictly after: the data must have arrived first
        return False

    def _find(self, s: RingStream, start: int, elements: int) -> int | None:
        """First step >= start where allreduce of ``elements`` fits this stream (skipping other sends)."""
        if isinstance(s.sends, SendColumns):
            columns = self.matcher.columns(elements, s.position, s.channel)
            match = partial(fits, s.sends, s.last_step, s.ended, pattern=columns)
        else:
            match = partial(self.matcher.fits, s, pattern=self.matcher.pattern(elements, s.position, s.channel))
        at = start
        while at <= s.last_step:
            ok = match(at=at)
            if ok:
                return at
            if ok is None and not s.ended:
                return None
            ws = s.sends.get(at)
            if ws is not None:
                self.skipped.append({"stream": s.name, "step": at, "wire_bytes": ws.size, **ws.info})
            at += 1
        return None

    def _take(self, ar: Allreduce, s: RingStream, at: int, pattern: Sequence[Send], taken: list) -> None:
        """The final sends of the allreduce found at step ``at`` onto ``taken``, in order: a source entry (a dict) for
        those with nothing to merge, (source, send, start, end) for those ``_merge`` merges — or, for a connection held
        as columns, all of them as one ``send_columns.Taken``."""
        if isinstance(s.sends, SendColumns) and ar.owned is None:
            columns = self.matcher.columns(ar.elements, s.position, s.channel)
            if len(columns.finals) and (columns.final_lo[0] < 0 or columns.final_hi.max() > ar.elements):
                raise ValueError(f"the pattern of allreduce {ar.index} lies outside its {ar.elements} elements")
            taken.append(Taken(s.position, s.channel, s.sends, at, columns, s.sends.lookup(at + columns.finals)))
            return
        for j, send in enumerate(pattern):
            if not send.final or send.count == 0:
                continue
            ws = s.sends.get(at + j)
            src = {"stream": s.name, "position": s.position, "channel": s.channel, "chunk": send.chunk,
                   "loop": send.loop, "range": [send.start, send.start + send.count], "step": at + j}
            if ar.owned is not None and not any(a < send.start + send.count and send.start < b for a, b in ar.owned):
                # another node's parameters: nothing to copy or compare; its time still settles a streaming decode
                taken.append({**src, "not_owned": True, **({"t0": ws.info["t0"]} if ws and "t0" in ws.info else {})})
                continue
            if ws is None:
                taken.append({**src, "elements_seen": 0, "lost": True})
                continue
            end = send.start + send.count
            if send.start < 0 or end > ar.elements:
                raise ValueError(f"send [{send.start}, {end}) lies outside allreduce {ar.index} of {ar.elements} elements")
            taken.append((src, ws, send.start, end))

    def _merge(self, ar: Allreduce, taken: list) -> None:
        """Merge the taken final sends in order: the first valid copy of each element wins, a later copy that differs
        is a conflict (natively: roce.merge_sends, sends over disjoint element ranges on ``workers`` threads)."""
        if taken and all(isinstance(t, Taken) for t in taken):
            ar.sources, conflicts, seen = merge_taken(ar.data, ar.copies, taken, self.workers)
            ar.conflicts += conflicts
            ar.placed_bytes += seen * ar.data.itemsize
            self.placed_bytes += seen * ar.data.itemsize
            return
        taken = [e for t in taken for e in (_entries(t) if isinstance(t, Taken) else [t])]
        todo = [t for t in taken if isinstance(t, tuple)]
        results = iter(self._place(ar, [(ws.place, a, b) for _, ws, a, b in todo]))
        for t in taken:
            if not isinstance(t, tuple):
                ar.sources.append(t)
                continue
            src, ws, _, _ = t
            seen, differing = next(results)
            ar.placed_bytes += seen * ar.data.itemsize
            self.placed_bytes += seen * ar.data.itemsize
            if differing:
                ar.conflicts.append({**src, "elements_differing": differing})
            ar.sources.append({**src, **ws.info, "elements_seen": seen})

    def _place(self, ar: Allreduce, places: list[tuple[Callable, int, int]]) -> list[tuple[int, int]]:
        """(seen, differing) of each placement, as if each ran in order; sends whose element ranges overlap (the m
        mirrored copies of one chunk) stay in one native call in that order, disjoint groups go to other threads.
        Within a call the copies of one chunk follow each other (component_order), so the 2nd and 3rd copies compare
        against a destination still in cache (bench_mirror (a): the merges' CPU -23%)."""
        if not all(hasattr(p, "job") for p, _, _ in places):  # a place that is not a SendPlacer: one at a time
            return [p(ar.data[a:b], ar.copies[a:b]) for p, a, b in places]
        bounds = np.array([(a, b) for _, a, b in places], np.int64).reshape(-1, 2)
        groups = merge_groups(bounds[:, 0], bounds[:, 1], self.workers)
        merged: list = [None] * len(places)
        first = places[0][0] if places else None
        if first is not None and all(hasattr(p, "row") and p.segments is first.segments and p.buf is first.buf
                                     and p.ll == first.ll for p, _, _ in places):
            # whole sends of one reassembly (streams.TablePlacer): rows, not a Python job per send
            rows = np.array([p.row(a, b) for p, a, b in places], dtype=np.int64).reshape(-1, 6)

            def run(group: list[int]) -> None:
                for i, m in zip(group, roce.merge_rows(first.buf, first.segments, rows[group], first.ll, ar.data, ar.copies)):
                    merged[i] = m
        else:
            jobs = [p.job(ar.data[a:b], ar.copies[a:b]) for p, a, b in places]

            def run(group: list[int]) -> None:
                for i, m in zip(group, roce.merge_sends([jobs[i] for i in group])):
                    merged[i] = m

        run_groups(run, groups)
        return [p.done(m) for (p, _, _), m in zip(places, merged)]


def _entries(t: Taken) -> list:
    """A column connection's ``Taken`` as ``Assembler._take``'s per-send entries (for a merge that also holds sends of
    the per-send path)."""
    out: list = []
    for src, i in zip(t.sources(), t.idx.tolist()):
        if i < 0:
            out.append({**src, "elements_seen": 0, "lost": True})
        else:
            lo, hi = src["range"]
            out.append((src, t.sends[int(t.sends.steps[i])], lo, hi))
    return out
