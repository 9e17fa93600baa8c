"""The RoCEv2 frame builder: frames parse back field for field, real frames rebuild byte for
byte (ICRC included), and tshark decodes built frames as InfiniBand without complaint."""
from __future__ import annotations

import ipaddress
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from flowcheck import _mirror
from flowcheck.capture.mirror import roce
from flowcheck.capture.mirror.frames import (
    Endpoint, Opcode, ack_frame, icrc, roce_frame, send_frames, ud_frame, write_frames,
)  # fmt: skip
from flowcheck.capture.mirror.pcap import Frames, PcapWriter, read_capture

PCAPS = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "pcaps"
CAPTURES = ["rdma32", "iter_80000", "allreduce+p2p", "iter_40000_p2p_iter10_2"]

A6 = Endpoint("0c:42:a1:9f:58:f8", "fe80::e42:a1ff:fe9f:58f8")
B6 = Endpoint("08:c0:eb:8c:28:2c", "fe80::ac0:ebff:fe8c:282c")
A4 = Endpoint("02:00:00:00:00:01", "10.0.0.1", vlan=7)
B4 = Endpoint("02:00:00:00:00:02", "10.0.0.2", vlan=7)


def capture(name: str):
    path = PCAPS / f"{name}.pcapng"
    if not path.exists():
        pytest.skip(f"shared captures not found at {PCAPS}")
    return read_capture(str(path))


def mac(a: np.ndarray) -> str:
    return ":".join(f"{b:02x}" for b in a)


def ip(a: np.ndarray, version: int) -> str:
    raw = a.tobytes()
    return str(ipaddress.ip_address(raw if version == 6 else raw[12:]))


def rebuild(frames: Frames, packets: roce.Packets, i: int) -> bytes:
    """Build frame i again from nothing but its parsed fields."""
    r = packets.table[i]
    vlan = int(r["vlan"]) if r["vlan"] >= 0 else None
    src = Endpoint(mac(r["src_mac"]), ip(r["src_ip"], r["ip_version"]), vlan)
    dst = Endpoint(mac(r["dst_mac"]), ip(r["dst_ip"], r["ip_version"]), vlan)
    start = int(r["payload_off"])
    return roce_frame(
        src, dst, sport=int(r["sport"]), opcode=int(r["opcode"]), dqpn=int(r["dqpn"]), psn=int(r["psn"]),
        payload=frames.buf[start : start + int(r["payload_len"])].tobytes(),
        va=int(r["va"]) if r["has_reth"] else None, rkey=int(r["rkey"]), dma_len=int(r["dma_len"]),
        imm=int(r["imm"]) if r["has_imm"] else None, aeth=int(r["aeth"]) if r["has_aeth"] else None,
        deth=(int(r["qkey"]), int(r["src_qpn"])) if r["has_deth"] else None, ackreq=bool(r["ackreq"]),
        hop_limit=int(r["hop_limit"]), traffic_class=int(r["traffic_class"]), pkey=int(r["pkey"]),
        se=bool(r["se"]), migreq=bool(r["migreq"]),
    )


def sample_frames() -> list[bytes]:
    """Every kind of frame the builder makes, over IPv6 and IPv4 + VLAN."""
    out = []
    for a, b in ((A6, B6), (A4, B4)):
        out += write_frames(a, b, sport=5000, dqpn=0x71D, psn=10, va=0x604000000, data=bytes(range(256)) * 10,
                            imm=2560, mtu=1024)  # FIRST, MIDDLE, LAST_IMM
        out += write_frames(a, b, sport=5000, dqpn=0x71D, psn=13, va=0x604000A00, data=b"\x01" * 1030,
                            imm=None, mtu=1024)  # FIRST, LAST (pad 2)
        out += write_frames(a, b, sport=5000, dqpn=0x71D, psn=15, va=0x0, data=b"", imm=16384, mtu=1024)
        out += write_frames(a, b, sport=5000, dqpn=0x71C, psn=0, va=0x602A00000, data=bytes(32), imm=None, mtu=1024)
        out += send_frames(a, b, sport=5000, dqpn=0x71D, psn=16, data=b"\x05" * 1500, imm=7, mtu=1024)
        out.append(ack_frame(b, a, sport=5000, dqpn=0x836, psn=17, msn=3))
        out.append(ud_frame(a, b, sport=6000))
    return out


