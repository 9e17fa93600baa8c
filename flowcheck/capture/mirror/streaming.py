"""Streaming decode: mirrored frames that arrive in batches (a live socket) -> allreduces, in bounded memory.

``decode.decode`` sees a whole capture at once.  Here batches gather in a *window* that is decoded again once
it has grown enough (by half, and by ``min_frames`` at least).  The allreduces it *settles* are handed out:
those whose every send started at least ``settle_s`` of capture time before the window's last frame.  A ring
allreduce advances in lockstep, so by then each mirrored copy of it has been captured; one that is still in
flight waits for the next decode.  Each ring connection then resumes at the PSN of its first send not yet used
(``ring_streams``' ``resume``), the next decode starts at the next allreduce of the job's schedule, and the frames
before the earliest such send leave the window.  A frame is decoded a few times at most; memory holds what is
still in flight.  ``finish`` decodes what is left as the end of the capture.  A window that outgrows
``max_window_bytes`` without settling (a mirror went silent mid-allreduce) stops the decode with an error:
where the next allreduce starts could then only be guessed.

What a window drops is accounted once.  Frame statuses, PSN gaps and duplicates come from a reassembly of the
dropped frames alone; a gap across the cut is not counted (the allreduces' missing ranges still show it).
Send-level anomalies are kept for the steps that the handed-out allreduces used.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from flowcheck.capture.mirror import roce
from flowcheck.capture.mirror.anomalies import Anomaly
from flowcheck.capture.mirror.assemble import Allreduce
from flowcheck.capture.mirror.decode import Decoded, Window, concat_frames, decode_window, packet_anomalies
from flowcheck.capture.mirror.gc_pause import gc_paused
from flowcheck.capture.mirror.job import Job
from flowcheck.capture.mirror.partition import Partition
from flowcheck.capture.mirror.pcap import Frames
from flowcheck.errors import CaptureError

# With no ring connection in the window (before the job's traffic, or other traffic on the mirror port) only
# this much of the latest capture time is kept: no send takes longer, so a ring connection's first one is in it.
_NO_RING_KEEP_NS = 1_000_000_000


class StreamingDecoder:
    """Feed it batches of frames (``feed``), then ``finish``; or ``run`` over an iterable of batches."""

    def __init__(self, job: Job, info: Decoded | None = None, *, settle_s: float = 0.1, min_frames: int = 4096,
                 max_window_bytes: int = 2 << 30, clock: Callable[[], int] | None = None,
                 partition: Partition | None = None, workers: int = 1) -> None:
        """``clock`` (live capture: ``time.time_ns``, the clock the frames are stamped with) lets time settle
        allreduces while the link is quiet: an empty batch then decodes what waits once ``settle_s`` has passed.
        ``partition``: a scaled-out node's part; ``workers``: threads for the native work (both: see ``decode``)."""
        if settle_s < 0 or min_frames < 1 or max_window_bytes < 1 or workers < 1:
            raise ValueError(f"expected settle_s >= 0, min_frames >= 1, max_window_bytes >= 1, workers >= 1; found "
                             f"{settle_s}, {min_frames}, {max_window_bytes}, {workers}")
        self.workers = workers
        self.job, self.info = job, info if info is not None else Decoded()
        self.settle_ns, self.min_frames, self.max_window_bytes = int(settle_s * 1e9), min_frames, max_window_bytes
        self.next_index = 1  # the next allreduce of the job's schedule
        self.resume: dict[str, int] = {}  # ring connection -> 24-bit PSN of its first send not yet used
        self._window: Frames | None = None
        self._pending: list[Frames] = []
        self._new = 0  # frames that arrived since the last decode
        self._status: Counter[str] = Counter()
        self._opcodes: Counter[str] = Counter()
        self._last: Allreduce | None = None  # the allreduce handed out last: trailing re-sends are compared to it
        self._reported: set[Anomaly] = set()  # connection-level anomalies already reported (they recur every window)
        self.clock = clock
        self.partition = partition
        self._last_try = clock() if clock is not None else 0

    def run(self, batches: Iterable[Frames]) -> Iterator[Allreduce]:
        for batch in batches:
            yield from self.feed(batch)
        yield from self.finish()

    def feed(self, frames: Frames) -> list[Allreduce]:
        """Take a batch; returns the allreduces it settled (often none)."""
        if len(frames):
            self._pending.append(frames)
            self._new += len(frames)
        held = len(self._window) if self._window is not None else 0
        full = self._held_bytes() >= self.max_window_bytes
        quiet = (not len(frames) and self.clock is not None and self.held_frames
                 and self.clock() - self._last_try >= self.settle_ns)
        if self._new < max(self.min_frames, held // 2) and not quiet and not full:
            return []
        out = self._decode(final=False)
        if not out and self._held_bytes() >= self.max_window_bytes:
            # Decoding it as the end of the capture would hand out the allreduce in flight as incomplete, and
            # the next window could not tell where the next one starts: stop instead of guessing.
            raise CaptureError(f"streaming decode: {self._held_bytes()} bytes of frames held and no allreduce "
                               f"settled (max_window_bytes {self.max_window_bytes}): a mirrored stream stopped "
                               "mid-allreduce, or the job does not match the traffic; restart the capture (the "
                               "replica resumes from a full state push)")
        return out

    def finish(self) -> list[Allreduce]:
        """The end of the capture: everything still held is decoded and handed out."""
        return self._decode(final=True)

    @property
    def held_frames(self) -> int:
        """Frames waiting in the window (decoded, not settled) and in batches not decoded yet."""
        return (len(self._window) if self._window is not None else 0) + sum(len(p) for p in self._pending)

    def _held_bytes(self) -> int:
        parts = ([self._window] if self._window is not None else []) + self._pending
        return sum(int(p.lengths.sum()) for p in parts)

    def _decode(self, final: bool) -> list[Allreduce]:
        parts = ([self._window] if self._window is not None else []) + self._pending
        self._pending, self._new = [], 0
        if self.clock is not None:
            self._last_try = self.clock()
        window = parts[0] if len(parts) == 1 else concat_frames(parts, parts[-1].source if parts else "live")
        if not len(window):
            self._window = None
            return []
        local = Decoded()
        with gc_paused():
            w = decode_window(self.job, window, local, self.resume, workers=self.workers, partition=self.partition)
        out, cursors = self._settled(w, window, local, final)
        cut = len(window) if final else self._advance(w, window, cursors)
        self._account(window, w, local, cut, cursors, final)
        self._window = window.select(cut) if cut < len(window) else None
        if out:
            self.next_index = out[-1].index + 1
        return out

    def _settled(self, w: Window, window: Frames, local: Decoded, final: bool) -> tuple[list[Allreduce], dict[str, int]]:
        """The allreduces this window settles, and each connection's next step after them."""
        if w.assembler is None:
            return [], {}
        for ring in w.rings:
            ring.ended = final
        latest = max(int(window.ts_ns.max()), self.clock() if self.clock is not None else 0)
        horizon = None if final else latest - self.settle_ns
        out, cursors = [], {r.name: r.first_step for r in w.rings}
        w.assembler.last = self._last
        found = w.assembler.assemble(w.rings, start=self.next_index)
        while True:
            mark = len(local.anomalies)
            ar = next(found, None)
            if ar is None:
                break
            t0 = ar.latest_t0()
            if horizon is not None and (t0 is None or t0 > horizon):
                del local.anomalies[mark:]  # what placing its sends reported: it will be decoded again
                break
            out.append(ar)
            self.info.placed_bytes += ar.placed_bytes  # counted once: an allreduce handed out is never decoded again
            cursors = dict(w.assembler.cursors)
        if final:  # trailing re-sends of final data move the cursors without an allreduce
            cursors = dict(w.assembler.cursors)
        if out:
            self._last = out[-1]
        return out, cursors

    def _advance(self, w: Window, window: Frames, cursors: dict[str, int]) -> int:
        """Move each connection's resume PSN past its used sends; returns the first frame still needed.

        Needed: every ring connection's first unused send; with none pending, whatever came after the last
        used send; and all of a known connection that this window did not recognise (its sends not closed yet).
        """
        cut, done = None, 0
        for ring in w.rings:
            step = cursors.get(ring.name, ring.first_step)
            later = [k for k in ring.sends if k >= step]
            if later:
                nxt = ring.sends[min(later)]
                self.resume[ring.name] = nxt.psn
                cut = nxt.frame if cut is None else min(cut, nxt.frame)
            elif ring.sends:  # all used: the connection goes on after its last send seen
                last = ring.sends[max(ring.sends)]
                self.resume[ring.name] = (last.info["psn"][1] + 1) & 0xFFFFFF
                done = max(done, last.last_frame + 1)
        if not w.rings:  # nothing recognised (yet, or any more): keep what a send still in progress could need
            recent = np.flatnonzero(window.ts_ns >= window.ts_ns.max() - max(self.settle_ns, _NO_RING_KEEP_NS))
            return int(recent[0]) if len(recent) else 0
        cut = done if cut is None else cut
        names = {r.name for r in w.rings}
        for s in w.streams:
            if s.name in self.resume and s.name not in names and s.first_frame >= 0:
                cut = min(cut, s.first_frame)
        return cut

    def _account(self, window: Frames, w: Window, local: Decoded, cut: int, cursors: dict[str, int],
                 final: bool) -> None:
        """Report once what the frames [0, cut) held, and the send-level anomalies of the allreduces used."""
        info = self.info
        if cut:
            table = w.packets.table[:cut]
            status = np.bincount(table["status"], minlength=len(roce.Status))
            self._status.update({s.name: int(status[s]) for s in roce.Status})
            ops = np.bincount(table["opcode"][table["bth_offset"] > 0], minlength=256)
            self._opcodes.update({roce.opcode_name(op): int(ops[op]) for op in np.flatnonzero(ops)})
            head = window.select(0, cut)
            # the cut can fall inside a message: a gap after a stream's last packet before it is no loss
            packet_anomalies(roce.reassemble(head, roce.Packets(table, {}, {})), info.anomalies, tails=final)
        info.packets = {**{s.name: self._status[s.name] for s in roce.Status}, "opcodes": dict(self._opcodes)}
        info.channels, info.streams = local.channels, local.streams
        for an in local.anomalies:
            if an.packet_level:
                continue
            step = an.send_step
            if step is not None:
                if final or step < cursors.get(an.stream, step):
                    info.anomalies.append(an)
                continue
            if not final:
                continue  # about the connections (none found, a channel short): a window may hold too little to say
            if an not in self._reported:
                self._reported.add(an)
                info.anomalies.append(an)
        if w.assembler is not None:
            info.skipped_sends.extend(s for s in w.assembler.skipped
                                      if final or s["step"] < cursors.get(s["stream"], s["step"]))
