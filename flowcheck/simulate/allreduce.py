"""A bit-faithful NCCL ring allreduce: every chunk summed in ring order, and what each send carries.

NCCL's ring reduce-scatter passes a running sum around the ring: chunk ``c`` starts at ring
position c+1, each position adds its own contribution to what it received and forwards it, and
position c adds the last one (``ring.reduce_order``).  Floating-point addition is commutative
but not associative, so the final value is the left-to-right sum in that order — computed here
with numpy adds of the actual values in the bucket's dtype, exactly once per term, as NCCL does.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flowcheck.capture.mirror.ring import RingParams, Send, chunk_range, loops, reduce_order
from flowcheck.errors import JobError


@dataclass(frozen=True)
class RingReduce:
    """One allreduce: ``running[k]`` holds, for every element, the sum of the first k+1 terms of its chunk."""

    params: RingParams
    running: np.ndarray  # (nranks, count); running[nranks-1] is the final vector

    @property
    def final(self) -> np.ndarray:
        return self.running[-1]

    @property
    def count(self) -> int:
        return self.running.shape[1]

    def payload(self, position: int, send: Send) -> np.ndarray:
        """The values ring ``position`` puts on the wire for ``send``: a running sum or the final values."""
        if send.final:
            row = self.params.nranks - 1
        else:
            # position = chunk + 1 + j sends the sum of j+1 terms (it just added its own)
            row = (position - send.chunk - 1) % self.params.nranks
        return self.running[row, send.start:send.start + send.count]


def chunks(count: int, p: RingParams) -> list[tuple[int, int, int]]:
    """(chunk, start, elements) of every chunk of every loop and channel; together they tile [0, count)."""
    out = []
    for off, size in loops(count, p):
        for channel in range(p.nchannels):
            for chunk in range(p.nranks):
                start, elems = chunk_range(count, p, off, size, chunk, channel)
                if elems:
                    out.append((chunk, start, elems))
    return out


def ring_allreduce(inputs: Sequence[np.ndarray], p: RingParams) -> RingReduce:
    """Sum ``inputs[position]`` (one 1-D array per ring position, same dtype and length) the way NCCL's ring does."""
    n = p.nranks
    if len(inputs) != n:
        raise JobError(f"allreduce: expected {n} inputs (one per ring position), found {len(inputs)}")
    first = np.asarray(inputs[0])
    if first.dtype.itemsize != p.itemsize or any(np.asarray(x).shape != first.shape for x in inputs) or first.ndim != 1:
        raise JobError(f"allreduce: expected {n} 1-D arrays of one length with {p.itemsize}-byte elements")
    stacked = np.stack([np.asarray(x, dtype=first.dtype) for x in inputs])
    running = np.empty_like(stacked)
    for chunk, start, elems in chunks(first.shape[0], p):
        sl = slice(start, start + elems)
        order = reduce_order(chunk, n)
        acc = stacked[order[0], sl].copy()
        running[0, sl] = acc
        for k, pos in enumerate(order[1:], start=1):
            acc = acc + stacked[pos, sl]  # one rounding per add, left to right
            running[k, sl] = acc
    return RingReduce(p, running)
