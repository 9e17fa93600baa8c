"""A ring connection's sends as columns, matched against the ring schedule and merged as arrays.

Most ring connections consist of whole sends (``streams.MessageTable.whole_sends``): one RDMA write per NCCL step, its
size the immediate, its data one run of the reassembler's segment table.  Held as arrays instead of one ``WireSend``
and placer object per send, an allreduce costs Python per allreduce rather than per send: the matcher compares a
pattern's wire sizes in one numpy expression, and the final sends become rows of one ``roce.merge_rows`` call
(bench_mirror (a): the per-send Python was ~a third of decode's CPU).  A ``WireSend`` is built only for the few sends
asked for one at a time (skipped sends, the causality and re-send checks, a streaming decode's resume point), the
same one the per-send path builds; ``tests/mirror/test_send_columns.py`` holds the two paths' reports equal.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from flowcheck.capture.mirror import roce
from flowcheck.capture.mirror.anomalies import Anomaly, unplaced_anomaly
from flowcheck.capture.mirror.ring import PatternColumns


class SendColumns(Mapping):
    """A connection's sends by step (``RingStream.sends``), one array entry per step, sorted by step.

    Per entry: the step, the declared wire size (-1: unknown), its segment rows [seg_a, seg_b), its message's LL flag
    (-1: none; what the merge checks the lines against), PSNs, first-packet time; ``order``: the entries in the order
    their messages arrived (the order a dict of the per-send path iterates in).  ``build(i)`` makes entry i's
    ``WireSend``; each is built once.
    """

    __slots__ = ("name", "steps", "size", "seg_a", "seg_b", "flag", "first_psn", "last_psn", "t0", "order",
                 "segments", "buf", "ll", "anomalies", "build", "_built")

    def __init__(self, name: str, columns: dict[str, np.ndarray], order: np.ndarray, segments: np.ndarray,
                 buf: np.ndarray, ll: bool, anomalies: list[Anomaly], build: Callable[[SendColumns, int], object]) -> None:
        self.name = name
        self.steps, self.size, self.seg_a, self.seg_b = (columns[k] for k in ("steps", "size", "seg_a", "seg_b"))
        self.flag, self.first_psn, self.last_psn, self.t0 = (columns[k] for k in ("flag", "first_psn", "last_psn", "t0"))
        self.order, self.segments, self.buf, self.ll, self.anomalies, self.build = order, segments, buf, ll, anomalies, build
        self._built: dict[int, object] = {}

    def lookup(self, steps: np.ndarray) -> np.ndarray:
        """The entry of each step in ``steps`` (-1: no send at that step)."""
        at = np.searchsorted(self.steps, steps)
        inside = at < len(self.steps)
        found = inside & (self.steps[np.where(inside, at, 0)] == steps) if len(self.steps) else inside
        return np.where(found, at, -1)

    def where(self, i: int) -> dict:
        """Entry i as reports name a send (``WireSend.info``)."""
        return {"stream": self.name, "psn": [int(self.first_psn[i]), int(self.last_psn[i])], "flag": int(self.steps[i]),
                "t0": int(self.t0[i])}

    def _index(self, step) -> int:
        if not isinstance(step, (int, np.integer)):
            return -1
        i = int(np.searchsorted(self.steps, step))
        return i if i < len(self.steps) and self.steps[i] == step else -1

    def __getitem__(self, step: int):
        i = self._index(step)
        if i < 0:
            raise KeyError(step)
        if i not in self._built:
            self._built[i] = self.build(self, i)
        return self._built[i]

    def __contains__(self, step) -> bool:
        return self._index(step) >= 0

    def __iter__(self) -> Iterator[int]:
        return iter(self.steps[self.order].tolist())

    def __len__(self) -> int:
        return len(self.steps)


def fits(sends: SendColumns, last_step: int, ended: bool, at: int, pattern: PatternColumns) -> bool | None:
    """``Matcher.fits`` on columns: True/False when the sends from step ``at`` do/don't have the pattern's wire sizes;
    None: the capture goes on and ends inside the pattern.  A lost send, or one of unknown size, fits anything; an
    empty send is no evidence."""
    n = len(pattern.wire)
    k = max(0, min(n, last_step - at + 1))  # the pattern's sends the capture holds so far
    idx = sends.lookup(np.arange(at, at + k))
    size = np.where(idx >= 0, sends.size[idx], -1)
    known = size >= 0
    if (size[known] != pattern.wire[:k][known]).any():
        return False
    seen = bool((size[known] > 0).any())
    if k < n:
        return seen if ended else None
    return seen


@dataclass(frozen=True, eq=False)
class Taken:
    """The final sends of one allreduce on one column connection: pattern entry j of ``pattern.finals`` is step
    ``at + pattern.finals[j]``, entry ``idx[j]`` of the connection's columns (-1: lost)."""

    position: int
    channel: int
    sends: SendColumns
    at: int
    pattern: PatternColumns
    idx: np.ndarray

    def sources(self) -> list[dict]:
        """The final sends as an allreduce's sources before the merge (what ``Assembler._take`` lists)."""
        return _sources(self.sends.name, self.position, self.channel, self.at, self.pattern)


