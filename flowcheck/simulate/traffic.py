"""NCCL's traffic as RoCEv2 frames: ring sends, flow-control posts, ACKs, other collectives, p2p, UD.

A ``Wire`` owns every RC connection of the virtual cluster and turns NCCL-level sends into the
frames a switch would forward, each with a timestamp (ns since the run started), its sender and
its receiver.  Conventions (what a decoder may rely on, and what it must not):

- ranks: MAC ``02:fc:5e:00:00:<rank+1>``, IPv6 link-local from that MAC (EUI-64), or IPv4
  ``10.0.0.<rank+1>``; optional 802.1Q tag;
- every rank allocates QPNs upward from a seeded random base; connections are set up channel by
  channel, so on a given link (position i -> i+1) the data QPNs increase with the channel
  number; p2p connections are set up later (higher QPNs).  Each QP has its own UDP source port;
- every QP starts at a seeded random 24-bit PSN that wraps;
- one NCCL connection = a data QP (sender -> receiver, RDMA WRITE with immediate = wire size)
  plus a flow-control QP (receiver -> sender, 32-byte WRITE_ONLY without immediate posted
  before each send); its step counter starts at 1 and grows by one per send of any collective,
  empty (0-byte) sends included; LL lines carry it as the flag; the write lands at
  ``base + ((step-1) % 8) * step_bytes`` (LL and Simple alike);
- the receiver ACKs (opcode 17 + AETH) every ``ACK_EVERY`` packets and at the end of each message.
"""
from __future__ import annotations

import ipaddress
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from flowcheck.capture.mirror.frames import Endpoint, ack_frame, ud_frame, write_frames
from flowcheck.capture.mirror.ring import RingParams, ring_sends
from flowcheck.simulate.allreduce import RingReduce

MASK24 = (1 << 24) - 1
SLOTS = 8  # NCCL_STEPS: buffer slots per connection
ACK_EVERY = 8
FIFO_ENTRY = 32  # bytes of one flow-control post
P2P_STEP_BYTES = 131072  # p2p (Simple) receive slot, what its flow-control posts announce
# time model (ns): ~100 Gb/s per NIC, a few microseconds per step
PKT_NS = 90
CTS_LEAD_NS = 400
ACK_RTT_NS = 1500
STEP_GAP_NS = 2500

Wanted = Callable[[int, int], bool]  # (src rank, dst rank) -> build this frame's bytes?


class Frame(NamedTuple):
    """One frame on the fabric (a tuple: hundreds of thousands are made per run; sorts by time, then creation)."""

    t_ns: int
    seq: int  # creation order: breaks ties in time
    src: int  # sending rank
    dst: int  # receiving rank
    data: bytes


def rank_endpoint(rank: int, *, ipv4: bool = False, vlan: int | None = None) -> Endpoint:
    """The NIC address of a virtual rank."""
    mac = f"02:fc:5e:00:00:{rank + 1:02x}"
    if ipv4:
        ip = f"10.0.0.{rank + 1}"
    else:
        b = bytes.fromhex(mac.replace(":", ""))
        eui = bytes([b[0] ^ 0x02]) + b[1:3] + b"\xff\xfe" + b[3:]
        ip = str(ipaddress.IPv6Address(b"\xfe\x80" + bytes(6) + eui))
    return Endpoint(mac, ip, vlan)


