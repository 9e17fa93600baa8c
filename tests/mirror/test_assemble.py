"""Assembler: ring sends on mirrored streams -> exact allreduce vectors, missing ranges, conflicts."""
from __future__ import annotations

import numpy as np
import pytest

from flowcheck.capture.mirror import roce
from flowcheck.capture.mirror.assemble import Assembler, RingStream, WireSend, _runs
from flowcheck.capture.mirror.send_columns import merge_groups
from flowcheck.capture.mirror.job import job_from_dict
from flowcheck.capture.mirror.ring import ring_sends


def _job(n: int, buckets: list[int], channels: int = 1, first: list[int] | None = None):
    ring = [{"rank": r, "mac": f"02:00:00:00:00:{r:02x}"} for r in range(n)]
    return job_from_dict({"ring": ring, "dtype": "float32", "channels": channels,
                          "buckets": {"steady": buckets, **({"first": first} if first else {})}})


def _streams(job, vectors: list[np.ndarray], positions: list[int], *, lose=(), extra_before=0, cut=None,
             batched=False):
    """What mirrored outbound streams of ``positions`` carry for allreduces of ``vectors`` (finals only matter)."""
    p = job.ring_params(job.channels)
    out = []
    for pos in positions:
        for ch in range(job.channels):
            sends, step = {}, 1
            for _ in range(extra_before):  # another collective's send on the connection first
                sends[step] = WireSend(step, 48, lambda d, c: (0, 0), {})
                step += 1
            for k, vec in enumerate(vectors):
                for s in ring_sends(len(vec), p, pos, ch):
                    data = vec[s.start:s.start + s.count] if s.final else np.full(s.count, np.nan, np.float32)
                    if (pos, ch, k, s.step) not in lose:
                        sends[step] = WireSend(step, p.wire_bytes(s.count), _filler(data, cut, batched), {})
                    step += 1
            out.append(RingStream(f"p{pos}c{ch}", pos, ch, sends, 1, step - 1))
    return out


def _filler(data: np.ndarray, cut, batched: bool = False):
    """WireSend.place of a send whose first ``cut`` data bytes arrived (Simple: one raw segment, merged natively);
    ``batched``: with the job/done pair of streams.SendPlacer, so the Assembler merges it in batches on threads."""
    raw = data.view(np.uint8)
    n = raw.nbytes if cut is None else min(raw.nbytes, cut)
    segs = np.zeros(1, roce.SEGMENT)
    segs["length"] = n
    return _Placer(raw, segs) if batched else lambda out, copies: _Placer(raw, segs)(out, copies)


class _Placer:
    def __init__(self, raw: np.ndarray, segs: np.ndarray) -> None:
        self.raw, self.segs = raw, segs

    def job(self, out, copies):
        return roce.merge_job(self.raw, [(self.segs, 0)], None, False, out, copies)

    def done(self, merged):
        return merged.seen, merged.differing

    def __call__(self, out, copies):
        return self.done(roce.merge_sends([self.job(out, copies)])[0])


@pytest.mark.parametrize("n,channels", [(2, 1), (2, 2), (3, 1), (4, 2), (8, 2)])
def test_two_consecutive_outbound_streams_recover_every_element(n, channels):
    job = _job(n, [30000, 777], channels)
    rng = np.random.default_rng(n)
    vecs = [rng.standard_normal(30000).astype(np.float32), rng.standard_normal(777).astype(np.float32)] * 2
    got = list(Assembler(job, channels).assemble(_streams(job, vecs, [0, 1])))
    assert len(got) == 4
    for ar, vec in zip(got, vecs):
        assert ar.complete and ar.missing() == []
        assert ar.data.tobytes() == vec.tobytes()
    assert [(a.iteration, a.bucket) for a in got] == [(1, 0), (1, 1), (2, 0), (2, 1)]


def test_one_outbound_stream_misses_exactly_its_successors_chunk():
    job = _job(4, [40000])
    vec = np.arange(40000, dtype=np.float32)
    (ar,) = Assembler(job, 1).assemble(_streams(job, [vec], [0]))
    assert not ar.complete and "sha256" not in ar.summary()
    p = job.ring_params(1)
    want = [(s.start, s.start + s.count) for s in ring_sends(40000, p, 1, 0) if s.final and s.chunk == 1]
    assert ar.missing() == want  # chunk 1 (position 0's successor) is finalised only by position 1


def test_missing_elements_read_as_zero_whatever_the_vector_held_before(monkeypatch):
    """Allreduce vectors start uninitialised (the merges write what they place): what no copy reached is zeroed."""
    monkeypatch.setattr(np, "empty", lambda shape, dtype=float: np.full(shape, 7, dtype))  # memory left dirty
    job = _job(4, [40000])
    vec = np.arange(1, 40001, dtype=np.float32)
    (ar,) = Assembler(job, 1).assemble(_streams(job, [vec], [0]))
    missing = ar.copies == 0
    assert missing.any() and not ar.data[missing].any()
    assert ar.data[~missing].tobytes() == vec[~missing].tobytes()


def test_a_lost_send_is_covered_by_another_stream_and_reported_when_not():
    job = _job(3, [20000])
    vec = np.random.default_rng(0).standard_normal(20000).astype(np.float32)
    p = job.ring_params(1)
    final_step = next(s.step for s in ring_sends(20000, p, 0, 0) if s.final)
    lose = {(0, 0, 0, final_step)}
    (ar,) = Assembler(job, 1).assemble(_streams(job, [vec], [0, 1, 2], lose=lose))
    assert ar.complete and ar.data.tobytes() == vec.tobytes()
    assert ar.copies.min() == 1 and ar.copies.max() == 2  # N-1 senders finalise each chunk
    (ar,) = Assembler(job, 1).assemble(_streams(job, [vec], [0, 1], lose=lose | {(1, 0, 0, final_step + 1)}))
    assert not ar.complete and ar.missing()


