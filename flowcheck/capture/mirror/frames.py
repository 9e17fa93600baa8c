"""RoCEv2 frame builder: what a mirror port sees of RDMA traffic, byte-exact, with a real ICRC.

Used by the network simulator and by tests.  Defaults reproduce ConnectX frames in the shared
captures: IPv6 traffic class 2, hop limit 64, UDP checksum 0, BTH MigReq set on RC packets,
AckReq on the last packet of a message.  An ACK of PSN p acknowledges the peer's request p.
"""
from __future__ import annotations

import functools
import ipaddress
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum

ROCE_PORT = 4791
_MASKED_LRH_CRC = zlib.crc32(b"\xff" * 8)  # RoCEv2 has no LRH; the ICRC covers 8 bytes of ones in its place


class Opcode(IntEnum):
    """BTH opcodes flowcheck parses (RC = 0x00-0x1f, UD = 0x60-0x7f, CNP = 0x81)."""

    SEND_FIRST = 0
    SEND_MIDDLE = 1
    SEND_LAST = 2
    SEND_LAST_IMM = 3
    SEND_ONLY = 4
    SEND_ONLY_IMM = 5
    WRITE_FIRST = 6
    WRITE_MIDDLE = 7
    WRITE_LAST = 8
    WRITE_LAST_IMM = 9
    WRITE_ONLY = 10
    WRITE_ONLY_IMM = 11
    READ_REQUEST = 12
    READ_RESPONSE_FIRST = 13
    READ_RESPONSE_MIDDLE = 14
    READ_RESPONSE_LAST = 15
    READ_RESPONSE_ONLY = 16
    ACK = 17
    UD_SEND_ONLY = 0x64
    UD_SEND_ONLY_IMM = 0x65
    CNP = 0x81


# Extension headers after the BTH, in wire order: D = DETH, R = RETH, A = AETH, I = ImmDt.
HEADERS: dict[int, str] = {
    Opcode.SEND_LAST_IMM: "I", Opcode.SEND_ONLY_IMM: "I",
    Opcode.WRITE_FIRST: "R", Opcode.WRITE_LAST_IMM: "I", Opcode.WRITE_ONLY: "R", Opcode.WRITE_ONLY_IMM: "RI",
    Opcode.READ_REQUEST: "R", Opcode.READ_RESPONSE_FIRST: "A", Opcode.READ_RESPONSE_LAST: "A",
    Opcode.READ_RESPONSE_ONLY: "A", Opcode.ACK: "A",
    Opcode.UD_SEND_ONLY: "D", Opcode.UD_SEND_ONLY_IMM: "DI",
}  # fmt: skip


@dataclass(frozen=True)
class Endpoint:
    """One side of a RoCE connection: MAC, IPv4 or IPv6 address, optional 802.1Q VLAN id."""

    mac: str
    ip: str
    vlan: int | None = None


def roce_frame(
    src: Endpoint, dst: Endpoint, *, sport: int, opcode: int, dqpn: int, psn: int, payload: bytes = b"",
    va: int | None = None, rkey: int = 0, dma_len: int | None = None, imm: int | None = None,
    ackreq: bool = False, aeth: int | None = None, hop_limit: int = 64, traffic_class: int = 2,
    pkey: int = 0xFFFF, se: bool = False, migreq: bool = True, deth: tuple[int, int] | None = None,
) -> bytes:
    """One RoCEv2 frame: Ethernet (+802.1Q) / IPv4 or IPv6 / UDP 4791 / BTH / ext headers / payload / pad / ICRC.

    Which extension headers appear follows the opcode (``HEADERS``): RETH needs ``va`` (its
    length defaults to the payload size), ImmDt needs ``imm`` (written little-endian: NCCL's
    immediate is a size), AETH takes ``aeth`` (default 0), DETH takes ``deth=(qkey, src_qpn)``.
    """
    pad = -len(payload) % 4
    bth = struct.pack(">BBHII", opcode, se << 7 | migreq << 6 | pad << 4, pkey, dqpn & 0xFFFFFF,
                      ackreq << 31 | psn & 0xFFFFFF)
    ext = _extension_headers(opcode, va, rkey, len(payload) if dma_len is None else dma_len, imm, aeth, deth)
    transport = bth + ext + payload + bytes(pad)
    udp = struct.pack(">HHHH", sport, ROCE_PORT, 8 + len(transport) + 4, 0)
    ip = _ip_header(src, dst, len(udp) + len(transport) + 4, hop_limit, traffic_class)
    packet = ip + udp + transport
    return _ethernet(src, dst, ip[0] >> 4) + packet + struct.pack("<I", icrc(packet))


