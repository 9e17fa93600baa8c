"""Live capture from a mirror NIC: AF_PACKET sockets (all EtherTypes), frames in batches.

By default a PACKET_MMAP TPACKET_V3 ring per socket, read a block at a time, optionally fanned out by flow over
several sockets (``packet_ring``).  ``ring=None`` falls back to one ``recvmsg_into`` per frame (a few hundred
thousand frames per second).  Either way: kernel receive timestamps, VLAN tags the NIC stripped put back, frames
this host sent skipped, the kernel's drops reported.
"""
from __future__ import annotations

import errno
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from flowcheck.capture.mirror.packet_ring import FanoutReaders, RingConfig
from flowcheck.capture.mirror.pcap import Frames
from flowcheck.errors import CaptureError

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4  # sockaddr_ll.sll_pkttype of frames this host sent
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
SOL_PACKET, PACKET_STATISTICS, PACKET_AUXDATA = 263, 6, 8  # linux/if_packet.h
TP_STATUS_VLAN_VALID, TP_STATUS_VLAN_TPID_VALID = 0x10, 0x40
_ANCILLARY = socket.CMSG_SPACE(16) + socket.CMSG_SPACE(20)  # timespec + tpacket_auxdata
_MAX_FRAME = 65536
_POLL_S = 0.05  # how often a blocked read looks at `stop` and the deadline
# The socket's receive buffer: it holds what arrives while the decoder works on a window (the kernel's
# default, ~200 KiB, is a few hundred frames).  Root (CAP_NET_ADMIN) may exceed net.core.rmem_max.
RCVBUF_BYTES = 256 << 20
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


def check_interface(interface: str) -> None:
    try:
        socket.if_nametoindex(interface)
    except OSError as e:
        raise CaptureError(f"no network interface named {interface!r} (see `ip link`)") from e


def open_socket(interface: str) -> socket.socket:
    """A raw AF_PACKET socket bound to ``interface``; CaptureError when that cannot be done."""
    check_interface(interface)
    try:
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    except PermissionError as e:
        raise CaptureError(f"capturing on {interface!r} needs root or CAP_NET_RAW: {e}") from e
    try:
        sock.bind((interface, ETH_P_ALL))
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RCVBUF_BYTES)
        except OSError:  # no CAP_NET_ADMIN: as much as net.core.rmem_max allows
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.setsockopt(SOL_PACKET, PACKET_AUXDATA, 1)
        sock.settimeout(_POLL_S)
    except OSError as e:
        sock.close()
        if e.errno == errno.ENODEV:
            raise CaptureError(f"network interface {interface!r} disappeared") from e
        raise CaptureError(f"cannot bind a packet socket to {interface!r}: {e}") from e
    return sock