def test_built_frames_parse_back_with_every_field_equal():
    frames = Frames.from_list(sample_frames())
    packets = roce.parse(frames)
    assert packets.status_counts["OK"] == len(frames)
    for i in range(len(frames)):
        assert rebuild(frames, packets, i) == frames.frame(i)
    t = packets.table
    assert list(t["opcode"][:4]) == [Opcode.WRITE_FIRST, Opcode.WRITE_MIDDLE, Opcode.WRITE_LAST_IMM, Opcode.WRITE_FIRST]
    assert list(t["psn"][:3]) == [10, 11, 12] and list(t["dma_len"][:1]) == [2560] and t["imm"][2] == 2560
    assert list(t["payload_len"][:3]) == [1024, 1024, 512] and t["pad"][4] == 2 and t["payload_len"][4] == 6
    half = len(frames) // 2
    assert set(t["ip_version"][:half]) == {6} and set(t["ip_version"][half:]) == {4}
    assert set(t["vlan"][:half]) == {-1} and set(t["vlan"][half:]) == {7}
    assert ip(t["src_ip"][half], 4) == "10.0.0.1" and t["hop_limit"][half] == 64


def test_write_frames_splits_by_mtu_with_consecutive_wrapping_psns():
    frames = write_frames(A6, B6, sport=1, dqpn=2, psn=0xFFFFFE, va=0x1000, data=bytes(3000), imm=3000, mtu=1024)
    t = roce.parse(Frames.from_list(frames)).table
    assert list(t["opcode"]) == [Opcode.WRITE_FIRST, Opcode.WRITE_MIDDLE, Opcode.WRITE_LAST_IMM]
    assert list(t["psn"]) == [0xFFFFFE, 0xFFFFFF, 0]
    assert list(t["payload_len"]) == [1024, 1024, 952] and t["dma_len"][0] == 3000
    assert list(t["ackreq"]) == [False, False, True]
    only = roce.parse(Frames.from_list(write_frames(A6, B6, sport=1, dqpn=2, psn=5, va=0, data=b"", imm=64,
                                                    mtu=1024))).table
    assert list(only["opcode"]) == [Opcode.WRITE_ONLY_IMM] and only["dma_len"][0] == 0 and only["imm"][0] == 64


def test_builder_refuses_missing_header_fields():
    with pytest.raises(ValueError, match="RETH"):
        roce_frame(A6, B6, sport=1, opcode=Opcode.WRITE_ONLY, dqpn=1, psn=0)
    with pytest.raises(ValueError, match="imm"):
        roce_frame(A6, B6, sport=1, opcode=Opcode.WRITE_LAST_IMM, dqpn=1, psn=0)
    with pytest.raises(ValueError, match="IP versions"):
        roce_frame(A6, B4, sport=1, opcode=Opcode.ACK, dqpn=1, psn=0)


@pytest.mark.parametrize("name", CAPTURES)
def test_real_roce_frames_rebuild_byte_for_byte(name):
    frames = capture(name)
    packets = roce.parse(frames)
    ok = np.flatnonzero(packets["status"] == roce.Status.OK)
    assert len(ok) > 0
    for i in ok:
        assert rebuild(frames, packets, int(i)) == frames.frame(int(i)), f"frame {i}"


@pytest.mark.parametrize("name", CAPTURES)
def test_python_and_native_icrc_agree_and_match_every_genuine_frame(name):
    frames = capture(name)
    packets = roce.parse(frames)
    for i in np.flatnonzero(packets["bth_offset"] > 0):
        f = frames.frame(int(i))
        l3 = 18 if f[12:14] == b"\x81\x00" else 14
        ours = icrc(f[l3:-4])
        assert ours == _mirror.frame_icrc(f)
        genuine = packets["status"][i] == roce.Status.OK
        assert (ours == int.from_bytes(f[-4:], "little")) == genuine


