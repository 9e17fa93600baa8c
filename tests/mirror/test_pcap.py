"""Capture files: pcap and pcapng in both byte orders, several interfaces and time resolutions,
the real captures' frame counts and timestamps, and CaptureError (only) for anything broken."""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowcheck.capture.mirror.pcap import Frames, PcapWriter, read_capture
from flowcheck.errors import CaptureError

PCAPS = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "pcaps"
CAPTURES = ["rdma32", "iter_80000", "allreduce+p2p", "iter_40000_p2p_iter10_2"]
FRAMES = [bytes([k]) * (60 + k) for k in range(5)]


def real(name: str) -> Path:
    path = PCAPS / f"{name}.pcapng"
    if not path.exists():
        pytest.skip(f"shared captures not found at {PCAPS}")
    return path


# ---- pcapng written by hand, block by block

def block(kind: int, body: bytes, order: str = "<") -> bytes:
    body += bytes(-len(body) % 4)
    n = 12 + len(body)
    return struct.pack(order + "II", kind, n) + body + struct.pack(order + "I", n)


def option(code: int, value: bytes, order: str = "<") -> bytes:
    return struct.pack(order + "HH", code, len(value)) + value + bytes(-len(value) % 4)


def shb(order: str = "<") -> bytes:
    return block(0x0A0D0D0A, struct.pack(order + "IHHq", 0x1A2B3C4D, 1, 0, -1), order)


def idb(linktype: int = 1, tsresol: int | None = None, order: str = "<", snaplen: int = 0) -> bytes:
    opts = option(9, bytes([tsresol]), order) + option(0, b"", order) if tsresol is not None else b""
    return block(1, struct.pack(order + "HHI", linktype, 0, snaplen) + opts, order)


def epb(iface: int, ts: int, frame: bytes, order: str = "<") -> bytes:
    return block(6, struct.pack(order + "IIIII", iface, ts >> 32, ts & 0xFFFFFFFF, len(frame), len(frame)) + frame, order)


def test_pcapng_with_two_interfaces_of_different_resolution_and_every_packet_block(tmp_path):
    data = (shb() + idb(tsresol=9) + idb(tsresol=0x80 | 20)  # ns, and 2^-20 s
            + block(0x0BAD, b"unknown block: skipped")
            + epb(0, 1_700_000_000_123_456_789, FRAMES[0])
            + epb(1, 3 << 20 | 1 << 19, FRAMES[1])  # 3.5 s in 2^-20 units
            + block(3, struct.pack("<I", len(FRAMES[2])) + FRAMES[2])  # SPB: interface 0, no timestamp
            + block(2, struct.pack("<HHIII I", 1, 0, 0, 1 << 20, len(FRAMES[3]), len(FRAMES[3])) + FRAMES[3]))  # OPB
    (tmp_path / "two.pcapng").write_bytes(data)
    frames = read_capture(str(tmp_path / "two.pcapng"))
    assert [frames.frame(i) for i in range(len(frames))] == FRAMES[:4]
    assert list(frames.ts_ns) == [1_700_000_000_123_456_789, 3_500_000_000, -1, 1_000_000_000]


def test_pcapng_big_endian_section_and_a_second_section(tmp_path):
    big = shb(">") + idb(order=">") + epb(0, 5_000_001, FRAMES[0], ">")  # default resolution: microseconds
    little = shb() + idb(tsresol=3) + epb(0, 7, FRAMES[1])  # a new section restarts interface numbering
    (tmp_path / "be.pcapng").write_bytes(big + little)
    frames = read_capture(str(tmp_path / "be.pcapng"))
    assert [frames.frame(i) for i in range(2)] == FRAMES[:2]
    assert list(frames.ts_ns) == [5_000_001_000, 7_000_000]


