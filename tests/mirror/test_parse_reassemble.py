"""``roce.parse_reassemble`` (each parse thread demultiplexes its own run of frames; the runs are joined in capture
order) gives exactly what ``parse`` then ``reassemble`` give: the packet table, the counts and every reassembly table,
for any split of the frames into runs: on the real captures, on built traffic with loss, reordering,
duplication, PSN wraps at every seam, several streams interleaved, and on fuzzed mixes."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowcheck import _mirror
from flowcheck.capture.mirror import roce
from flowcheck.capture.mirror.frames import Endpoint, ack_frame, send_frames, ud_frame, write_frames
from flowcheck.capture.mirror.pcap import Frames, read_capture

from .test_roce import CAPTURES, PCAPS, ll_lines

A = Endpoint("0c:42:a1:9f:58:f8", "fe80::e42:a1ff:fe9f:58f8")
B = Endpoint("08:c0:eb:8c:28:2c", "fe80::ac0:ebff:fe8c:282c")
C4, D4 = Endpoint("02:00:00:00:00:01", "10.0.0.1", vlan=5), Endpoint("02:00:00:00:00:02", "10.0.0.2")
TABLES = ("streams", "messages", "segments", "missing", "gaps", "stream_of", "message_of")


def assert_same(frames: Frames, ranges: int, workers: int = 1, pmtu: int = 0) -> None:
    """The fused call on ``ranges`` runs (and ``workers`` reassembly threads) == parse, then reassemble (the table
    byte for byte, the reassembly's rows field by field)."""
    packets = roce.parse(frames)
    want = roce.reassemble(frames, packets, pmtu=pmtu or None)
    table, offsets, lengths = roce._frame_columns(frames)  # noqa: SLF001 - the native call, to choose the runs
    counts, got = _mirror.parse_reassemble(frames.buf, offsets, lengths, table, True, pmtu, ranges, workers)
    assert table.tobytes() == packets.table.tobytes()
    fused = roce._packets(table, counts)  # noqa: SLF001
    assert (fused.status_counts, fused.opcode_counts) == (packets.status_counts, packets.opcode_counts)
    got = roce._reassembly(got, table)  # noqa: SLF001
    for name in TABLES:  # field by field: the native rows' padding bytes are not part of them
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and len(a) == len(b) and np.array_equal(a, b), (name, ranges, workers)


def write(psn: int, n_bytes: int, *, dqpn: int = 0x71D, src: Endpoint = A, dst: Endpoint = B, imm: int | None = None,
          mtu: int = 1024) -> list[bytes]:
    return write_frames(src, dst, sport=4000, dqpn=dqpn, psn=psn, va=0x604000000, data=ll_lines(n_bytes, psn % 7 + 1, psn),
                        imm=imm, mtu=mtu)


@pytest.mark.parametrize("name", CAPTURES)
def test_the_real_captures_on_any_number_of_runs(name):
    path = PCAPS / f"{name}.pcapng"
    if not path.exists():
        pytest.skip(f"shared captures not found at {PCAPS}")
    frames = read_capture(str(path))
    for ranges, workers in ((1, 1), (2, 1), (2, 2), (3, 4), (16, 2)):
        assert_same(frames, ranges, workers)


def test_a_psn_wrap_at_every_seam():
    """One run per frame: every frame boundary is a seam, the wrap from 0xFFFFFF to 0 among them, on two streams."""
    wire = write(0xFFFFFC, 6000) + write(0xFFFFFC, 3000, dqpn=0x71C) + write(3, 100)
    frames = Frames.from_list(wire)
    assert_same(frames, len(wire))
    assert_same(frames, len(wire) + 5)  # more runs than frames: the empty ones join as nothing
    for ranges in range(1, 6):
        assert_same(frames, ranges)


def test_loss_reordering_duplicates_and_other_kinds_across_seams():
    wire = write(0, 4512, imm=4512) + write(5, 512) + write(7, 3000, src=C4, dst=D4)
    wire += send_frames(C4, D4, sport=4000, dqpn=0x71D, psn=10, data=bytes(2500), imm=9, mtu=1024)
    wire += [ack_frame(C4, D4, sport=4000, dqpn=0x71D, psn=7), ud_frame(A, B, sport=9), b"\x00" * 40]
    wire[2], wire[3] = wire[3], wire[2]  # reordered
    wire.insert(6, wire[1])  # a duplicate, in the next run for most splits
    del wire[9]  # a loss
    frames = Frames.from_list(wire)
    for ranges in range(1, len(wire) + 2):
        assert_same(frames, ranges, workers=1 + ranges % 3)
    assert_same(frames, 4, pmtu=1024)


def test_an_empty_capture():
    assert_same(Frames.from_list([]), 1)
    assert_same(Frames.from_list([]), 3)
    packets, r = roce.parse_reassemble(Frames.from_list([]), workers=2)
    assert len(packets) == 0 and len(r.streams) == 0 and len(r.messages) == 0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranges=st.integers(1, 12), workers=st.integers(1, 3))
def test_fuzzed_interleavings_of_lossy_streams(seed, ranges, workers):
    """A few streams (some starting just before a PSN wrap) of writes and sends, interleaved at random, with random
    losses, duplicates and swaps, split into random runs."""
    rnd = random.Random(seed)
    streams = []
    for s in range(rnd.randint(1, 4)):
        psn = rnd.choice([0, 0xFFFFF0 + rnd.randint(0, 15), rnd.randint(0, 2**24 - 1)])
        frames = []
        for _ in range(rnd.randint(1, 4)):
            size = rnd.choice([0, 64, 1000, 1024, 3000, 5000])
            if rnd.random() < 0.7:
                src, dst = rnd.choice([(A, B), (B, A), (C4, D4)])
                frames += write(psn, size, dqpn=0x700 + s, src=src, dst=dst)
            else:
                frames += send_frames(A, B, sport=4000, dqpn=0x700 + s, psn=psn, data=bytes(size), imm=None, mtu=1024)
            psn = (psn + max(1, -(-size // 1024))) % 2**24
        streams.append(frames)
    wire = []
    while any(streams):
        pick = rnd.choice([f for f in streams if f])
        wire.append(pick.pop(0))
    for _ in range(rnd.randint(0, 3)):
        if not wire:
            break
        i = rnd.randrange(len(wire))
        op = rnd.random()
        if op < 0.33:
            del wire[i]
        elif op < 0.66:
            wire.insert(rnd.randrange(len(wire) + 1), wire[i])
        else:
            j = rnd.randrange(len(wire))
            wire[i], wire[j] = wire[j], wire[i]
    assert_same(Frames.from_list(wire), ranges, workers)


def test_workers_split_the_frames_into_as_many_runs(monkeypatch):
    """Past PARALLEL_MIN_FRAMES per worker the frames are parsed (and demultiplexed) in as many runs as workers
    (decode calls it so: tests/mirror/test_streaming.py decodes on 1, 2 and 4 workers to identical reports)."""
    calls = []
    native = _mirror.parse_reassemble

    def spy(*args):
        calls.append(args[6])
        return native(*args)

    monkeypatch.setattr(roce._mirror, "parse_reassemble", spy)  # noqa: SLF001
    monkeypatch.setattr(roce, "PARALLEL_MIN_FRAMES", 4)
    wire = write(0, 20000) + write(20, 20000, dqpn=0x71C)
    packets, r = roce.parse_reassemble(Frames.from_list(wire), workers=3)
    assert calls == [3] and int(np.count_nonzero(r.messages["complete"])) == 2 and len(packets) == len(wire)
