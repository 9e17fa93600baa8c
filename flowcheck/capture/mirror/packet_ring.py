"""The PACKET_MMAP receive ring of a live capture: TPACKET_V3 blocks, polled a block at a time, fanned out by flow.

The kernel writes frames into a ring of ``block_count`` blocks of ``block_size`` bytes shared with us (no
system call per frame); a block is handed over when full or ``block_timeout_ms`` after its first frame, and
``_mirror.ring_block`` copies its frames into the batch buffer in one native pass (GIL released), putting
stripped VLAN tags back.  With ``workers`` > 1 there are that many sockets, each with its own ring, in one
PACKET_FANOUT group hashed by flow: the kernel sends every frame of one (5-tuple) flow — one RoCE QP — to the
same ring, so each worker sees whole streams in order.  Drops are the sum of the sockets' PACKET_STATISTICS.
"""
from __future__ import annotations

import mmap
import os
import queue
import select
import socket
import struct
import threading
from dataclasses import dataclass

import numpy as np

from flowcheck import _mirror
from flowcheck.capture.mirror.pcap import Frames
from flowcheck.errors import CaptureError

SOL_PACKET, PACKET_RX_RING, PACKET_STATISTICS, PACKET_VERSION, PACKET_FANOUT = 263, 5, 6, 10, 18
PACKET_IGNORE_OUTGOING = 23
TPACKET_V3 = 2
PACKET_FANOUT_HASH, PACKET_FANOUT_FLAG_DEFRAG = 0, 0x8000
TP_STATUS_KERNEL, TP_STATUS_USER = 0, 1
_BLOCK_STATUS = 8  # offset of tpacket_hdr_v1.block_status in a block
_FRAME_SIZE = 2048  # tp_frame_size: nominal under TPACKET_V3 (frames pack into a block at their own size)
_MIN_SLOT = 80  # the least room a frame takes in a block (tpacket3_hdr + sockaddr_ll + an Ethernet header, aligned)


@dataclass(frozen=True)
class RingConfig:
    """The receive ring of each capture socket."""

    block_size: int = 4 << 20  # bytes per block (a multiple of the page size; ~4000 1 KiB RoCE frames)
    block_count: int = 64  # blocks per socket: block_size * block_count bytes of kernel-shared memory each
    block_timeout_ms: int = 10  # a block that is not full is handed over this long after its first frame
    workers: int = 1  # sockets (rings) in one PACKET_FANOUT group, one reader thread each

    def __post_init__(self) -> None:
        page = mmap.PAGESIZE
        if self.block_size < page or self.block_size % page:
            raise ValueError(f"block_size: expected a multiple of the page size ({page}), found {self.block_size}")
        if self.block_count < 2 or self.block_timeout_ms < 1 or not 1 <= self.workers <= 64:
            raise ValueError(f"expected block_count >= 2, block_timeout_ms >= 1, 1 <= workers <= 64; found "
                             f"{self.block_count}, {self.block_timeout_ms}, {self.workers}")


class Ring:
    """One capture socket with a mapped TPACKET_V3 ring; ``blocks()`` yields retired blocks (as memoryviews)."""

    def __init__(self, interface: str, config: RingConfig, fanout_group: int | None) -> None:
        self.config, self.map = config, None
        try:
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        except PermissionError as e:
            raise CaptureError(f"capturing on {interface!r} needs root or CAP_NET_RAW: {e}") from e
        try:
            self.sock.setsockopt(SOL_PACKET, PACKET_VERSION, TPACKET_V3)
            frames_per_block = config.block_size // _FRAME_SIZE
            req = struct.pack("7I", config.block_size, config.block_count, _FRAME_SIZE,
                              frames_per_block * config.block_count, config.block_timeout_ms, 0, 0)
            self.sock.setsockopt(SOL_PACKET, PACKET_RX_RING, req)
            self.map = mmap.mmap(self.sock.fileno(), config.block_size * config.block_count, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
            self.sock.bind((interface, 0x0003))
            try:  # mirror ports only receive; frames this host sends are skipped natively too
                self.sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
            except OSError:
                pass
            if fanout_group is not None:
                self.sock.setsockopt(SOL_PACKET, PACKET_FANOUT, struct.pack(
                    "I", fanout_group | (PACKET_FANOUT_HASH | PACKET_FANOUT_FLAG_DEFRAG) << 16))
        except OSError as e:
            self.close()
            raise CaptureError(f"cannot set up a PACKET_MMAP ring on {interface!r} ({config}): {e}") from e
        self.next = 0
        self.poller = select.poll()
        self.poller.register(self.sock.fileno(), select.POLLIN | select.POLLERR)

    def ready(self, timeout_ms: int) -> memoryview | None:
        """The next retired block (give it back with ``release``), or None after ``timeout_ms`` without one."""
        at = self.next * self.config.block_size
        if not struct.unpack_from("I", self.map, at + _BLOCK_STATUS)[0] & TP_STATUS_USER:
            for _fd, event in self.poller.poll(timeout_ms):
                if event & select.POLLERR:
                    self._raise_socket_error()
            if not struct.unpack_from("I", self.map, at + _BLOCK_STATUS)[0] & TP_STATUS_USER:
                return None
        return memoryview(self.map)[at:at + self.config.block_size]

    def release(self, block: memoryview) -> None:
        """Hand the current block back to the kernel and move on."""
        block.release()
        struct.pack_into("I", self.map, self.next * self.config.block_size + _BLOCK_STATUS, TP_STATUS_KERNEL)
        self.next = (self.next + 1) % self.config.block_count

    def dropped(self) -> int:
        """Frames the kernel dropped since the last call (tpacket_stats_v3; reading resets it)."""
        try:
            _packets, drops, _freezes = struct.unpack("III", self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 12))
        except OSError:
            return 0
        return drops

    def _raise_socket_error(self) -> None:
        err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise CaptureError(f"reading {self.sock.getsockname()[0]}: {os.strerror(err)}")

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
            self.map = None
        self.sock.close()


