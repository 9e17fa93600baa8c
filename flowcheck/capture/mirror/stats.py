"""Running totals of a mirror capture — frames, packets, allreduces, and what loss did — for the node's metrics.

Loss is counted in gradient elements, from the assembler's outputs: elements a mirrored copy lacked
but another copy delivered (recovered) vs. elements no copy delivered (lost for good, the iteration
is unrecoverable).  Packet-level loss is the decoder's PSN gaps.  Kept free of torch, so a node that
only takes pushes can import it.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flowcheck.capture.mirror.anomalies import Duplicates, PsnGap

if TYPE_CHECKING:
    from flowcheck.capture.mirror.assemble import Allreduce
    from flowcheck.capture.mirror.decode import Decoded
    from flowcheck.capture.mirror.pcap import Frames


@dataclass
class CaptureStats:
    """Running totals of a mirror capture (plain counters: read by the node's metrics at scrape time)."""

    frames: int = 0  # frames read from the captures
    bytes: int = 0  # their wire bytes
    frames_dropped: int = 0  # live: frames the kernel dropped because the capture fell behind (socket buffer full)
    packets: dict[str, int] = field(default_factory=dict)  # by parse status: OK, BAD_ICRC, MALFORMED, NOT_ROCE
    packets_missing: int = 0  # PSN gaps: packets a mirrored stream never delivered
    packets_duplicate: int = 0
    allreduces_complete: int = 0
    allreduces_incomplete: int = 0
    elements_recovered: int = 0  # missing on one mirrored copy, delivered by another
    elements_lost: int = 0  # delivered by no copy: the allreduce (and its iteration) is unrecoverable
    _anomalies_seen: int = field(default=0, repr=False)

    def read(self, frames: Frames) -> None:
        self.frames += len(frames.offsets)
        self.bytes += int(frames.lengths.sum())

    def decoded(self, info: Decoded) -> None:
        """Take the packet counts and PSN anomalies ``decode`` has reported so far (``Decoded``)."""
        self.packets = {k: v for k, v in (info.packets or {}).items() if isinstance(v, int)}
        new = info.anomalies[self._anomalies_seen:]
        self._anomalies_seen = len(info.anomalies)
        for an in new:
            if isinstance(an, PsnGap):
                self.packets_missing += int(an.packets)
            elif isinstance(an, Duplicates):
                self.packets_duplicate += int(an.packets)

    def allreduce(self, ar: Allreduce) -> None:
        lost = sum(b - a for a, b in ar.missing())
        if ar.complete:
            self.allreduces_complete += 1
        else:
            self.allreduces_incomplete += 1
        self.elements_lost += lost
        for lo, hi, seen in ar.source_ranges():
            short = (hi - lo) - seen
            if short > 0:  # of what this copy lacks, whatever some copy delivered was recovered
                self.elements_recovered += short - int((ar.copies[lo:hi] == 0).sum())


def counted(allreduces: Iterable[Allreduce], stats: CaptureStats, info: Decoded | None = None) -> Iterator[Allreduce]:
    """Pass allreduces through, counting each (and ``info``'s packet counts) into ``stats``."""
    for ar in allreduces:
        if info is not None:
            stats.decoded(info)
        stats.allreduce(ar)
        yield ar
    if info is not None:
        stats.decoded(info)