def live_frames(interface: str, *, duration_s: float | None = None, max_frames: int | None = None,
                stop: threading.Event | None = None, batch: int = 4096, idle: bool = False,
                on_open: Callable[[], None] | None = None,
                on_drops: Callable[[int], None] | None = None,
                ring: RingConfig | None = RingConfig()) -> Iterator[Frames]:
    """Yield batches of frames received on ``interface`` until the duration, frame count or
    ``stop`` says to end.  A batch is yielded when full or after a quiet poll interval, so a
    slow link still delivers promptly; with ``idle``, a quiet poll with nothing received yields an
    empty batch (a streaming decoder can then settle by the clock).  Frames this host sent are
    skipped (mirror ports only receive).  ``on_open`` is called once the socket is bound (frames
    from then on are captured); ``on_drops(n)`` after a batch when the kernel dropped n frames since the
    last one because the socket's buffer (or ring) was full (the reader fell behind).  ``ring``: the PACKET_MMAP
    ring and fanout workers; None reads one frame per system call.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    deadline = None if duration_s is None else time.monotonic() + duration_s
    if ring is not None:
        yield from _ring_frames(interface, ring, batch, deadline, max_frames, stop, idle, on_open, on_drops)
        return
    total = 0
    with open_socket(interface) as sock:
        if on_open is not None:
            on_open()
        reader = _BatchReader(sock, batch)
        while (max_frames is None or total < max_frames) and not (stop is not None and stop.is_set()):
            if deadline is not None and time.monotonic() >= deadline:
                break
            limit = batch if max_frames is None else min(batch, max_frames - total)
            frames = reader.read(limit, deadline, stop, idle)
            if on_drops is not None and (dropped := reader.dropped()):
                on_drops(dropped)
            total += len(frames)
            if len(frames) or idle:
                yield frames


def _ring_frames(interface: str, ring: RingConfig, batch: int, deadline: float | None, max_frames: int | None,
                 stop: threading.Event | None, idle: bool, on_open: Callable[[], None] | None,
                 on_drops: Callable[[int], None] | None) -> Iterator[Frames]:
    """``live_frames`` over PACKET_MMAP rings: batches as the reader threads hand them over."""
    check_interface(interface)
    readers = FanoutReaders(interface, ring, batch)
    try:
        if on_open is not None:
            on_open()
        readers.start()
        total = 0
        while (max_frames is None or total < max_frames) and not (stop is not None and stop.is_set()):
            if deadline is not None and time.monotonic() >= deadline:
                break
            frames = readers.get(_POLL_S)
            if on_drops is not None and (dropped := readers.dropped()):
                on_drops(dropped)
            if frames is None:
                if idle:
                    yield Frames.from_list([], [], readers.source)
                continue
            if max_frames is not None and total + len(frames) > max_frames:
                frames = frames.select(0, max_frames - total)
            total += len(frames)
            yield frames
    finally:
        readers.close()


class _BatchReader:
    """Receives frames into one preallocated buffer per batch (no per-frame ``bytes``)."""

    def __init__(self, sock: socket.socket, batch: int) -> None:
        self.sock, self.batch = sock, batch
        self.source = f"live:{sock.getsockname()[0]}"

    def read(self, limit: int, deadline: float | None, stop: threading.Event | None, idle: bool = False) -> Frames:
        buf = np.empty(limit * 2048, dtype=np.uint8)  # grows for jumbo frames
        offsets, lengths, ts = [], [], []
        used = 0
        while len(offsets) < limit:
            if len(buf) - used < _MAX_FRAME + 4:
                buf = np.concatenate([buf[:used], np.empty(max(len(buf), _MAX_FRAME + 4), dtype=np.uint8)])
            got = self._recv(buf, used)
            if got is None:  # quiet: hand over what we have
                if offsets or idle or (stop is not None and stop.is_set()):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    break
                continue
            start, n, ts_ns = got
            offsets.append(start), lengths.append(n), ts.append(ts_ns)
            used = start + n
        return Frames(buf[:used], np.array(offsets, dtype=np.int64), np.array(lengths, dtype=np.int32),
                      np.array(ts, dtype=np.int64), self.source)

    def dropped(self) -> int:
        """Frames the kernel dropped since the last call (PACKET_STATISTICS: reading it resets it)."""
        try:
            _packets, drops = struct.unpack("II", self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
        except OSError:
            return 0
        return drops

    def _recv(self, buf: np.ndarray, at: int) -> tuple[int, int, int] | None:
        """One frame into buf[at + 4:] -> (start, length, ts_ns); None after a quiet poll.

        The NIC (veth too) strips 802.1Q tags into PACKET_AUXDATA; the 4 spare bytes let the
        tag go back between the MAC addresses without moving the frame.
        """
        view = memoryview(buf)[at + 4 : at + 4 + _MAX_FRAME]
        while True:
            try:
                n, anc, _flags, addr = self.sock.recvmsg_into([view], _ANCILLARY)
            except TimeoutError:
                return None
            except InterruptedError:
                continue
            except OSError as e:  # ENETDOWN when the link goes down, ENXIO when it is removed
                raise CaptureError(f"reading {self.source}: {e}") from e
            if addr[2] == PACKET_OUTGOING:
                continue
            ts_ns, tag = _ancillary(anc)
            if tag is None:
                return at + 4, n, ts_ns
            buf[at : at + 12] = buf[at + 4 : at + 16]
            buf[at + 12 : at + 16] = np.frombuffer(tag, dtype=np.uint8)
            return at, n + 4, ts_ns


def _ancillary(ancillary: list[tuple[int, int, bytes]]) -> tuple[int, bytes | None]:
    """(receive time in ns, the stripped VLAN tag as wire bytes or None)."""
    ts_ns, tag = None, None
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
            sec, nsec = struct.unpack("qq", data[:16])
            ts_ns = sec * 1_000_000_000 + nsec
        elif level == SOL_PACKET and kind == PACKET_AUXDATA and len(data) >= 20:
            status, _len, _snap, _mac, _net, tci, tpid = struct.unpack("IIIHHHH", data[:20])
            if status & TP_STATUS_VLAN_VALID:
                tag = struct.pack(">HH", tpid if status & TP_STATUS_VLAN_TPID_VALID else 0x8100, tci)
    return (time.time_ns() if ts_ns is None else ts_ns), tag