def ll_encode(values: np.ndarray, flag: int) -> bytes:
    """LL lines {u32 data0, u32 flag, u32 data1, u32 flag}; an odd tail word is padded with zero."""
    raw = np.ascontiguousarray(values).view(np.uint8)
    words = np.zeros(-(-raw.size // 8) * 2, dtype="<u4")
    words.view(np.uint8)[:raw.size] = raw
    lines = np.empty((words.size // 2, 4), dtype="<u4")
    lines[:, 0::2] = words.reshape(-1, 2)
    lines[:, 1::2] = flag
    return lines.tobytes()


def ll_wire_bytes(nbytes: int) -> int:
    return -(-nbytes // 8) * 16


@dataclass
class Qp:
    """The requester side of one RC connection direction: who sends, to which QPN, at which PSN."""

    src: int
    dst: int
    dqpn: int  # responder's QPN: BTH DestQP of requests
    sqpn: int  # requester's QPN: BTH DestQP of the responder's ACKs
    sport: int  # UDP source port of requests
    ack_sport: int  # UDP source port of the responder's ACKs
    psn: int  # next PSN
    msn: int = 0  # messages the responder completed
    since_ack: int = 0


@dataclass
class Link:
    """One NCCL connection: data QP, the receiver's flow-control QP, step counter and buffers."""

    kind: str  # ring | p2p
    channel: int
    proto: str  # ll | simple
    data: Qp
    fifo: Qp  # receiver -> sender
    base: int  # VA of the receive buffer's slot 0
    rkey: int
    step_bytes: int
    fifo_base: int
    fifo_rkey: int
    steps: int = 0  # sends so far; the next send's step (LL flag) is steps + 1


class Wire:
    """Every connection of an N-rank ring, and the frames produced so far (not yet drained)."""

    def __init__(self, endpoints: list[Endpoint], ring: RingParams, *, mtu: int, seed: int, wanted: Wanted) -> None:
        self.ep = endpoints
        self.ring = ring
        self.mtu = mtu
        self.wanted = wanted
        self.rng = np.random.default_rng([seed, 0x57495245])
        n = ring.nranks
        self._qpn = [int(x) for x in self.rng.integers(0x100, 0x800000, size=n)]
        self._sports: set[int] = set()
        self._ud_sports: dict[int, int] = {}
        self.links: dict[tuple[int, int], Link] = {}
        for channel in range(ring.nchannels):  # channel by channel: data QPNs grow with the channel
            for i in range(n):
                self.links[i, channel] = self._link("ring", i, (i + 1) % n, channel, ring.protocol, ring.step_bytes)
        self.p2p_links: dict[tuple[int, int], Link] = {}
        self.frames: list[Frame] = []
        self._seq = 0
        self.now = 0
        self.counts = {"ring_sends": 0, "p2p_sends": 0, "flow_control": 0, "acks": 0, "ud": 0}

    # ---- setup -------------------------------------------------------------
    def _alloc_qpn(self, rank: int) -> int:
        self._qpn[rank] += 1
        return self._qpn[rank]

    def _sport(self) -> int:
        while True:
            port = 0xC000 + int(self.rng.integers(0, 0x4000))
            if port not in self._sports:
                self._sports.add(port)
                return port

    def _qp(self, src: int, dst: int) -> Qp:
        sqpn, dqpn = self._alloc_qpn(src), self._alloc_qpn(dst)
        return Qp(src, dst, dqpn, sqpn, self._sport(), self._sport(), int(self.rng.integers(0, 1 << 24)))

    def _va(self) -> int:
        return 0x7F00_0000_0000 + int(self.rng.integers(0, 1 << 24)) * 0x10000

    def _link(self, kind: str, src: int, dst: int, channel: int, proto: str, step_bytes: int) -> Link:
        data = self._qp(src, dst)
        fifo = self._qp(dst, src)
        return Link(kind, channel, proto, data, fifo, self._va(), int(self.rng.integers(1, 1 << 32)), step_bytes,
                    self._va(), int(self.rng.integers(1, 1 << 32)))

    def connection_table(self) -> list[dict]:
        """Every connection's QPNs, ports and first PSNs (for truth/traffic.json)."""
        rows = []
        for link in list(self.links.values()) + list(self.p2p_links.values()):
            rows.append({"kind": link.kind, "channel": link.channel, "protocol": link.proto,
                         "src": link.data.src, "dst": link.data.dst,
                         "data_qpn": link.data.dqpn, "data_src_qpn": link.data.sqpn, "data_sport": link.data.sport,
                         "fifo_qpn": link.fifo.dqpn, "fifo_sport": link.fifo.sport,
                         "buffer_va": link.base, "step_bytes": link.step_bytes, "steps": link.steps})
        return rows

    # ---- frames ------------------------------------------------------------
    def _add(self, t: int, src: int, dst: int, data: bytes) -> None:
        self._seq += 1
        self.frames.append(Frame(t, self._seq, src, dst, data))

    def _write(self, t: int, qp: Qp, *, va: int, rkey: int, size: int, payload: Callable[[], bytes],
               imm: int | None, spacing: int = PKT_NS) -> int:
        """One RDMA WRITE of ``size`` bytes (+ the responder's ACKs); returns its packet count."""
        npk = max(1, -(-size // self.mtu))
        frames: list[bytes] | None = None
        if self.wanted(qp.src, qp.dst):
            frames = write_frames(self.ep[qp.src], self.ep[qp.dst], sport=qp.sport, dqpn=qp.dqpn, psn=qp.psn,
                                  va=va, data=payload(), imm=imm, mtu=self.mtu, rkey=rkey)
        acks = self.wanted(qp.dst, qp.src)
        for k in range(npk):
            tk = t + k * spacing
            if frames is not None:
                self._add(tk, qp.src, qp.dst, frames[k])
            qp.since_ack += 1
            last = k == npk - 1
            if last:
                qp.msn = (qp.msn + 1) & MASK24
            if last or qp.since_ack >= ACK_EVERY:
                qp.since_ack = 0
                self.counts["acks"] += 1
                if acks:
                    self._add(tk + ACK_RTT_NS, qp.dst, qp.src, ack_frame(
                        self.ep[qp.dst], self.ep[qp.src], sport=qp.ack_sport, dqpn=qp.sqpn,
                        psn=(qp.psn + k) & MASK24, msn=qp.msn))
        qp.psn = (qp.psn + npk) & MASK24
        return npk

    def send(self, t: int, link: Link, values: np.ndarray, spacing: int = PKT_NS) -> int:
        """One NCCL send on ``link`` at time ``t``: flow-control post, then the data write. Returns packets."""
        link.steps += 1
        step = link.steps
        slot = (step - 1) % SLOTS
        va = link.base + slot * link.step_bytes
        size = ll_wire_bytes(values.nbytes) if link.proto == "ll" else values.nbytes

        def payload() -> bytes:  # built only when a mirror port sees the frames
            return ll_encode(values, step) if link.proto == "ll" else np.ascontiguousarray(values).tobytes()

        post = struct.pack("<QIIIIQ", va, link.rkey, link.step_bytes, 1, step & 0xFFFFFFFF, step)
        self._write(t - CTS_LEAD_NS, link.fifo, va=link.fifo_base + slot * FIFO_ENTRY, rkey=link.fifo_rkey,
                    size=FIFO_ENTRY, payload=lambda: post, imm=None)
        self.counts["flow_control"] += 1
        self.counts["ring_sends" if link.kind == "ring" else "p2p_sends"] += 1
        return self._write(t, link.data, va=va, rkey=link.rkey, size=size, payload=payload, imm=size, spacing=spacing)

    def drain(self) -> list[Frame]:
        """The frames produced since the last drain, in time order."""
        out = sorted(self.frames)  # (t_ns, seq) are unique: the bytes are never compared
        self.frames = []
        return out

    # ---- NCCL operations ----------------------------------------------------
    def allreduce(self, red: RingReduce) -> None:
        """Every ring send of one allreduce; all positions and channels step together."""
        p, n, c = red.params, red.params.nranks, red.params.nchannels
        plan = {(i, b): ring_sends(red.count, p, i, b) for i in range(n) for b in range(c)}
        t = self.now + CTS_LEAD_NS
        for k in range(max(len(v) for v in plan.values())):
            longest = 1
            for (i, b), sends in plan.items():
                if k < len(sends):
                    # a NIC interleaves its channels' packets
                    npk = self.send(t + b * PKT_NS, self.links[i, b], red.payload(i, sends[k]), spacing=PKT_NS * c)
                    longest = max(longest, npk)
            t += longest * PKT_NS * c + STEP_GAP_NS
        self.now = t

    def tail(self, red: RingReduce, kind: str, after: RingReduce | None = None) -> None:
        """One more step on every ring connection after allreduce ``red``: ``kind`` "resend" — each rank sends its
        successor again the final chunk it received last (all its pieces, Simple); "next" — the first send of
        allreduce ``after`` (a new allreduce of the same layout that the capture then cuts off)."""
        p, n, c = red.params, red.params.nranks, red.params.nchannels
        plan = {}
        for i in range(n):
            for b in range(c):
                if kind == "next":
                    plan[i, b] = [after.payload(i, ring_sends(after.count, p, i, b)[0])]
                    continue
                received = ring_sends(red.count, p, (i - 1) % n, b)  # what the predecessor sent this rank
                last = received[-1]
                plan[i, b] = [red.payload(i, s) for s in received
                              if s.final and s.loop == last.loop and s.chunk == last.chunk]
        t = self.now + CTS_LEAD_NS
        for k in range(max(len(v) for v in plan.values())):
            longest = 1
            for (i, b), values in plan.items():
                if k < len(values):
                    npk = self.send(t + b * PKT_NS, self.links[i, b], values[k], spacing=PKT_NS * c)
                    longest = max(longest, npk)
            t += longest * PKT_NS * c + STEP_GAP_NS
        self.now = t

    def broadcast(self, values: np.ndarray, *, root: int = 0, chunk: int = 8192, spread: bool = False) -> None:
        """A ring broadcast from ``root``, pipelined in chunks (chunk k on channel k % C when ``spread``)."""
        n, c = self.ring.nranks, self.ring.nchannels
        pieces = [values[i:i + chunk] for i in range(0, max(1, values.size), chunk)]
        slot = self._slot_ns(pieces[0]) + STEP_GAP_NS  # the first piece is the largest: no send overlaps the next
        waves = 0
        for k, piece in enumerate(pieces):
            channel, wave = (k % c, k // c) if spread else (0, k)
            waves = max(waves, wave)
            for hop in range(n - 1):
                t = self.now + CTS_LEAD_NS + (wave + hop) * slot + channel * PKT_NS
                self.send(t, self.links[(root + hop) % n, channel], piece, spacing=PKT_NS * c)
        self.now += CTS_LEAD_NS + (waves + n) * slot

    def _slot_ns(self, piece: np.ndarray) -> int:
        size = ll_wire_bytes(piece.nbytes) if self.ring.protocol == "ll" else piece.nbytes
        return max(1, -(-size // self.mtu)) * PKT_NS * self.ring.nchannels

    def p2p(self, src: int, dst: int, values: np.ndarray) -> None:
        """A pipeline-style send/recv: Simple protocol on its own connection (QPs and UDP ports)."""
        link = self.p2p_links.get((src, dst))
        if link is None:
            link = self.p2p_links[src, dst] = self._link("p2p", src, dst, 0, "simple", P2P_STEP_BYTES)
        t = self.now + CTS_LEAD_NS
        for i in range(0, max(1, values.size), P2P_STEP_BYTES // values.itemsize):
            piece = values[i:i + P2P_STEP_BYTES // values.itemsize]
            t += self.send(t, link, piece) * PKT_NS + STEP_GAP_NS
        self.now = t

    def management(self, src: int, dst: int) -> None:
        """A UD management datagram (SEND_ONLY to QP 1, 150 bytes): neither data nor control of the ring."""
        self.counts["ud"] += 1
        if src not in self._ud_sports:
            self._ud_sports[src] = self._sport()
        psn = int(self.rng.integers(0, 1 << 24))
        tid = int(self.rng.integers(0, 1 << 63))
        if self.wanted(src, dst):
            mad = struct.pack(">BBBBHHQ", 1, 7, 2, 0x01, 0, 0, tid) + bytes(48)  # a CM MAD header + body
            self._add(self.now, src, dst, ud_frame(self.ep[src], self.ep[dst], sport=self._ud_sports[src],
                                                   psn=psn, payload=mad))
        self.now += 2 * ACK_RTT_NS

    def idle(self, ns: int) -> None:
        """Compute time between communication phases."""
        self.now += ns