class BlockBatcher:
    """Copies retired blocks into batches of at least ``batch`` frames (or whatever a quiet poll found)."""

    def __init__(self, block_size: int, batch: int, source: str) -> None:
        self.block_size, self.batch, self.source = block_size, batch, source
        self._new()

    def _new(self) -> None:
        rows = max(self.batch, self.block_size // _MIN_SLOT)
        self.buf = np.empty(self.block_size * 2 + 4 * rows, np.uint8)
        self.offsets, self.lengths = np.empty(2 * rows, np.int64), np.empty(2 * rows, np.int32)
        self.ts = np.empty(2 * rows, np.int64)
        self.rows, self.used = 0, 0

    def full(self) -> bool:
        """No room for another block: take the batch first."""
        return (self.rows >= self.batch or len(self.buf) - self.used < self.block_size * 5 // 4
                or len(self.offsets) - self.rows < self.block_size // _MIN_SLOT)

    def add(self, block: memoryview) -> None:
        try:
            self.rows, self.used = _mirror.ring_block(block, self.buf, self.used, self.offsets, self.lengths,
                                                      self.ts, self.rows)
        except ValueError as e:
            raise CaptureError(f"reading {self.source}: a malformed ring block ({e})") from e

    def take(self) -> Frames:
        n, used = self.rows, self.used
        out = Frames(self.buf[:used], self.offsets[:n].copy(), self.lengths[:n].copy(), self.ts[:n].copy(), self.source)
        self._new()
        return out


def fanout_group() -> int:
    """A fanout group id for this capture (16 bits, distinct per process)."""
    return (os.getpid() ^ threading.get_ident()) & 0xFFFF


class FanoutReaders:
    """K rings in one fanout group, one thread each copying blocks into batches; ``get`` takes the next batch."""

    def __init__(self, interface: str, config: RingConfig, batch: int) -> None:
        group = fanout_group() if config.workers > 1 else None
        self.rings: list[Ring] = []
        try:
            for _ in range(config.workers):
                self.rings.append(Ring(interface, config, group))
        except CaptureError:
            self.close()
            raise
        self.batches: queue.Queue = queue.Queue(maxsize=4 * config.workers)
        self.stopping = threading.Event()
        self.source = f"live:{interface}"
        self.threads = [threading.Thread(target=self._run, args=(r, batch), daemon=True, name=f"ring-{k}")
                        for k, r in enumerate(self.rings)]

    def start(self) -> None:
        """Start reading (until then the rings fill, and overflow into drops)."""
        for t in self.threads:
            t.start()

    def _run(self, ring: Ring, batch: int) -> None:
        batcher = BlockBatcher(ring.config.block_size, batch, self.source)
        try:
            while not self.stopping.is_set():
                block = ring.ready(20)
                if block is not None:
                    batcher.add(block)
                    ring.release(block)
                if batcher.rows and (block is None or batcher.full()):
                    self._put(batcher.take())
        except Exception as e:  # noqa: BLE001 — handed to the consumer, raised there
            self._put(e)

    def _put(self, item) -> None:
        while not self.stopping.is_set():
            try:
                self.batches.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def get(self, timeout_s: float) -> Frames | None:
        """The next batch any ring produced, or None after ``timeout_s``; a reader thread's error is raised here."""
        try:
            item = self.batches.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if isinstance(item, Exception):
            raise item
        return item

    def dropped(self) -> int:
        return sum(r.dropped() for r in self.rings)

    def close(self) -> None:
        self.stopping.set()
        for t in getattr(self, "threads", []):
            if t.is_alive():
                t.join(5)
        for r in self.rings:
            r.close()
