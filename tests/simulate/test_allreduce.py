"""The simulated ring allreduce sums every chunk in NCCL's ring order, and its sends carry the running sums."""
from __future__ import annotations

import numpy as np
import pytest

from flowcheck.capture.mirror.ring import RingParams, reduce_order, ring_pattern, ring_sends
from flowcheck.simulate.allreduce import chunks, ring_allreduce

# small steps so that a few hundred elements already need several loops and leave empty chunks
SMALL = {"align_bytes": 64, "step_bytes": 256}


def _inputs(n: int, count: int, seed: int, dtype=np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype == np.int32:
        return [rng.integers(-2**31, 2**31 - 1, size=count, dtype=np.int32) for _ in range(n)]
    # wildly different magnitudes: the summation order shows in the low bits
    return [(rng.standard_normal(count) * 10.0 ** rng.integers(-4, 5, size=count)).astype(dtype) for _ in range(n)]


def _chunk_instances(count: int, p: RingParams) -> list[tuple[int, int, int]]:
    """(chunk, start, count) from the schedule: the allgather send where position c first sends chunk c's final."""
    out = []
    for b in range(p.nchannels):
        for c in range(p.nranks):
            out += [(s.chunk, s.start, s.count) for s in ring_sends(count, p, c, b) if s.final and s.chunk == c]
    return out


def _left_to_right(xs: list[np.ndarray], order: list[int], e: int, upto: int) -> np.generic:
    acc = xs[order[0]][e]
    for pos in order[1:upto]:
        acc = type(acc)(acc + xs[pos][e])  # a numpy scalar add: one rounding
    return acc


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("channels", [1, 2])
@pytest.mark.parametrize("count", [37, 700])
def test_final_is_the_left_to_right_sum_in_ring_order(n, channels, count):
    p = RingParams(n, channels, "ll", 4, **SMALL)
    xs = _inputs(n, count, seed=n * 100 + channels * 10 + count)
    red = ring_allreduce(xs, p)
    instances = _chunk_instances(count, p)
    assert sum(c for _, _, c in instances) == count
    if count == 37 and n * channels >= 4:
        assert any(c == 0 for _, _, c in instances), "expected empty tail chunks"
    for chunk, start, elems in instances:
        order = reduce_order(chunk, n)
        for e in range(start, start + elems):
            want = _left_to_right(xs, order, e, n)
            assert red.final[e].tobytes() == want.tobytes(), (chunk, e)


def test_several_loops_are_exercised():
    p = RingParams(4, 2, "ll", 4, **SMALL)
    assert len({s.loop for s in ring_sends(700, p, 0, 0)}) > 2


def test_summation_order_matters_for_these_inputs():
    """Guards the test above: a naive rank-order sum differs somewhere, so order mistakes would show."""
    p = RingParams(8, 1, "ll", 4, **SMALL)
    xs = _inputs(8, 700, seed=1)
    naive = xs[0].copy()
    for x in xs[1:]:
        naive = naive + x
    assert not np.array_equal(ring_allreduce(xs, p).final, naive)


@pytest.mark.parametrize("n,channels,proto", [(2, 2, "ll"), (3, 1, "ll"), (4, 2, "simple"), (8, 2, "ll")])
def test_sends_carry_running_sums_and_every_rank_ends_with_the_same_final(n, channels, proto):
    count = 900
    p = RingParams(n, channels, proto, 4, align_bytes=64, step_bytes=256, chunk_steps=2 if proto == "simple" else 1)
    xs = _inputs(n, count, seed=5)
    red = ring_allreduce(xs, p)
    for b in range(channels):
        for i in range(n):
            for s in ring_sends(count, p, i, b):
                got = red.payload(i, s)
                assert got.shape == (s.count,)
                order = reduce_order(s.chunk, n)
                terms = n if s.final else order.index(i) + 1  # position i just added its own term
                for k, e in enumerate(range(s.start, s.start + s.count)):
                    assert got[k].tobytes() == _left_to_right(xs, order, e, terms).tobytes()
                if s.final:  # what every rank receives in the allgather is the one final vector
                    assert np.array_equal(got, red.final[s.start:s.start + s.count])


def test_the_receiver_adds_its_own_term_to_what_it_received():
    n, count = 4, 500
    p = RingParams(n, 1, "ll", 4, **SMALL)
    xs = _inputs(n, count, seed=9)
    red = ring_allreduce(xs, p)
    for i in range(n):
        nxt = (i + 1) % n
        for s_out in ring_sends(count, p, i, 0):
            if s_out.final or s_out.count == 0:
                continue
            # the successor's next partial of the same chunk (or the final, if it is the chunk's owner)
            sl = slice(s_out.start, s_out.start + s_out.count)
            expect = red.payload(i, s_out) + xs[nxt][sl]
            if nxt == s_out.chunk:
                assert np.array_equal(red.final[sl], expect)
            else:
                follow = next(s for s in ring_sends(count, p, nxt, 0)
                              if not s.final and s.chunk == s_out.chunk and s.start == s_out.start)
                assert np.array_equal(red.payload(nxt, follow), expect)


def test_int32_sums_wrap_like_nccl():
    p = RingParams(3, 2, "ll", 4, **SMALL)
    xs = _inputs(3, 300, seed=3, dtype=np.int32)
    with np.errstate(over="ignore"):
        want = (xs[0].astype(np.int64) + xs[1] + xs[2]).astype(np.int32)
    assert np.array_equal(ring_allreduce(xs, p).final, want)


def test_chunks_tile_the_buffer_exactly():
    for proto in ("ll", "simple"):
        p = RingParams(5, 3, proto, 4, **SMALL, chunk_steps=2 if proto == "simple" else 1)
        cover = np.zeros(1234, dtype=int)
        for _, start, elems in chunks(1234, p):
            cover[start:start + elems] += 1
        assert (cover == 1).all()


def test_ring_pattern_is_ring_sends_remembered_and_unchangeable():
    p = RingParams(4, 2, "ll", 4, **SMALL)
    first = ring_pattern(700, p, 1, 1)
    assert first == tuple(ring_sends(700, p, 1, 1))
    assert ring_pattern(700, RingParams(4, 2, "ll", 4, **SMALL), 1, 1) is first  # equal params: the same pattern
    assert ring_pattern(700, p, 2, 1) == tuple(ring_sends(700, p, 2, 1)) != first
    with pytest.raises(AttributeError):
        first[0].count = 1  # shared between decoders: frozen