def _extension_headers(opcode: int, va: int | None, rkey: int, dma_len: int, imm: int | None,
                       aeth: int | None, deth: tuple[int, int] | None) -> bytes:
    out = b""
    for h in HEADERS.get(opcode, ""):
        if h == "D":
            qkey, src_qpn = deth if deth is not None else (0x80010000, 1)
            out += struct.pack(">II", qkey, src_qpn & 0xFFFFFF)
        elif h == "R":
            if va is None:
                raise ValueError(f"opcode {opcode_name(opcode)} carries a RETH: pass va (and dma_len)")
            out += struct.pack(">QII", va, rkey, dma_len)
        elif h == "A":
            out += struct.pack(">I", aeth or 0)
        elif imm is None:
            raise ValueError(f"opcode {opcode_name(opcode)} carries immediate data: pass imm")
        else:
            out += struct.pack("<I", imm)
    return out


def opcode_name(opcode: int) -> str:
    """``WRITE_FIRST`` for a known opcode, ``0xaa`` for any other."""
    try:
        return Opcode(opcode).name
    except ValueError:
        return f"0x{opcode:02x}"


@functools.lru_cache(maxsize=4096)
def _packed(ip: str) -> bytes:
    """An IP address's wire bytes (cached: a simulator builds millions of frames between a few endpoints)."""
    return ipaddress.ip_address(ip).packed


def _ip_header(src: Endpoint, dst: Endpoint, payload_len: int, hop_limit: int, traffic_class: int) -> bytes:
    s, d = _packed(src.ip), _packed(dst.ip)
    if len(s) != len(d):
        raise ValueError(f"source {src.ip} and destination {dst.ip} are different IP versions")
    if len(s) == 16:
        return struct.pack(">IHBB", 6 << 28 | traffic_class << 20, payload_len, 17, hop_limit) + s + d
    header = bytearray(struct.pack(">BBHHHBBH", 0x45, traffic_class, 20 + payload_len, 0, 0x4000, hop_limit, 17, 0))
    header += s + d
    header[10:12] = struct.pack(">H", _ipv4_checksum(bytes(header)))
    return bytes(header)


