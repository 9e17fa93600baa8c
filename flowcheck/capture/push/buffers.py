"""Where a push lands on the node: trainers' shared-memory segments lent to it, and reusable TCP receive buffers.

A push is received beside the RAM state, never into it (flowcheck/node/receiver.py); these are the two
places it is received into, each handed to the memory tier as a ``Block`` it gives back once nothing holds it.

Shared memory (a trainer on this host): the trainer keeps two or more segments and lends the one it filled; the node
adopts it as its state without a copy.  The segment's lease word (8 bytes after its generation counter) is set by
the trainer when it lends the segment and cleared by the node when the segment comes back — a trainer never writes a
segment whose word is set, so the node's state cannot change under it.  Layout of a segment of an n-byte payload::

    [payload: n bytes][pad to 8][generation: u64][lease: u64]
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from collections import OrderedDict

import numpy as np

from flowcheck import _native
from flowcheck.capture.push.wire import WireError
from flowcheck.tiers.memory import Block

log = logging.getLogger(__name__)

LENT, FREE = 1, 0  # a segment's lease word: lent to the node by its trainer; free for the trainer to write
SEGMENTS_KEPT = 4  # segments attached per sender beyond those the state holds (a trainer uses 2 by default)
SHM_DIR = "/dev/shm"  # where POSIX shared memory (shm_open) keeps its segments on Linux


def generation_at(nbytes: int) -> int:
    """Where a shared-memory segment holding an ``nbytes`` payload keeps its generation counter (8-aligned)."""
    return (nbytes + 7) // 8 * 8


def lease_at(nbytes: int) -> int:
    """Where it keeps its lease word: right after the generation counter."""
    return generation_at(nbytes) + 8


def segment_size(nbytes: int) -> int:
    return lease_at(nbytes) + 8


class Segments:
    """The senders' segments this node has attached, each mapped once.  A mapping is closed when its sender has moved
    on to others (a re-planned or restarted trainer) and no block of it is held by the state or a snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[str, Segment] = {}
        self._users: dict[str, int] = {}  # blocks of a segment not yet given back
        self._recent: dict[int, OrderedDict[str, None]] = {}  # per sender: the segments it pushed from lately

    def attach(self, sender: int, name: str) -> Segment:
        with self._lock:
            seg = self._maps.get(name)
            if seg is None:
                seg = self._maps[name] = Segment(name)
            recent = self._recent.setdefault(sender, OrderedDict())
            recent[name] = None
            recent.move_to_end(name)
            stale = []
            while len(recent) > SEGMENTS_KEPT:
                stale.append(recent.popitem(last=False)[0])
            closing = [n for n in stale if not self._users.get(n) and not self._wanted(n)]
            segs = [self._maps.pop(n) for n in closing]
        for s in segs:
            s.close()
        return seg

    def lend(self, seg: Segment, nbytes: int, at: int) -> Block:
        """A block over the segment's payload, held by the node until given back: then its lease word is cleared."""
        with self._lock:
            self._users[seg.name] = self._users.get(seg.name, 0) + 1
        return Block(nbytes, lambda: self._give_back(seg, at, nbytes))

    def give_back(self, name: str, at: object) -> None:
        """Clear the lease of a segment lent with a push the node did not take (refused before reading it) — unless
        the node holds that segment (a frame naming the segment of the RAM state must not free it)."""
        with self._lock:
            seg = self._maps.get(name)
            held = self._users.get(name, 0) > 0
        if seg is not None and not held and isinstance(at, int) and 0 <= at and at + 8 <= seg.size and at % 8 == 0:
            _native.generation_store(seg.buf, at, FREE)

    def _give_back(self, seg: Segment, at: int, nbytes: int) -> None:
        """A block of ``seg`` is no longer held; the last one clears the lease (the trainer may write it again), after
        dropping the node's page-table entries for it: the memory is the trainer's, and a snapshot that read it
        would otherwise leave it counted in the node's RSS a second time for as long as the segment stays attached."""
        with self._lock:
            self._users[seg.name] -= 1
            free = not self._users[seg.name]
            if free:
                seg.unmap_pages(0, nbytes)
                _native.generation_store(seg.buf, at, FREE)
                del self._users[seg.name]
            close = free and not self._wanted(seg.name)
            if close:
                self._maps.pop(seg.name, None)
        if close:
            seg.close()

    def _wanted(self, name: str) -> bool:
        return any(name in recent for recent in self._recent.values())

    def close(self) -> None:
        with self._lock:
            segs, self._maps = list(self._maps.values()), {}
        for s in segs:
            s.close()


class ReceivePool:
    """Receive buffers for parts that are copied in (TCP), reused: a replaced state's buffers come back once no
    snapshot holds them, so a node fed over TCP keeps about two states (its state and the next push) without
    allocating (and page-faulting) a new one per push."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}
        self.cap_bytes = 0  # buffers kept for reuse, at most: about one state (set by the receiver)
        self.lent_bytes = 0  # buffers handed out and not yet back

    def take(self, nbytes: int) -> tuple[np.ndarray, Block]:
        with self._lock:
            free = self._free.get(nbytes)
            buf = free.pop() if free else None
            self.lent_bytes += nbytes
        if buf is None:
            buf = np.empty(max(nbytes, 1), np.uint8)
        return buf, Block(nbytes, lambda: self._give(buf, nbytes))

    def _give(self, buf: np.ndarray, nbytes: int) -> None:
        with self._lock:
            self.lent_bytes -= nbytes
            if self.pooled_bytes + nbytes <= self.cap_bytes:
                self._free.setdefault(nbytes, []).append(buf)

    def clear(self) -> None:
        """Drop the buffers kept for reuse (the node is fed through shared memory now)."""
        with self._lock:
            self._free, self.cap_bytes = {}, 0

    @property
    def pooled_bytes(self) -> int:
        return sum(b.nbytes for free in self._free.values() for b in free)


class Segment:
    """A POSIX shared-memory segment mapped into this process, which owns the mapping.  Unlike
    ``multiprocessing.shared_memory.SharedMemory`` it can be let go of while arrays still view it (a state or snapshot
    the node holds): the mapping then lives on with those arrays and is unmapped with the last of them."""

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name or "/" in name or "\0" in name or len(name) > 250:
            raise WireError(f"push header: bad shared memory name {name!r}")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        except FileNotFoundError as e:
            raise WireError(f"shared memory {name!r} does not exist: is the sender on another host?") from e
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise WireError(f"shared memory {name!r} is empty (0 bytes)")
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.name, self.size = name, size
        self.buf = memoryview(self._mmap)

    def unmap_pages(self, start: int, end: int) -> None:
        """Drop this process's page-table entries for bytes [start, end) (the memory stays, shared)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        lo = start - start % mmap.PAGESIZE
        hi = min(-(-end // mmap.PAGESIZE) * mmap.PAGESIZE, self.size)
        if hi > lo:
            with contextlib.suppress(OSError, ValueError):
                self._mmap.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        """Unmap it now, or — while arrays still view it — when the last of them goes."""
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            return