def _sources(name: str, position: int, channel: int, at: int, p: PatternColumns) -> list[dict]:
    return [{"stream": name, "position": position, "channel": channel, "chunk": chunk, "loop": loop, "range": [lo, hi],
             "step": at + j}
            for j, chunk, loop, lo, hi in zip(p.final_step, p.final_chunk, p.final_loop, p.final_start, p.final_end)]


@dataclass(frozen=True, eq=False)
class SourceBlock:
    """One column connection's final sends of a merged allreduce, as arrays per final send: what its source dicts
    say.  It copies what it needs, so an allreduce handed out holds no capture window alive."""

    name: str
    position: int
    channel: int
    at: int
    pattern: PatternColumns
    lost: np.ndarray  # bool: the send never arrived
    first_psn: np.ndarray
    last_psn: np.ndarray
    t0: np.ndarray
    seen: np.ndarray  # elements it delivered (0 when lost)

    def dicts(self) -> list[dict]:
        """Its sources as ``Assembler._merge`` lists them (per send: where from, what it delivered)."""
        out = _sources(self.name, self.position, self.channel, self.at, self.pattern)
        for src, lost, a, b, t0, n in zip(out, self.lost.tolist(), self.first_psn.tolist(), self.last_psn.tolist(),
                                         self.t0.tolist(), self.seen.tolist()):
            if lost:
                src["elements_seen"], src["lost"] = 0, True
            else:
                src["psn"], src["flag"], src["t0"], src["elements_seen"] = [a, b], src["step"], t0, n
        return out


class ColumnSources(Sequence):
    """``Allreduce.sources`` of an allreduce merged from column connections: the source dicts are built on first use.
    A decode makes them for every final send (~3 objects each) and the garbage collector then walks them all —
    ~5 ms of a 90 ms decode (bench_mirror (a)) — while the node's counters and the streaming decoder need only a few
    numbers of them (``Allreduce.latest_t0``, ``Allreduce.source_ranges``); the report builds them."""

    __slots__ = ("blocks", "_dicts")

    def __init__(self, blocks: list[SourceBlock]) -> None:
        self.blocks, self._dicts = blocks, None

    def _all(self) -> list[dict]:
        if self._dicts is None:
            self._dicts = [d for b in self.blocks for d in b.dicts()]
        return self._dicts

    def __len__(self) -> int:
        return sum(len(b.seen) for b in self.blocks)

    def __getitem__(self, i):
        return self._all()[i]

    def __iter__(self) -> Iterator[dict]:
        return iter(self._all())

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def latest_t0(self) -> int | None:
        """The latest first-packet time of a send that arrived (None: none did)."""
        times = [int(b.t0[~b.lost].max()) for b in self.blocks if (~b.lost).any()]
        return max(times, default=None)

    def ranges(self) -> Iterator[tuple[int, int, int]]:
        """(start, end, elements seen) of every source, in order."""
        for b in self.blocks:
            yield from zip(b.pattern.final_start, b.pattern.final_end, b.seen.tolist())


def merge_taken(data: np.ndarray, copies: np.ndarray, taken: list[Taken], workers: int
                ) -> tuple[ColumnSources, list[dict], int]:
    """Merge the final sends of ``taken`` (in that order, as ``Assembler._merge`` merges its list) into ``data`` /
    ``copies``: (sources, conflicts, elements seen in all).  The LL segments left unplaced are reported on each
    connection's anomalies, send by send, as the per-send placer reports them."""
    present = [t.idx >= 0 for t in taken]  # sends lost entirely have nothing to merge
    rows = np.concatenate([np.stack([t.sends.seg_a[t.idx[ok]], t.sends.seg_b[t.idx[ok]], np.zeros(int(ok.sum()), np.int64),
                                     t.sends.flag[t.idx[ok]], t.pattern.final_lo[ok], t.pattern.final_hi[ok]], axis=1)
                           for t, ok in zip(taken, present)]).reshape(-1, 6)
    seen, differing, unplaced = _merge_rows(rows, data, copies, workers, taken[0].sends)
    blocks, conflicts, r = [], [], 0
    for t, ok in zip(taken, present):
        sc, n = t.sends, int(ok.sum())
        at = t.idx[ok]
        got = np.zeros(len(ok), np.int64)
        got[ok] = seen[r:r + n]
        if differing[r:r + n].any():  # rare: conflicts (the sources built once per connection)
            srcs, js = t.sources(), np.flatnonzero(ok)
            for k in np.flatnonzero(differing[r:r + n]).tolist():
                conflicts.append({**srcs[int(js[k])], "elements_differing": int(differing[r + k])})
        for k in range(n) if unplaced else ():  # rare: LL segments left out, reported send by send
            for status, nbytes in unplaced.get(r + k, ()):
                sc.anomalies.append(unplaced_anomaly(sc.where(int(at[k])), status, nbytes))
        r += n
        i = np.maximum(t.idx, 0)  # (a lost send's entries are not read)
        blocks.append(SourceBlock(sc.name, t.position, t.channel, t.at, t.pattern, ~ok, sc.first_psn[i], sc.last_psn[i],
                                  sc.t0[i], got))
    return ColumnSources(blocks), conflicts, int(seen.sum())


