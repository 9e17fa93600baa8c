"""What a mirror decode found wrong or odd besides the allreduces: one small frozen type per kind of anomaly.

``Decoded.anomalies`` holds them; ``to_json()`` gives the report's dict (the contract of ``flowcheck decode --json``,
../shared/specs/nccl-roce-wire.md: its ``type`` and every key, in this order).  Three scopes: a *send* anomaly names
the step of one send on a ring connection (``send_step``; a streaming decode keeps those of the steps its handed-out
allreduces used), a *packet* anomaly comes from the reassembler's PSN bookkeeping (``packet_level``: a streaming decode
counts it once from the frames it drops), the others are about the connections found.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Anomaly:
    """Base of every anomaly: its report ``type`` and its JSON."""

    type: ClassVar[str] = ""
    packet_level: ClassVar[bool] = False

    @property
    def send_step(self) -> int | None:
        """The step of the send on a ring connection it is about (None: not about one send)."""
        return None

    def to_json(self) -> dict:
        raise NotImplementedError


@dataclass(frozen=True)
class SendAnomaly(Anomaly):
    """About one send, named as reports name a send (``WireSend.info``): stream, PSN range, LL flag (its step), time."""

    stream: str
    psn: tuple[int, int]
    flag: int
    t0: int | None

    @classmethod
    def at(cls, where: dict, **fields) -> SendAnomaly:
        """The anomaly of the send ``where`` names (a ``WireSend.info`` dict)."""
        return cls(where["stream"], tuple(where["psn"]), where["flag"], where["t0"], **fields)

    @property
    def send_step(self) -> int | None:
        return self.flag

    def to_json(self) -> dict:
        return {"stream": self.stream, "psn": list(self.psn), "flag": self.flag, "t0": self.t0, "type": self.type,
                **self._fields()}

    def _fields(self) -> dict:
        return {}


@dataclass(frozen=True)
class LLMisalignedSegment(SendAnomaly):
    """An LL segment that does not start on a 16-byte line: its bytes are left out (missing, never misplaced)."""

    type: ClassVar[str] = "ll_misaligned_segment"
    bytes: int

    def _fields(self) -> dict:
        return {"bytes": self.bytes}


@dataclass(frozen=True)
class LLBadFlags(SendAnomaly):
    """An LL segment with lines whose flags are not the send's step: left out whole."""

    type: ClassVar[str] = "ll_bad_flags"
    lines: int

    def _fields(self) -> dict:
        return {"lines": self.lines}


def unplaced_anomaly(where: dict, status: int, nbytes: int) -> SendAnomaly:
    """The anomaly of an LL segment a merge left out (``roce.Merged.unplaced``: status < 0 misaligned, else the
    count of lines with bad flags) of the send ``where`` names."""
    if status < 0:
        return LLMisalignedSegment.at(where, bytes=nbytes)
    return LLBadFlags.at(where, lines=status)


@dataclass(frozen=True)
class StepSeenTwice(SendAnomaly):
    """A second send at a step a connection already had: the first is kept."""

    type: ClassVar[str] = "step_seen_twice"


@dataclass(frozen=True)
class SendLost(Anomaly):
    """A step with no send on a connection between steps that have one."""

    type: ClassVar[str] = "send_lost"
    stream: str
    step: int

    @property
    def send_step(self) -> int | None:
        return self.step

    def to_json(self) -> dict:
        return {"type": self.type, "stream": self.stream, "step": self.step}


@dataclass(frozen=True)
class TrailingResend(Anomaly):
    """A send after the last allreduce that carries final values of it again (ignored: nothing of it is merged)."""

    type: ClassVar[str] = "trailing_resend"
    stream: str
    step: int  # the connection's step
    resend_of: int  # the allreduce (1-based index)
    allreduce_step: int  # its place in that allreduce's order of sends on the connection, 1-based
    range: tuple[int, int]  # the elements whose final values it repeats ([a, a): a 0-byte send)

    @property
    def send_step(self) -> int | None:
        return self.step

    @property
    def detail(self) -> str:
        a, b = self.range
        return (f"trailing re-send of step {self.allreduce_step} of allreduce {self.resend_of} ignored "
                f"(final values of elements [{a}, {b}) again)")

    def to_json(self) -> dict:
        return {"type": self.type, "stream": self.stream, "step": self.step, "resend_of": self.resend_of,
                "allreduce_step": self.allreduce_step, "range": list(self.range), "detail": self.detail}


@dataclass(frozen=True)
class ChannelCount(Anomaly):
    """A ring link with another number of data connections than the channels decoded."""

    type: ClassVar[str] = "channel_count"
    link: str
    data_connections: int
    channels: int

    def to_json(self) -> dict:
        return {"type": self.type, "link": self.link, "data_connections": self.data_connections,
                "channels": self.channels}


@dataclass(frozen=True)
class NoRingConnection(Anomaly):
    """No stream between ring neighbours carries NCCL sends."""

    type: ClassVar[str] = "no_ring_connection"
    detail: str = ("no stream between ring neighbours of the job carries NCCL sends; check the ring members' MAC/IP "
                   "addresses and the protocol")

    def to_json(self) -> dict:
        return {"type": self.type, "detail": self.detail}


@dataclass(frozen=True)
class PsnGap(Anomaly):
    """Packets [psn[0], psn[1]) of a stream that no copy delivered."""

    type: ClassVar[str] = "psn_gap"
    packet_level: ClassVar[bool] = True
    stream: str
    psn: tuple[int, int]
    packets: int

    def to_json(self) -> dict:
        return {"type": self.type, "stream": self.stream, "psn": list(self.psn), "packets": self.packets}


@dataclass(frozen=True)
class Duplicates(Anomaly):
    """Packets of a stream seen more than once."""

    type: ClassVar[str] = "duplicates"
    packet_level: ClassVar[bool] = True
    stream: str
    packets: int

    def to_json(self) -> dict:
        return {"type": self.type, "stream": self.stream, "packets": self.packets}