@pytest.mark.parametrize("ends", [(A4, B4), (A6, B6)], ids=["ipv4", "ipv6"])
def test_native_icrc_folds_the_header_with_any_payload_length(ends):
    """The native ICRC folds the masked header with the payload's first bytes when there are enough of them and
    takes the tables otherwise: every length on both sides of that edge, with and without extension headers."""
    src, dst = ends
    built = []
    for n in range(0, 321, 4):
        data = bytes((k * 7 + n) & 0xFF for k in range(n))
        built.append(roce_frame(src, dst, sport=7, opcode=Opcode.WRITE_ONLY, dqpn=5, psn=n, payload=data, va=64))
        built.append(roce_frame(src, dst, sport=7, opcode=Opcode.WRITE_MIDDLE, dqpn=5, psn=n, payload=data))
        built.append(roce_frame(src, dst, sport=7, opcode=Opcode.WRITE_LAST_IMM, dqpn=5, psn=n, payload=data, imm=n))
    built.append(roce_frame(src, dst, sport=7, opcode=Opcode.ACK, dqpn=5, psn=1))
    l3 = 18 if src.vlan is not None else 14
    for f in built:
        assert _mirror.frame_icrc(f) == icrc(f[l3:-4]) == int.from_bytes(f[-4:], "little")
    assert (roce.parse(Frames.from_list(built))["status"] == roce.Status.OK).all()


def test_icrc_ignores_variant_fields():
    frame = bytearray(write_frames(A4, B4, sport=9, dqpn=3, psn=1, va=0, data=b"abcd", imm=None, mtu=64)[0])
    frame[18 + 8] = 3  # TTL, a variant field: a router may change it, the ICRC must not
    frame[18 + 10 : 18 + 12] = b"\x12\x34"  # header checksum
    assert roce.parse(Frames.from_list([bytes(frame)]))["status"][0] == roce.Status.OK
    frame[-5] ^= 1  # payload: invariant
    assert roce.parse(Frames.from_list([bytes(frame)]))["status"][0] == roce.Status.BAD_ICRC


TSHARK_FIELDS = ["_ws.malformed", "_ws.expert.message", "infiniband.bth.opcode", "infiniband.bth.destqp",
                 "infiniband.bth.psn", "vlan.id", "udp.dstport"]


@pytest.mark.skipif(shutil.which("tshark") is None, reason="tshark not on PATH (apt-get install tshark)")
def test_tshark_decodes_built_frames_as_infiniband_without_errors(tmp_path):
    built = sample_frames()
    path = str(tmp_path / "built.pcap")
    with PcapWriter(path) as w:
        for k, f in enumerate(built):
            w.write(f, 1_700_000_000_000_000_000 + k * 1000)
    # IPv6 RoCE carries UDP checksum 0 as ConnectX NICs do; eth_over_ib guesses Ethernet in payloads
    cmd = ["tshark", "-r", path, "-o", "udp.ignore_ipv6_zero_checksum:TRUE", "--disable-heuristic", "eth_over_ib",
           "-T", "fields", "-E", "separator=|"] + [a for f in TSHARK_FIELDS for a in ("-e", f)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = [line.split("|") for line in res.stdout.splitlines()]
    parsed = roce.parse(Frames.from_list(built)).table
    assert len(rows) == len(built)
    for row, want in zip(rows, parsed):
        malformed, expert, opcode, destqp, psn, vlan, dport = row
        assert malformed == "" and expert == "", row
        assert (int(opcode, 0), int(destqp, 0), int(psn, 0), int(dport)) == (want["opcode"], want["dqpn"], want["psn"], 4791)
        assert vlan == ("" if want["vlan"] < 0 else str(want["vlan"]))