def _ipv4_checksum(header: bytes) -> int:
    total = sum(struct.unpack(f">{len(header) // 2}H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


@functools.lru_cache(maxsize=4096)
def _mac(text: str) -> bytes:
    raw = bytes.fromhex(text.replace(":", "").replace("-", ""))
    if len(raw) != 6:
        raise ValueError(f"expected a MAC address like 0c:42:a1:9f:58:f8, got {text!r}")
    return raw


def _ethernet(src: Endpoint, dst: Endpoint, ip_version: int) -> bytes:
    vlan = src.vlan if src.vlan is not None else dst.vlan
    if src.vlan is not None and dst.vlan is not None and src.vlan != dst.vlan:
        raise ValueError(f"endpoints are on different VLANs ({src.vlan}, {dst.vlan})")
    header = _mac(dst.mac) + _mac(src.mac)
    if vlan is not None:
        header += struct.pack(">HH", 0x8100, vlan & 0x0FFF)
    return header + struct.pack(">H", 0x86DD if ip_version == 6 else 0x0800)


def icrc(packet: bytes) -> int:
    """RoCEv2 invariant CRC of ``packet`` = IP header .. end of pad (no Ethernet, no ICRC).

    CRC32 over 8 bytes of 0xFF (the masked LRH), the IP header with its variant fields set to
    ones (IPv4: TOS, TTL, checksum; IPv6: traffic class, flow label, hop limit), the UDP header
    with its checksum set to ones, the BTH with reserved byte 4 (FECN/BECN) set to ones, and the
    rest unchanged.  The frame carries it little-endian.
    """
    ip_len = 40 if packet[0] >> 4 == 6 else (packet[0] & 0x0F) * 4
    h = bytearray(packet[: ip_len + 20])  # IP + UDP + BTH: the only bytes with variant fields
    if ip_len == 40:
        h[0] |= 0x0F
        h[1:4] = b"\xff\xff\xff"
        h[7] = 0xFF
    else:
        h[1] = h[8] = 0xFF
        h[10:12] = b"\xff\xff"
    h[ip_len + 6 : ip_len + 8] = b"\xff\xff"
    h[ip_len + 8 + 4] = 0xFF
    return zlib.crc32(memoryview(packet)[ip_len + 20 :], zlib.crc32(h, _MASKED_LRH_CRC))


def write_frames(src: Endpoint, dst: Endpoint, *, sport: int, dqpn: int, psn: int, va: int, data: bytes,
                 imm: int | None, mtu: int, rkey: int = 0) -> list[bytes]:
    """One RDMA WRITE message as WRITE_ONLY(_IMM), or FIRST (RETH: total length) / MIDDLE* / LAST(_IMM).

    PSNs are consecutive from ``psn`` (24-bit wrap); a 0-byte write is a WRITE_ONLY(_IMM) with RETH length 0.
    """
    pieces = [data[i : i + mtu] for i in range(0, len(data), mtu)] or [b""]
    ops = _split(len(pieces), Opcode.WRITE_FIRST, imm is not None)
    frames = []
    for k, (op, piece) in enumerate(zip(ops, pieces)):
        reth = op in (Opcode.WRITE_FIRST, Opcode.WRITE_ONLY, Opcode.WRITE_ONLY_IMM)
        frames.append(roce_frame(
            src, dst, sport=sport, opcode=op, dqpn=dqpn, psn=(psn + k) & 0xFFFFFF, payload=piece,
            va=va if reth else None, rkey=rkey, dma_len=len(data), imm=imm, ackreq=k == len(pieces) - 1,
        ))
    return frames


def send_frames(src: Endpoint, dst: Endpoint, *, sport: int, dqpn: int, psn: int, data: bytes,
                imm: int | None, mtu: int) -> list[bytes]:
    """One RC SEND message as SEND_ONLY(_IMM) or FIRST / MIDDLE* / LAST(_IMM)."""
    pieces = [data[i : i + mtu] for i in range(0, len(data), mtu)] or [b""]
    ops = _split(len(pieces), Opcode.SEND_FIRST, imm is not None)
    return [
        roce_frame(src, dst, sport=sport, opcode=op, dqpn=dqpn, psn=(psn + k) & 0xFFFFFF, payload=piece,
                   imm=imm, ackreq=k == len(pieces) - 1)
        for k, (op, piece) in enumerate(zip(ops, pieces))
    ]


def _split(n: int, first: Opcode, with_imm: bool) -> list[Opcode]:
    """Opcodes of an n-packet message; ``first`` is SEND_FIRST or WRITE_FIRST (same +0..+5 pattern)."""
    if n == 1:
        return [Opcode(first + (5 if with_imm else 4))]
    return [first, *[Opcode(first + 1)] * (n - 2), Opcode(first + (3 if with_imm else 2))]


def ack_frame(src: Endpoint, dst: Endpoint, *, sport: int, dqpn: int, psn: int, msn: int = 0,
              syndrome: int = 0) -> bytes:
    """An RC ACK (AETH syndrome 0 = ACK with credit count 0) of the peer's request ``psn``."""
    return roce_frame(src, dst, sport=sport, opcode=Opcode.ACK, dqpn=dqpn, psn=psn,
                      aeth=(syndrome & 0xFF) << 24 | msn & 0xFFFFFF)


def ud_frame(src: Endpoint, dst: Endpoint, *, sport: int, psn: int = 0, payload: bytes = bytes(64),
             dqpn: int = 1, src_qpn: int = 1, qkey: int = 0x80010000, hop_limit: int = 255) -> bytes:
    """A UD SEND_ONLY (with DETH), by default a 150-byte management datagram to QP 1 as in the captures."""
    return roce_frame(src, dst, sport=sport, opcode=Opcode.UD_SEND_ONLY, dqpn=dqpn, psn=psn, payload=payload,
                      ackreq=True, migreq=False, hop_limit=hop_limit, deth=(qkey, src_qpn))