def test_other_collectives_before_the_allreduce_are_skipped_not_counted():
    job = _job(2, [5000])
    vec = np.ones(5000, np.float32)
    asm = Assembler(job, 1)
    (ar,) = asm.assemble(_streams(job, [vec], [0, 1], extra_before=3))
    assert ar.complete and len(asm.skipped) == 6


def test_partial_data_leaves_exact_missing_element_ranges():
    job = _job(2, [5000])
    vec = np.ones(5000, np.float32)
    (ar,) = Assembler(job, 1).assemble(_streams(job, [vec], [0, 1], cut=1000))
    # each final send delivered its first 1000 bytes = 250 elements
    assert ar.missing() == [(250, 3072), (3072 + 250, 5000)]


def test_copies_that_disagree_make_the_allreduce_untrusted():
    job = _job(3, [9000])
    vec = np.random.default_rng(1).standard_normal(9000).astype(np.float32)
    streams = _streams(job, [vec], [0, 1])
    bad = vec.copy()
    bad[4000] += 1  # chunk 1: finalised by positions 1 and 2
    streams += [s for s in _streams(job, [bad], [2])]
    (ar,) = Assembler(job, 1).assemble(streams)
    assert ar.conflicts and not ar.complete


def test_first_iteration_plan_differs():
    job = _job(2, [3000, 2000], first=[5000])
    vecs = [np.full(5000, 1, np.float32), np.full(3000, 2, np.float32), np.full(2000, 3, np.float32)]
    got = list(Assembler(job, 1).assemble(_streams(job, vecs, [0, 1])))
    assert [(a.iteration, a.bucket, a.elements) for a in got] == [(1, 0, 5000), (2, 0, 3000), (2, 1, 2000)]
    assert all(a.complete for a in got)


def test_runs():
    assert _runs(np.array([0, 1, 1, 0, 1], bool)) == [(1, 3), (4, 5)]
    assert _runs(np.zeros(3, bool)) == []


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_batched_merge_on_k_threads_equals_one_send_at_a_time_even_when_copies_disagree(workers):
    """The final sends of an allreduce merged in batches (disjoint ranges on ``workers`` threads) give the same
    vectors, copy counts, sources and conflicts as merging one send at a time: the first stream's copy wins."""
    job = _job(4, [9000, 5000])
    rng = np.random.default_rng(2)
    vecs = [rng.standard_normal(9000).astype(np.float32), rng.standard_normal(5000).astype(np.float32)]
    bad = [v.copy() for v in vecs]
    bad[0][[10, 4000, 8999]] += 1  # chunks finalised by several positions: copies disagree
    bad[1][[1, 2600]] -= 1

    def run(batched: bool, k: int):
        streams = _streams(job, vecs, [0, 1], batched=batched, lose={(1, 0, 1, 9)})
        streams += _streams(job, bad, [2, 3], batched=batched, cut=3000)
        return [(a.summary(), a.data.tobytes(), a.copies.tobytes()) for a in Assembler(job, 1, workers=k).assemble(streams)]

    want, got = run(False, 1), run(True, workers)
    assert got == want
    assert len(got) == 2 and all(s["conflicts"] for s, _, _ in got)  # the order of copies mattered


def _groups(ranges, k):
    bounds = np.array(ranges, np.int64).reshape(-1, 2)
    return [g.tolist() for g in merge_groups(bounds[:, 0], bounds[:, 1], k)]


def test_merge_groups_keep_overlapping_ranges_together_in_order():
    ranges = [(0, 10), (5, 15), (20, 30), (20, 30), (40, 41), (15, 20)]
    for k in (1, 2, 3, 8):
        groups = _groups(ranges, k)
        assert sorted(i for g in groups for i in g) == list(range(len(ranges))) and len(groups) <= k
        where = {i: n for n, g in enumerate(groups) for i in g}
        assert where[0] == where[1] and where[2] == where[3]
        for g in groups:  # overlapping ranges keep their order
            assert all(g.index(a) < g.index(b) for a in g for b in g if a < b and ranges[a][0] < ranges[b][1]
                       and ranges[b][0] < ranges[a][1])
    assert len(_groups(ranges, 8)) == 4  # {0,1}, {2,3}, {4}, {5}: [15, 20) touches but does not overlap
    assert _groups([], 4) == []
    # contiguous runs of components balanced by elements
    assert _groups([(0, 100), (200, 210), (300, 390), (400, 420)], 2) == [[0, 1], [2, 3]]
    assert _groups([(0, 10), (10, 20), (20, 30), (30, 40), (40, 50), (50, 60)], 3) == [[0, 1], [2, 3], [4, 5]]
    assert _groups([(0, 90), (90, 100), (100, 110)], 2) == [[0], [1, 2]]
    assert _groups([(0, 0), (5, 5)], 2) == [[0], [1]]  # empty ranges: one each (no elements to balance)


def test_merge_groups_put_the_copies_of_a_chunk_together_keeping_their_order():
    # stream-major order, as Assembler._take lists final sends: three streams' copies of chunks [0,8), [8,16), [16,24)
    ranges = [(0, 8), (8, 16), (16, 24), (8, 16), (16, 24), (0, 8), (16, 24), (0, 8), (8, 16)]
    assert _groups(ranges, 1) == [[0, 5, 7, 1, 3, 8, 2, 4, 6]]
    # overlapping but unequal ranges form one component, kept in index order
    assert _groups([(0, 10), (5, 15), (30, 40), (12, 20), (0, 2)], 1) == [[0, 1, 3, 4, 2]]
