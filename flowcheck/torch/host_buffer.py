"""The trainer's host memory for pushes: shared-memory segments it lends to a node on this host, or one buffer it
streams over TCP — allocated once per plan, page-locked with the CUDA driver when CUDA is present (so device-to-host
copies go straight into it at full speed, no second host copy).

Segments (flowcheck/capture/push/buffers.py has their layout): a push fills a free segment and lends it to the node,
which adopts it as its RAM state; the node gives it back (clears its lease word) once a later push replaced that
state and no snapshot holds it.  With two segments the trainer fills one while the node holds the other: the host
holds the state twice, as when the node copied it.  A segment is written only while its lease word says free.
"""
from __future__ import annotations

import logging
import time
from multiprocessing import shared_memory

import torch

from flowcheck import _native
from flowcheck.capture.push.buffers import FREE, LENT, Segment, generation_at, lease_at, segment_size

log = logging.getLogger(__name__)


class HostBuffers:
    """``count`` host regions of ``nbytes`` each: shared-memory segments (``shm``) or private buffers (TCP)."""

    def __init__(self, nbytes: int, count: int, shm: bool) -> None:
        self.nbytes, self.shm = nbytes, shm
        self.segments: list[Segment] = []
        self._owners: list[shared_memory.SharedMemory] = []  # created (and unlinked at the end, or by the tracker)
        self.regions: list[torch.Tensor] = []
        self.generations = [0] * count
        self.lends = False  # whether the node adopts segments (its hello says so): then leases are honoured
        for _ in range(count):
            if shm:
                owner = shared_memory.SharedMemory(create=True, size=segment_size(nbytes))
                owner.close()  # mapped again below, by a Segment that can let go while tensors still view it
                self._owners.append(owner)
                seg = Segment(owner.name)
                self.segments.append(seg)
                self.regions.append(torch.frombuffer(seg.buf, dtype=torch.uint8, count=max(nbytes, 1)))
            else:
                self.regions.append(torch.empty(max(nbytes, 1), dtype=torch.uint8))
        self.pinned = [register(r) for r in self.regions]

    def __len__(self) -> int:
        return len(self.regions)

    def name(self, i: int) -> str | None:
        return self.segments[i].name if self.shm else None

    def free(self, i: int) -> bool:
        return not self.shm or not self.lends or _native.generation_load(self.segments[i].buf, lease_at(self.nbytes)) == FREE

    def acquire(self, avoid: int | None, timeout_s: float) -> int | None:
        """A region the node does not hold (preferring one other than ``avoid``, the node's state), waiting up to
        ``timeout_s`` for the node to give one back; None if none came back in time."""
        order = [i for i in range(len(self)) if i != avoid] + ([avoid] if avoid is not None else [])
        deadline, pause = time.monotonic() + timeout_s, 0.0002
        while True:
            for i in order:
                if self.free(i):
                    return i
            if time.monotonic() >= deadline:
                return None
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def begin_write(self, i: int) -> None:
        """Odd generation: a node still reading an unlent segment sees its copy torn and refuses it."""
        if self.shm:
            self.generations[i] += 1 if self.generations[i] % 2 == 0 else 2
            _native.generation_store(self.segments[i].buf, generation_at(self.nbytes), self.generations[i])

    def end_write(self, i: int) -> None:
        if self.shm:
            self.generations[i] += 1
            _native.generation_store(self.segments[i].buf, generation_at(self.nbytes), self.generations[i])

    def lend(self, i: int) -> None:
        """Mark segment ``i`` lent: the trainer does not write it until the node clears the word."""
        if self.shm and self.lends:
            _native.generation_store(self.segments[i].buf, lease_at(self.nbytes), LENT)

    def take_back_all(self) -> None:
        """The node that held segments is gone (another one answers now): every segment is the trainer's again."""
        if self.shm:
            for seg in self.segments:
                _native.generation_store(seg.buf, lease_at(self.nbytes), FREE)

    def payload(self, i: int) -> dict[str, object]:
        """The push header's payload fields for region ``i`` (shared memory; TCP adds its digest)."""
        out: dict[str, object] = {"bytes": self.nbytes}
        if self.shm:
            out.update(shm=self.segments[i].name, generation=self.generations[i],
                       generation_at=generation_at(self.nbytes))
            if self.lends:
                out["lease_at"] = lease_at(self.nbytes)
        return out

    def close(self) -> None:
        for region, pinned in zip(self.regions, self.pinned):
            if pinned:
                unregister(region)
        self.regions = []
        for seg in self.segments:
            seg.close()
        for owner in self._owners:
            owner.unlink()
        self.segments, self._owners = [], []


def register(t: torch.Tensor) -> bool:
    """Page-lock a host tensor's memory with the CUDA driver (cudaHostRegister): device-to-host copies into it then
    run asynchronously at full speed.  False (and the copy is staged by torch) without CUDA or when refused."""
    if not torch.cuda.is_available() or t.numel() == 0:
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    except (RuntimeError, AttributeError) as e:
        log.warning("checkpoint host buffer: cannot page-lock it (%s); device copies into it run slower", e)
        return False
    code = int(getattr(err, "value", err))
    if code != 0:
        log.warning("checkpoint host buffer: cudaHostRegister of %d bytes failed (error %d; is the locked-memory "
                    "limit, ulimit -l, too low?); device copies into it run slower", t.numel(), code)
        return False
    return True


def unregister(t: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except (RuntimeError, AttributeError):
        pass
