"""Capture files: read pcap/pcapng into one buffer of frames, write classic pcap.

A capture is read once (memory-mapped) and indexed by the native block walker; frames are
never copied into Python ``bytes`` one by one, so a million-frame file indexes in milliseconds.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from flowcheck import _mirror
from flowcheck.errors import CaptureError

LINKTYPE_ETHERNET = 1


@dataclass(frozen=True)
class Frames:
    """Captured frames: frame i is ``buf[offsets[i] : offsets[i] + lengths[i]]``.

    ``buf`` is a uint8 array (the memory-mapped file for a capture on disk); ``ts_ns`` is the
    capture time in ns since the epoch (-1 where the format has none: pcapng simple packet blocks).
    """

    buf: np.ndarray
    offsets: np.ndarray  # int64
    lengths: np.ndarray  # int32, captured length
    ts_ns: np.ndarray  # int64
    source: str

    def __len__(self) -> int:
        return len(self.offsets)

    def select(self, start: int, stop: int | None = None) -> Frames:
        """Frames [start, stop) as a view (no copy): ``buf`` from the first one's start."""
        offsets, lengths = self.offsets[start:stop], self.lengths[start:stop]
        if not len(offsets):
            return Frames(self.buf[:0], offsets, lengths, self.ts_ns[start:stop], self.source)
        base, end = int(offsets.min()), int((offsets + lengths).max())
        return Frames(self.buf[base:end], offsets - base, lengths, self.ts_ns[start:stop], self.source)

    def frame(self, i: int) -> bytes:
        start = int(self.offsets[i])
        return bytes(memoryview(self.buf)[start : start + int(self.lengths[i])])

    @classmethod
    def from_list(cls, frames: list[bytes], ts_ns: list[int] | None = None, source: str = "memory") -> Frames:
        """Frames held in memory (tests, simulators): concatenated into one buffer."""
        lengths = np.fromiter((len(f) for f in frames), dtype=np.int32, count=len(frames))
        offsets = np.zeros(len(frames), dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        buf = np.frombuffer(b"".join(frames), dtype=np.uint8)
        ts = np.arange(len(frames), dtype=np.int64) if ts_ns is None else np.asarray(ts_ns, dtype=np.int64)
        if len(ts) != len(frames):
            raise ValueError(f"ts_ns has {len(ts)} entries for {len(frames)} frames")
        return cls(buf, offsets, lengths, ts, source)


def read_capture(path: str) -> Frames:
    """Index a pcap or pcapng file of Ethernet frames.

    Raises CaptureError when the file is not a capture, is truncated or garbled, or holds a
    link type other than Ethernet (1).
    """
    try:
        size = os.path.getsize(path)
        buf = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, dtype=np.uint8)
    except OSError as e:
        raise CaptureError(f"cannot read capture {path!r}: {e}") from e
    try:
        offsets, lengths, ts_ns, linktypes, _ = _mirror.index_capture(buf)
    except ValueError as e:
        raise CaptureError(f"{path}: {e}") from e
    bad = np.flatnonzero(linktypes != LINKTYPE_ETHERNET)
    if len(bad):
        raise CaptureError(
            f"{path}: frame {bad[0]} has link type {linktypes[bad[0]]}; expected 1 (Ethernet) — "
            "capture the mirror port as Ethernet (e.g. tcpdump -i <nic>, not -i any)"
        )
    return Frames(buf, offsets, lengths, ts_ns, path)


class PcapWriter:
    """Write Ethernet frames to a classic pcap file (linktype 1), buffered.

    Usage::

        with PcapWriter("mirror.pcap") as w:
            w.write(frame, ts_ns)
    """

    _FLUSH_BYTES = 8 << 20  # a simulator writes millions of frames: one syscall per 8 MiB

    def __init__(self, path: str, nanosecond: bool = True, snaplen: int = 65535) -> None:
        self.path, self.nanosecond, self.snaplen = path, nanosecond, snaplen
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._file: BinaryIO = open(path, "wb")
        magic = 0xA1B23C4D if nanosecond else 0xA1B2C3D4
        self._file.write(struct.pack("<IHHiIII", magic, 2, 4, 0, 0, snaplen, LINKTYPE_ETHERNET))
        self._record = struct.Struct("<IIII")

    def write(self, frame: bytes, ts_ns: int) -> None:
        sec, ns = divmod(int(ts_ns), 1_000_000_000)
        frac = ns if self.nanosecond else ns // 1000
        cap = frame[: self.snaplen]
        self._pending.append(self._record.pack(sec, frac, len(cap), len(frame)))
        self._pending.append(bytes(cap))
        self._pending_bytes += 16 + len(cap)
        if self._pending_bytes >= self._FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        self._file.write(b"".join(self._pending))
        self._pending.clear()
        self._pending_bytes = 0
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()

    def __enter__(self) -> PcapWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
