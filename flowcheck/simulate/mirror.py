"""Switch mirror ports: which frames each port copies, what a lossy mirror does to them, and the pcaps.

A port mirrors one rank's switch port in one direction: ``out`` copies every frame the rank
sends (source MAC = the rank), ``in`` every frame it receives (destination MAC = the rank),
``both`` the two interleaved in time.  The mirror (not the fabric: RoCE itself is lossless, so
training is unaffected) then drops, reorders and duplicates copies, each port independently and
seeded; what it did is recorded so a decoder's report can be checked against it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flowcheck.errors import ConfigError
from flowcheck.simulate.traffic import Frame

DIRECTIONS = ("in", "out", "both")
REORDER_WINDOW = 4  # a reordered frame swaps with one of the next few
EPOCH_NS = 1_700_000_000 * 10**9  # pcap timestamps start here (a fixed date: reruns are byte-identical)


@dataclass(frozen=True)
class MirrorSpec:
    """One mirror port: a rank's switch port, in one direction."""

    rank: int
    direction: str  # in | out | both

    def sees(self, src: int, dst: int) -> bool:
        return (self.direction != "in" and src == self.rank) or (self.direction != "out" and dst == self.rank)

    def select(self, frames: list[Frame]) -> list[Frame]:
        """The frames this port copies, in order (a comprehension per direction: runs see millions)."""
        r = self.rank
        if self.direction == "out":
            return [f for f in frames if f.src == r]
        if self.direction == "in":
            return [f for f in frames if f.dst == r]
        return [f for f in frames if f.src == r or f.dst == r]

    @property
    def filename(self) -> str:
        return f"mirror-r{self.rank}-{self.direction}.pcap"

    def __str__(self) -> str:
        return f"{self.rank}:{self.direction}"


def default_mirrors(nranks: int) -> tuple[MirrorSpec, ...]:
    """The outbound streams of 3 consecutive ranks (FlowCheck's recommendation), fewer on a smaller ring."""
    return tuple(MirrorSpec(r, "out") for r in range(min(3, nranks)))


def parse_mirrors(text: str) -> tuple[MirrorSpec, ...]:
    """``"0:in,2:out"`` -> specs (ranks checked against the ring by the caller)."""
    specs = []
    for item in (s.strip() for s in text.split(",")):
        rank, sep, direction = item.partition(":")
        if not sep or not rank.strip().isdigit() or direction.strip() not in DIRECTIONS:
            raise ConfigError(f"--mirror: expected RANK:in|out|both[,...], found {item!r} in {text!r}")
        specs.append(MirrorSpec(int(rank), direction.strip()))
    if len(set(specs)) != len(specs):
        raise ConfigError(f"--mirror: a port appears twice in {text!r}")
    return tuple(specs)


@dataclass(frozen=True)
class Injection:
    """Per-frame probabilities of what a lossy mirror does to its copies."""

    loss: float = 0.0
    reorder: float = 0.0
    dup: float = 0.0

    def __post_init__(self) -> None:
        for name in ("loss", "reorder", "dup"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ConfigError(f"--{name}: expected a probability in [0, 1], found {v!r}")


@dataclass
class PortRecord:
    """What one mirror port was offered and what it did (indices count offered frames from 0)."""

    offered: int = 0
    written: int = 0
    dropped_indices: list[int] = field(default_factory=list)
    duplicated_indices: list[int] = field(default_factory=list)
    reordered_pairs: list[tuple[int, int]] = field(default_factory=list)
    tail_written: int = 0  # of ``written``: frames of the step after the last allreduce (SimOptions.tail)

    def to_json(self) -> dict:
        return {"offered": self.offered, "written": self.written,
                "dropped": len(self.dropped_indices), "duplicated": len(self.duplicated_indices),
                "reordered": len(self.reordered_pairs), "dropped_indices": self.dropped_indices,
                "duplicated_indices": self.duplicated_indices,
                "reordered_pairs": [list(p) for p in self.reordered_pairs], "tail_written": self.tail_written}


class MirrorPort:
    """One port's pcap: frames are fed in time order, batch by batch, injected, then written."""

    def __init__(self, spec: MirrorSpec, path: str, injection: Injection, seed: int, index: int) -> None:
        from flowcheck.capture.mirror.pcap import PcapWriter

        self.spec = spec
        self.path = path
        self.inj = injection
        self.rng = np.random.default_rng([seed, 0x4D495252, index])
        self.record = PortRecord()
        self._writer = PcapWriter(path, nanosecond=True)
        self._last_ts = 0

    def feed(self, frames: list[Frame], keep: int | None = None, tail: bool = False) -> None:
        """Copy the frames this port sees (``keep``: only the first that many: the capture ends there; ``tail``:
        they are the step after the last allreduce, counted in ``record.tail_written``)."""
        mine = self.spec.select(frames)[:keep]
        before = self.record.written
        base = self.record.offered
        self.record.offered += len(mine)
        order = list(range(len(mine)))
        if self.inj.loss:
            drop = self.rng.random(len(mine)) < self.inj.loss
            self.record.dropped_indices += [base + i for i in np.flatnonzero(drop).tolist()]
            order = [i for i in order if not drop[i]]
        if self.inj.reorder:
            swap = self.rng.random(len(order)) < self.inj.reorder
            ahead = self.rng.integers(1, REORDER_WINDOW + 1, size=len(order))
            for i in np.flatnonzero(swap).tolist():
                j = i + int(ahead[i])
                if j < len(order):
                    self.record.reordered_pairs.append((base + order[i], base + order[j]))
                    order[i], order[j] = order[j], order[i]
        dup = self.rng.random(len(order)) < self.inj.dup if self.inj.dup else np.zeros(len(order), bool)
        for i, k in enumerate(order):
            self._write(mine[k])
            if dup[i]:
                self.record.duplicated_indices.append(base + k)
                self._write(mine[k])
        if tail:
            self.record.tail_written += self.record.written - before

    def _write(self, frame: Frame) -> None:
        # a reordered copy keeps time moving forward: a capture's timestamps never go back
        ts = max(EPOCH_NS + frame.t_ns, self._last_ts + 1)
        self._writer.write(frame.data, ts)
        self._last_ts = ts
        self.record.written += 1

    def close(self) -> None:
        self._writer.close()
