"""Copying a rank's CUDA tensors out for a push: ordered after the trainer's own work, staged device-to-device when
device memory allows, then device-to-host into the (page-locked) host region — all on a side stream.

Ordering: ``save()`` records an event on each device's current stream (the trainer's, whichever it is); the side
stream waits on it before reading a tensor, so a step is copied as of ``save()`` even when training runs on its own
streams.  ``wait()`` (the optimizer's pre-step hook) does not block the host: it makes the trainer's current stream
wait on the copy's done event, so the optimizer step, which overwrites what is copied, runs after it on the device.

With staging (``PushConfig.gpu_staging``) the copy the optimizer waits for is device-to-device (TB/s); the
device-to-host copy of the staging buffer then runs behind the next iterations on the copy engine.  Without it the
device-to-host copies go straight into the host region and the optimizer step waits for them.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

Marked = tuple  # (torch.device, torch.cuda.Event)
HEADROOM = 0.10  # of the device's memory left free by an automatic staging buffer (activations, fragmentation)


@dataclass(frozen=True)
class Slot:
    entry: int  # index of the entry in the plan
    at: int  # byte offset in the host region
    nbytes: int
    staged_at: int  # byte offset in the staging buffer (-1: not staged)


class DeviceCopier:
    """The side stream and the staging buffer of one rank's CUDA tensors (re-planned with its entries)."""

    def __init__(self, budget: int | str) -> None:
        self.budget = budget  # "auto", or a byte budget (0: never stage)
        self.slots: list[Slot] = []
        self.staging: torch.Tensor | None = None
        self.devices: list[torch.device] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def plan(self, tensors: Sequence[torch.Tensor], ats: Sequence[int], nbytes: Sequence[int]) -> None:
        """Give every CUDA entry its slot; allocate the staging buffer when the budget and free memory allow."""
        self.staging = None
        cuda = [i for i, t in enumerate(tensors) if t.is_cuda and nbytes[i]]
        self.devices = sorted({tensors[i].device for i in cuda}, key=str)
        need = sum(nbytes[i] for i in cuda)
        staged = bool(cuda) and self._stage_fits(need)
        if staged:
            try:
                self.staging = torch.empty(need, dtype=torch.uint8, device=self.devices[0])
            except torch.cuda.OutOfMemoryError:
                log.warning("checkpoint: no room for a %.2f GB staging buffer on %s; copying device-to-host directly",
                            need / 1e9, self.devices[0])
        pos, self.slots = 0, []
        for i in cuda:
            self.slots.append(Slot(i, ats[i], nbytes[i], pos if self.staging is not None else -1))
            pos += nbytes[i]

    def _stage_fits(self, need: int) -> bool:
        if self.budget == 0 or len(self.devices) != 1:
            return False
        if isinstance(self.budget, int) and need > self.budget:
            log.info("checkpoint: %.2f GB of CUDA state is over gpu_staging's budget of %.2f GB; copying "
                     "device-to-host directly", need / 1e9, self.budget / 1e9)
            return False
        free, total = torch.cuda.mem_get_info(self.devices[0])
        if need > free - HEADROOM * total:
            log.info("checkpoint: %.2f GB of CUDA state does not fit beside %.2f GB free on %s (keeping %d%% free); "
                     "copying device-to-host directly", need / 1e9, free / 1e9, self.devices[0], HEADROOM * 100)
            return False
        return True

    @property
    def staged(self) -> bool:
        return self.staging is not None

    def mark(self) -> list[Marked]:
        """Events on the trainer's current streams, now: what a copy must come after (called in ``save()``)."""
        events = []
        for dev in self.devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            events.append((dev, ev))
        return events

    def stream(self, dev: torch.device) -> torch.cuda.Stream:
        if dev not in self._streams:
            self._streams[dev] = torch.cuda.Stream(device=dev)
        return self._streams[dev]

    def copy(self, tensors: Sequence[torch.Tensor], skip: frozenset[int], after: list[Marked],
             region: torch.Tensor | None) -> list[Marked]:
        """Enqueue the copies of every slot not in ``skip`` — into the staging buffer (``region`` None) or straight
        into the host ``region`` — after the ``after`` events; returns the events that mark them done."""
        done = []
        for dev in self.devices:
            s = self.stream(dev)
            with torch.cuda.stream(s):
                for _, ev in after:
                    s.wait_event(ev)
                for slot in self.slots:
                    t = tensors[slot.entry]
                    if slot.entry in skip or t.device != dev:
                        continue
                    src = t.detach().contiguous().reshape(-1).view(torch.uint8)
                    t.record_stream(s)  # the allocator does not reuse its memory before this copy ran
                    dst = self.staging[slot.staged_at:slot.staged_at + slot.nbytes] if region is None \
                        else region[slot.at:slot.at + slot.nbytes]
                    dst.copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(s)
                done.append((dev, ev))
        return done

    def drain(self, skip: frozenset[int], region: torch.Tensor) -> None:
        """Copy the staging buffer to the host ``region`` (runs of slots back to back are one copy); returns when it
        is there.  Ordered after the staging copies: the same stream."""
        s = self.stream(self.devices[0])
        with torch.cuda.stream(s):
            for at, staged_at, n in _runs([sl for sl in self.slots if sl.entry not in skip]):
                region[at:at + n].copy_(self.staging[staged_at:staged_at + n], non_blocking=True)
        s.synchronize()

    def synchronize(self) -> None:
        for dev in self.devices:
            self.stream(dev).synchronize()


def order_after(events: list[Marked]) -> None:
    """Make the current streams wait (on the device, the host goes on) for ``events``: what ``wait()`` does."""
    for dev, ev in events:
        torch.cuda.current_stream(dev).wait_event(ev)


def _runs(slots: list[Slot]) -> list[tuple[int, int, int]]:
    """(host offset, staging offset, bytes) of maximal runs of slots contiguous in both."""
    runs: list[list[int]] = []
    for sl in slots:
        if runs and runs[-1][0] + runs[-1][2] == sl.at and runs[-1][1] + runs[-1][2] == sl.staged_at:
            runs[-1][2] += sl.nbytes
        else:
            runs.append([sl.at, sl.staged_at, sl.nbytes])
    return [tuple(r) for r in runs]