@pytest.mark.parametrize("nanosecond", [True, False])
def test_pcap_writer_round_trip(tmp_path, nanosecond):
    path = str(tmp_path / "w.pcap")
    stamps = [1_700_000_000_000_000_000 + k * 1_234_567 for k in range(len(FRAMES))]
    with PcapWriter(path, nanosecond=nanosecond, snaplen=64) as w:
        for f, t in zip(FRAMES, stamps):
            w.write(f, t)
    frames = read_capture(path)
    assert [frames.frame(i) for i in range(len(frames))] == [f[:64] for f in FRAMES]
    want = stamps if nanosecond else [t // 1000 * 1000 for t in stamps]
    assert list(frames.ts_ns) == want


def test_big_endian_pcap(tmp_path):
    header = struct.pack(">IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1)
    record = struct.pack(">IIII", 12, 345678, len(FRAMES[0]), len(FRAMES[0])) + FRAMES[0]
    (tmp_path / "be.pcap").write_bytes(header + record)
    frames = read_capture(str(tmp_path / "be.pcap"))
    assert frames.frame(0) == FRAMES[0] and frames.ts_ns[0] == 12_345_678_000


def test_a_link_type_other_than_ethernet_is_refused_by_name(tmp_path):
    (tmp_path / "sll.pcapng").write_bytes(shb() + idb(linktype=113) + epb(0, 0, FRAMES[0]))
    with pytest.raises(CaptureError, match="link type 113"):
        read_capture(str(tmp_path / "sll.pcapng"))
    header = struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 101)
    (tmp_path / "raw.pcap").write_bytes(header + struct.pack("<IIII", 0, 0, 4, 4) + b"abcd")
    with pytest.raises(CaptureError, match="link type 101"):
        read_capture(str(tmp_path / "raw.pcap"))


@pytest.mark.parametrize("data, match", [
    (b"", "not a capture"),
    (b"GIF89a garbage", "unknown capture format"),
    (shb()[:20], "truncated pcapng"),
    (shb() + struct.pack("<III", 6, 1 << 30, 0), "block length"),  # claims 1 GiB: refused, never allocated
    (shb() + epb(0, 0, FRAMES[0]), "interface 0"),  # a packet before any interface
    (shb() + idb() + epb(0, 0, FRAMES[0])[:-1], "block"),
    (struct.pack("<IHHiIII", 0xA1B23C4D, 2, 4, 0, 0, 65535, 1) + struct.pack("<IIII", 0, 0, 999, 999) + b"x", "past the end"),
], ids=["empty", "garbage", "short-shb", "huge-block", "no-interface", "cut-trailer", "pcap-record-past-end"])  # fmt: skip
def test_broken_files_raise_capture_error(tmp_path, data, match):
    (tmp_path / "bad").write_bytes(data)
    with pytest.raises(CaptureError, match=match):
        read_capture(str(tmp_path / "bad"))


def test_missing_file_is_a_capture_error(tmp_path):
    with pytest.raises(CaptureError, match="cannot read"):
        read_capture(str(tmp_path / "nope.pcap"))


def test_every_truncation_of_a_real_capture_is_a_prefix_or_a_capture_error(tmp_path):
    data = real("rdma32").read_bytes()[:6000]
    whole = read_capture(str(real("rdma32")))
    path = tmp_path / "cut.pcapng"
    for cut in range(0, len(data), 7):
        path.write_bytes(data[:cut])
        try:
            frames = read_capture(str(path))
        except CaptureError:
            continue
        assert all(frames.frame(i) == whole.frame(i) for i in range(len(frames)))


@pytest.mark.parametrize("name", CAPTURES)
def test_real_captures_frame_counts_and_timestamps(name):
    truth = json.loads((PCAPS / f"{name}.json").read_text()) if (PCAPS / f"{name}.json").exists() else None
    frames = read_capture(str(real(name)))
    link = truth["link_layer"]
    assert len(frames) == link["packets_total"]
    assert frames.ts_ns[0] == link["first_ts_us"] * 1000 and frames.ts_ns[-1] == link["last_ts_us"] * 1000
    assert frames.lengths.min() > 0 and int(frames.offsets[-1] + frames.lengths[-1]) <= len(frames.buf)


def test_a_million_frame_pcap_indexes_in_well_under_a_second(tmp_path):
    n, size = 1_000_000, 64
    rec = np.zeros(n, dtype=[("sec", "<u4"), ("frac", "<u4"), ("cap", "<u4"), ("orig", "<u4"), ("data", "u1", size)])
    rec["sec"], rec["cap"], rec["orig"] = np.arange(n), size, size
    path = tmp_path / "big.pcap"
    path.write_bytes(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1) + rec.tobytes())
    start = time.perf_counter()
    frames = read_capture(str(path))
    elapsed = time.perf_counter() - start
    assert len(frames) == n and frames.ts_ns[-1] == (n - 1) * 1_000_000_000
    assert elapsed < 0.5, f"indexing took {elapsed:.2f} s"


def test_frames_from_list():
    frames = Frames.from_list(FRAMES, ts_ns=[5, 6, 7, 8, 9])
    assert len(frames) == 5 and frames.frame(3) == FRAMES[3] and frames.ts_ns[4] == 9
    assert len(Frames.from_list([])) == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=400), flips=st.lists(st.tuples(st.integers(0, 399), st.integers(0, 255)), max_size=8),
       base=st.sampled_from(["random", "pcap", "pcapng"]))
def test_fuzzed_files_raise_nothing_but_capture_error(tmp_path, data, flips, base):
    if base == "pcap":
        data = struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1) + struct.pack("<IIII", 0, 0, 60, 60) + FRAMES[0]
    elif base == "pcapng":
        data = shb() + idb(tsresol=9) + epb(0, 1, FRAMES[0]) + block(3, struct.pack("<I", 61) + FRAMES[1])
    raw = bytearray(data)
    for at, value in flips:
        if at < len(raw):
            raw[at] = value
    path = tmp_path / "fuzz"
    path.write_bytes(bytes(raw))
    try:
        frames = read_capture(str(path))
    except CaptureError:
        return
    assert all(0 <= o and o + n <= len(frames.buf) for o, n in zip(frames.offsets, frames.lengths))
