"""NCCL's ring allreduce schedule: which elements each send on a ring connection carries.

The rules follow NCCL's ``runRing`` for AllReduce (the 2.18 line the FlowCheck captures
were taken with) and are confirmed on those captures (../shared/data/pcaps/README.md):

- the buffer is walked in *loops* of ``nchannels * nranks * chunk`` elements; in each loop
  the chunk size is ``min(max_chunk, ceil(rest / (nchannels*nranks)))`` rounded up to
  ``align_bytes`` (4096 B observed);
- LL / LL128 put chunk ``c`` of channel ``b`` at ``(c*nchannels + b) * chunk``; Simple puts
  it at ``(b*nranks + c) * chunk``; the last chunk is short and may be empty (a 0-byte send
  that still uses an NCCL step);
- per loop and channel the rank at ring position ``i`` sends 2(N-1) steps to its successor:
  partial sums of chunks i-1, i-2, ..., i-(N-1) (reduce-scatter), then the final values of
  chunks i, i-1, ..., i-(N-2) (allgather).  Its outbound stream therefore misses only the
  final of chunk i+1, and chunk c is reduced in ring order c+1, c+2, ..., c+N-1, c.

Everything here is in ring positions (0..N-1); the job maps positions to ranks and NICs.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from flowcheck.errors import JobError

PROTOCOLS = ("ll", "ll128", "simple")


@dataclass(frozen=True)
class RingParams:
    """What fixes the schedule of one allreduce (besides its element count)."""

    nranks: int
    nchannels: int
    protocol: str  # ll | ll128 | simple
    itemsize: int  # bytes per element (4 fp32/int32, 2 bf16)
    align_bytes: int = 4096  # chunk sizes are rounded up to this many data bytes
    step_bytes: int = 65536  # wire bytes of one NCCL step (LL: 64 KiB; Simple: 512 KiB)
    chunk_steps: int = 1  # steps per chunk at most (Simple: 4 in NCCL, LL/LL128: 1)

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise JobError(f"protocol: expected one of {PROTOCOLS}, found {self.protocol!r}")
        if self.nranks < 2:
            raise JobError(f"ring: expected at least 2 members, found {self.nranks}")
        if self.nchannels < 1:
            raise JobError(f"channels: expected >= 1, found {self.nchannels}")
        if self.itemsize not in (1, 2, 4, 8):
            raise JobError(f"dtype: expected an element size of 1, 2, 4 or 8 bytes, found {self.itemsize}")
        if self.align_bytes % self.itemsize or self.step_data_bytes % self.itemsize:
            raise JobError(f"align_bytes/step_bytes must be multiples of the element size {self.itemsize}")

    @property
    def step_data_bytes(self) -> int:
        """Data bytes one step carries: LL halves the wire bytes (flags), LL128 keeps 120 of 128."""
        if self.protocol == "ll":
            return self.step_bytes // 2
        if self.protocol == "ll128":
            return self.step_bytes // 128 * 120
        return self.step_bytes

    @property
    def max_chunk(self) -> int:
        return self.step_data_bytes * self.chunk_steps // self.itemsize

    def wire_bytes(self, elements: int) -> int:
        """Bytes an RDMA send of ``elements`` occupies on the wire (the immediate / DMA length)."""
        data = elements * self.itemsize
        if self.protocol == "ll":
            return -(-data // 8) * 16  # 8 data bytes per 16-byte line
        if self.protocol == "ll128":
            return -(-data // 120) * 128
        return data


@dataclass(frozen=True)
class Send:
    """One NCCL step on one ring connection of one allreduce."""

    loop: int
    step: int  # index of this send within the allreduce on this channel (0-based, all loops)
    chunk: int  # ring position whose chunk it is
    start: int  # first element in the allreduced buffer
    count: int  # elements (0 for an empty tail chunk)
    final: bool  # allgather (fully reduced values) rather than a reduce-scatter partial sum


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def loops(count: int, p: RingParams) -> list[tuple[int, int]]:
    """(loop offset, chunk size in elements) of every loop of an allreduce of ``count`` elements."""
    align = p.align_bytes // p.itemsize
    per_loop = p.nchannels * p.nranks
    out = []
    offset = 0
    while offset < count or (count == 0 and not out):
        chunk = min(p.max_chunk, _round_up(-(-(count - offset) // per_loop), align))
        chunk = max(chunk, align)
        out.append((offset, chunk))
        offset += per_loop * chunk
        if count == 0:
            break
    return out


def chunk_range(count: int, p: RingParams, loop_offset: int, chunk_size: int, chunk: int, channel: int) -> tuple[int, int]:
    """(start, elements) of ring chunk ``chunk`` on ``channel`` in the loop at ``loop_offset``."""
    if p.protocol == "simple":
        start = loop_offset + (channel * p.nranks + chunk) * chunk_size
    else:
        start = loop_offset + (chunk * p.nchannels + channel) * chunk_size
    end = min(count, start + chunk_size)
    return min(start, count), max(0, end - start)


def ring_sends(count: int, p: RingParams, position: int, channel: int) -> list[Send]:
    """Every send the rank at ring ``position`` makes on ``channel`` for an allreduce of ``count``.

    A chunk larger than one step (Simple) goes out as several sends of at most one step each.
    """
    n = p.nranks
    step_elems = p.step_data_bytes // p.itemsize
    sends: list[Send] = []
    for li, (off, size) in enumerate(loops(count, p)):
        order = [((position - 1 - j) % n, False) for j in range(n - 1)]
        order += [((position - j) % n, True) for j in range(n - 1)]
        for chunk, final in order:
            start, elems = chunk_range(count, p, off, size, chunk, channel)
            pieces = max(1, -(-elems // step_elems))
            for k in range(pieces):
                lo = start + k * step_elems
                sends.append(Send(li, len(sends), chunk, lo, max(0, min(elems - k * step_elems, step_elems)), final))
    return sends


@lru_cache(maxsize=32)
def ring_pattern(count: int, p: RingParams, position: int, channel: int) -> tuple[Send, ...]:
    """``ring_sends``, remembered: a decoder matches the same few patterns every iteration (one per bucket size, ring
    position and channel), and building one is ~1.6 ms for a 4M-element bucket (3% of a decode in bench_mirror (a)).
    32 patterns of a 25 MiB bucket (~1,400 sends each) hold ~10 MB."""
    return tuple(ring_sends(count, p, position, channel))


def reduce_order(chunk: int, nranks: int) -> list[int]:
    """Ring positions in the order their contributions are summed into ``chunk``."""
    return [(chunk + 1 + j) % nranks for j in range(nranks)]


@dataclass(frozen=True, eq=False)
class PatternColumns:
    """``ring_pattern`` as arrays, for connections held as columns (flowcheck.capture.mirror.send_columns): every
    send's wire bytes, and the final sends with elements — what an allreduce's merge takes — by field."""

    wire: np.ndarray  # int64 per send: its RDMA size on the wire
    final_step: list[int]  # per final send with elements: its index in the pattern (step offset from the match)
    final_chunk: list[int]
    final_loop: list[int]
    final_start: list[int]
    final_end: list[int]
    finals: np.ndarray  # final_step as int64
    final_lo: np.ndarray  # final_start as int64
    final_hi: np.ndarray  # final_end as int64


@lru_cache(maxsize=32)
def pattern_columns(count: int, p: RingParams, position: int, channel: int) -> PatternColumns:
    """``ring_pattern`` as ``PatternColumns`` (remembered alike: the same few patterns every iteration)."""
    sends = ring_pattern(count, p, position, channel)
    finals = [j for j, s in enumerate(sends) if s.final and s.count]
    pick = [sends[j] for j in finals]
    return PatternColumns(
        wire=np.array([p.wire_bytes(s.count) for s in sends], np.int64),
        final_step=finals, final_chunk=[s.chunk for s in pick], final_loop=[s.loop for s in pick],
        final_start=[s.start for s in pick], final_end=[s.start + s.count for s in pick],
        finals=np.array(finals, np.int64), final_lo=np.array([s.start for s in pick], np.int64),
        final_hi=np.array([s.start + s.count for s in pick], np.int64))