def _merge_rows(rows: np.ndarray, data: np.ndarray, copies: np.ndarray, workers: int, sends: SendColumns
                ) -> tuple[np.ndarray, np.ndarray, dict[int, list[tuple[int, int]]]]:
    """(seen, differing) per row and the unplaced segments by row, as if the rows merged in order: the copies of one
    chunk merge together (``merge_groups``), disjoint groups on ``workers`` threads."""
    n = len(rows)
    seen, differing = np.zeros(n, np.int64), np.zeros(n, np.int64)
    unplaced: dict[int, list[tuple[int, int]]] = {}

    def run(group: np.ndarray) -> None:
        s, d, bad = roce.merge_row_columns(sends.buf, sends.segments, rows[group], sends.ll, data, copies)
        seen[group], differing[group] = s, d
        for k, status, nbytes in bad:
            unplaced.setdefault(int(group[k]), []).append((status, nbytes))

    run_groups(run, merge_groups(rows[:, 4], rows[:, 5], workers))
    return seen, differing, unplaced


def run_groups(run: Callable[[np.ndarray], None], groups: list[np.ndarray]) -> None:
    """``run`` each merge group: on this thread when there is one, else one thread each (they touch disjoint
    elements; the native merge releases the GIL)."""
    if len(groups) <= 1:
        for g in groups:
            run(g)
        return
    with ThreadPoolExecutor(len(groups), thread_name_prefix="merge") as pool:
        list(pool.map(run, groups))


def merge_groups(starts: np.ndarray, ends: np.ndarray, k: int) -> list[np.ndarray]:
    """Indices of the ranges [starts, ends) in at most ``k`` groups such that overlapping ranges share a group, each
    group in component order (a component: ranges that overlap, transitively; components by start, each in index
    order), each group a contiguous run of components balanced by elements (a component goes to the group its
    midpoint in the cumulative element count falls in; one each when there are no more than ``k``).  Merging a group in
    this order gives what index order gives — disjoint components touch different elements and overlapping ranges keep
    their order — while the m mirrored copies of a chunk merge one after another, the destination still in cache.
    Contiguous runs keep each thread's writes to ``data``/``copies`` in one region: with groups that interleaved
    components (largest first onto the lightest group) a 2-worker decode's merges took 1.22x the CPU of one worker's,
    with runs 1.00x (bench_mirror (a)'s traffic, BENCHMARKS.md "Mirror decode at 2 workers on the 2-core VM")."""
    n = len(starts)
    if not n:
        return []
    index = np.arange(n)
    by_start = np.lexsort((index, starts))
    s, e = starts[by_start], ends[by_start]
    new = np.ones(n, bool)
    new[1:] = s[1:] >= np.maximum.accumulate(e)[:-1]
    comp = np.cumsum(new) - 1
    ordered = by_start[np.lexsort((by_start, comp))]  # component by component, each in index order
    comp_of = np.empty(n, np.int64)
    comp_of[by_start] = comp
    ncomp = int(comp[-1]) + 1
    k = max(1, min(k, ncomp))
    if k == 1:
        return [ordered]
    if k == ncomp:
        bin_of = np.arange(ncomp)
    else:
        weight = np.bincount(comp, weights=e - s, minlength=ncomp)
        cum = np.cumsum(weight)
        mid = cum - weight / 2  # each component's midpoint in the elements of all of them
        bin_of = np.minimum((mid * k // max(cum[-1], 1)).astype(np.int64), k - 1)
    bins = bin_of[comp_of[ordered]]
    return [g for j in range(k) if len(g := ordered[bins == j])]
