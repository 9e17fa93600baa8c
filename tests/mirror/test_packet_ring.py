"""The PACKET_MMAP ring's block copy (``_mirror.ring_block``): frames of a TPACKET_V3 block come out byte for
byte, with stripped VLAN tags put back and frames this host sent skipped; a malformed block or a too small
output is a ValueError, never a read or write outside the buffers (fuzzed here, and under ASan in
tests/reliability/test_asan.py)."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowcheck import _mirror
from flowcheck.capture.mirror.packet_ring import RingConfig

HDR = 48  # tpacket3_hdr; the sockaddr_ll follows
MAC_AT = HDR + 32  # where this builder puts a frame (tp_mac), 16-aligned


def make_block(frames: list[bytes], *, tags: dict[int, int] | None = None, outgoing: set[int] = frozenset(),
               size: int = 1 << 16) -> bytearray:
    """A retired TPACKET_V3 block holding ``frames`` (``tags``: frame index -> VLAN TCI stripped into its header)."""
    block = bytearray(size)
    pos, hdrs = 48, []
    for k, f in enumerate(frames):
        hdrs.append(pos)
        vlan = (tags or {}).get(k)
        status = 1 | (0x10 if vlan is not None else 0)
        struct.pack_into("<IIIIIIHHIIHH", block, pos, 0, 1000 + k, 7 * k, len(f), len(f), status, MAC_AT, MAC_AT + 14,
                         0, vlan or 0, 0x8100 if vlan is not None else 0, 0)
        block[pos + HDR + 10] = 4 if k in outgoing else 0
        block[pos + MAC_AT:pos + MAC_AT + len(f)] = f
        pos += (MAC_AT + len(f) + 15) // 16 * 16
    for a, b in zip(hdrs, hdrs[1:]):
        struct.pack_into("<I", block, a, b - a)
    struct.pack_into("<IIIIII", block, 0, 3, 0, 1, len(frames), 48, pos)
    return block


def copy_block(block, rows: int = 4096, out_bytes: int = 1 << 17):
    out, offs = np.zeros(out_bytes, np.uint8), np.zeros(rows, np.int64)
    lens, ts = np.zeros(rows, np.int32), np.zeros(rows, np.int64)
    n, used = _mirror.ring_block(block, out, 0, offs, lens, ts, 0)
    return [bytes(out[o:o + l]) for o, l in zip(offs[:n], lens[:n])], ts[:n].tolist(), used


def test_block_frames_come_out_byte_identical_with_vlan_tags_back_and_outgoing_skipped():
    frames = [bytes([k]) * 12 + b"\x86\xdd" + bytes(range(k, k + 100)) for k in range(5)]
    got, ts, used = copy_block(make_block(frames, tags={1: 7}, outgoing={3}))
    tagged = frames[1][:12] + b"\x81\x00\x00\x07" + frames[1][12:]
    assert got == [frames[0], tagged, frames[2], frames[4]]
    assert ts == [1000 * 10**9, 1001 * 10**9 + 7, 1002 * 10**9 + 14, 1004 * 10**9 + 28]
    assert used == sum(map(len, got))


@pytest.mark.parametrize("edit,message", [
    (lambda b: struct.pack_into("<I", b, 16, 1 << 20), "outside the block"),  # first frame beyond the block
    (lambda b: struct.pack_into("<I", b, 48 + 12, 1 << 20), "outside the block"),  # snaplen beyond it
    (lambda b: struct.pack_into("<H", b, 48 + 24, 2), "outside the block"),  # data inside the header
    (lambda b: struct.pack_into("<I", b, 12, 1 << 30), "more frames than the rows"),
])
def test_a_malformed_block_is_a_value_error(edit, message):
    block = make_block([bytes(64)] * 3)
    edit(block)
    with pytest.raises(ValueError, match=message):
        copy_block(block)


def test_an_output_too_small_for_the_block_is_a_value_error():
    with pytest.raises(ValueError, match="too small"):
        copy_block(make_block([bytes(1000)] * 4), out_bytes=2500)


def test_ring_config_is_checked():
    with pytest.raises(ValueError, match="page size"):
        RingConfig(block_size=1000)
    with pytest.raises(ValueError, match="workers"):
        RingConfig(workers=0)


@settings(max_examples=300, deadline=None)
@given(flips=st.lists(st.tuples(st.integers(0, 1023), st.integers(0, 255)), min_size=1, max_size=8),
       rows=st.integers(0, 8), out_bytes=st.integers(0, 4096))
def test_fuzz_ring_blocks_only_raise_value_errors(flips, rows, out_bytes):
    block = make_block([bytes(range(60)), bytes(200), bytes(14)], tags={0: 5}, size=4096)
    for at, value in flips:
        block[at] = value
    try:
        copy_block(block, rows=rows, out_bytes=out_bytes)
    except ValueError:
        pass
