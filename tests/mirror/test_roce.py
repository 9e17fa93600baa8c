"""RoCEv2 parse and reassembly: the real captures' ground truth, loss / reorder / duplication /
PSN wrap on built traffic, NCCL LL unpacking, and fuzzed frames that must never crash."""
from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowcheck.capture.mirror import roce
from flowcheck.capture.mirror.frames import Endpoint, Opcode, ack_frame, icrc, roce_frame, send_frames, ud_frame, write_frames
from flowcheck.capture.mirror.pcap import Frames, read_capture
from flowcheck.capture.mirror.roce import MessageFlag, Status

PCAPS = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "pcaps"
CAPTURES = ["rdma32", "iter_80000", "allreduce+p2p", "iter_40000_p2p_iter10_2"]
JSON_OPCODES = {"WRITE_F": "WRITE_FIRST", "WRITE_M": "WRITE_MIDDLE", "WRITE_L": "WRITE_LAST",
                "WRITE_L_IMM": "WRITE_LAST_IMM"}  # the ground-truth files abbreviate these

A = Endpoint("0c:42:a1:9f:58:f8", "fe80::e42:a1ff:fe9f:58f8")
B = Endpoint("08:c0:eb:8c:28:2c", "fe80::ac0:ebff:fe8c:282c")


def load(name: str) -> tuple[Frames, dict]:
    path = PCAPS / f"{name}.pcapng"
    if not path.exists():
        pytest.skip(f"shared captures not found at {PCAPS}")
    return read_capture(str(path)), json.loads((PCAPS / f"{name}.json").read_text())


def decode(frames: Frames) -> tuple[roce.Packets, roce.Reassembly]:
    packets = roce.parse(frames)
    return packets, roce.reassemble(frames, packets)


def ll_lines(n_bytes: int, flag: int, seed: int = 0) -> bytes:
    """An LL payload: {data0, flag, data1, flag} lines carrying n_bytes / 2 bytes of data."""
    words = np.random.default_rng(seed).integers(0, 2**32, n_bytes // 4, dtype=np.uint32)
    words[1::2] = flag
    return words.tobytes()


def ll_data(lines: bytes) -> bytes:
    w = np.frombuffer(lines, dtype=np.uint32)
    return w.reshape(-1, 2)[:, 0].tobytes()


def unpack_ll(frames: Frames, r: roce.Reassembly, m: int) -> tuple[roce.Unpacked, np.ndarray]:
    seg = r.segments_of(m)
    size = int(r.messages[m]["dma_len"]) if r.messages[m]["dma_len"] >= 0 else int((seg["msg_offset"] + seg["length"]).max())
    out = np.zeros(size // 2, dtype=np.uint8)
    return roce.ll_unpack(frames, seg, out), out


# ---------------------------------------------------------------- real captures

@pytest.mark.parametrize("name", CAPTURES)
def test_packet_counts_opcodes_icrc_and_ip_versions_equal_the_ground_truth(name):
    frames, truth = load(name)
    packets = roce.parse(frames)
    want = truth["link_layer"]["roce"]
    roce_rows = packets["status"] != Status.NOT_ROCE
    assert int(roce_rows.sum()) == want["packets"]
    assert packets.status_counts["OK"] == want["icrc_valid"] and packets.status_counts["MALFORMED"] == 0
    assert packets.status_counts["BAD_ICRC"] == want["icrc_invalid"]
    assert packets.opcode_counts == {JSON_OPCODES.get(k, k): v for k, v in want["opcodes"].items()}
    assert sorted(set(packets["ip_version"][roce_rows])) == want["ip_versions"]
    assert set(packets["bth_offset"][roce_rows]) == set(want["bth_offset"])


@pytest.mark.parametrize("name", CAPTURES)
def test_the_parse_reads_every_segments_ll_flag_as_a_second_pass_over_the_capture_would(name):
    frames, _ = load(name)
    packets, r = decode(frames)
    flags = _parsed_flags(packets, r.segments)
    assert len(flags) == len(r.segments) and (flags >= 0).any()
    assert np.array_equal(flags, roce.segment_flags(np.frombuffer(frames.buf, np.uint8), r.segments))
    _assert_message_ll_summary(r, flags)


def _parsed_flags(packets: roce.Packets, segments: np.ndarray) -> np.ndarray:
    """Each segment's LL flag as the parse read it (``ll_flag`` of the packet whose payload the segment is)."""
    return packets.table["ll_flag"][segments["frame"]]


def _assert_message_ll_summary(r: roce.Reassembly, seg_flags: np.ndarray) -> None:
    """The reassembler's per-message ll_flag / ll_uniform equal what its segments' flags say."""
    for mid, msg in enumerate(r.messages):
        f = seg_flags[msg["seg_start"]:msg["seg_start"] + msg["n_segs"]]
        flagged = f[f >= 0]
        assert msg["ll_flag"] == (flagged[0] if len(flagged) else -1), mid
        changes = (f[:-1] >= 0) & (f[1:] >= 0) & (f[:-1] != f[1:])
        assert bool(msg["ll_uniform"]) == (not changes.any()), mid


def test_rdma32_forged_packets_are_bad_icrc_and_reach_no_stream():
    frames, truth = load("rdma32")
    packets, r = decode(frames)
    forged = np.flatnonzero(packets["status"] == Status.BAD_ICRC)
    assert list(forged) == truth["anomalies"][0]["pkts"]  # the json numbers frames from 0
    assert set(packets["opcode"][forged]) == {0xAA} and set(packets["dqpn"][forged]) == {0xBBBBBB}
    assert (r.stream_of[forged] == -1).all() and 0xBBBBBB not in set(r.streams["dqpn"])


@pytest.mark.parametrize("name", CAPTURES)
def test_streams_match_flows_detail(name):
    frames, truth = load(name)
    packets, r = decode(frames)
    for flow in truth["flows_detail"]:
        s = r.find_stream(flow["src_ip"], flow["dst_ip"], int(flow["dest_qpn"], 16))
        if flow["dest_qpn"] == "0xbbbbbb":
            assert s is None
            continue
        row = r.streams[s]
        label = f"{name} {flow['dest_qpn']}"
        assert (int(row["first_frame"]), int(row["last_frame"])) == (flow["first_pkt"], flow["last_pkt"]), label
        assert int(row["sport"]) in flow["udp_sport"], label
        got = {roce.opcode_name(op): int(n) for op, n in enumerate(r.opcode_counts[s]) if n}
        assert got == {JSON_OPCODES.get(k, k): v for k, v in flow["opcodes"].items()}, label
        if "write_psn_range" in flow:
            assert [int(row["psn_first"]), int(row["psn_last"])] == flow["write_psn_range"], label
            assert [list(g) for g in r.gaps_of(s, roce.GAP_HOLE)] == flow["write_psn_missing_ranges"], label
            assert int(row["n_duplicates"]) == flow["write_psn_duplicates"], label


@pytest.mark.parametrize("name", CAPTURES)
def test_control_streams_are_recognisable(name):
    frames, truth = load(name)
    _, r = decode(frames)
    names = [r.stream_name(s) for s in range(len(r.streams))]
    for flow in truth["flows"]:
        if not flow["role"].startswith("CTS"):
            continue
        s = names.index(flow["flow"])
        msgs = r.messages[r.messages_of(s)]
        assert len(msgs) == flow["count"] and (msgs["dma_len"] == 32).all() and not msgs["has_imm"].any()
        assert r.streams[s]["n_acks"] > 0 and r.streams[s]["n_writes"] == flow["count"]
    for s in np.flatnonzero(r.streams["dqpn"] == 1):
        assert r.streams[s]["n_ud"] == r.streams[s]["n_packets"] and r.streams[s]["n_messages"] == 0


@pytest.mark.parametrize("name", CAPTURES)
def test_ll_messages_unpack_with_the_ground_truth_flags(name):
    frames, truth = load(name)
    _, r = decode(frames)
    names = [r.stream_name(s) for s in range(len(r.streams))]
    for flow in truth["flows"]:
        if not flow.get("flags"):
            continue
        flags = set()
        for m in r.messages_of(names.index(flow["flow"])):
            if r.messages[m]["bytes_seen"] == 0:
                continue  # an empty step (0-byte write with the size as immediate)
            result, _ = unpack_ll(frames, r, m)
            assert result.bad_lines == 0, (flow["flow"], m)
            flags.add(result.flag)
        # an empty send (0-byte write) uses a step but carries no line, so its flag is not on the wire
        assert flags <= set(flow["flags"]) and len(flags) == flow["sends"]["LL"], flow["flow"]


def test_iter_80000_loss_is_reported_exactly():
    frames, truth = load("iter_80000")
    _, r = decode(frames)
    lossy = r.find_stream("fe80::ac0:ebff:fe8c:282d", "fe80::e42:a1ff:fe9f:58f8", 0xC99)
    assert r.gaps_of(lossy, roce.GAP_HOLE) == [(62, 77)]  # 15 PSNs lost by the mirror
    assert r.gaps_of(lossy, roce.GAP_TAIL) == [(78, 80)]  # the capture ended before the LAST
    incomplete = np.flatnonzero(~r.messages["complete"])
    assert len(incomplete) == 2
    by_stream = {r.stream_name(int(r.messages[m]["stream"])): int(m) for m in incomplete}
    for anomaly in truth["anomalies"][1:]:
        m = by_stream[anomaly["flow"]]
        assert r.messages[m]["dma_len"] == anomaly["bytes_expected"] and r.messages[m]["bytes_seen"] == anomaly["bytes_seen"]
        assert r.messages[m]["flags"] & MessageFlag.END_INFERRED
    # the json's missing element ranges, as LL wire bytes (8 per element) inside each final message
    assert r.missing_of(by_stream["08:c0:eb:8c:28:2d->0c:42:a1:9f:58:f8 qpn=0xc99"]) == [(21504, 36864), (37888, 39040)]
    assert r.missing_of(by_stream["0c:42:a1:9f:58:f8->08:c0:eb:8c:28:2d qpn=0x514"]) == [(28672, 40960)]
    partial = np.load(PCAPS / "iter_80000.iter01.PARTIAL_nan_missing.npy")
    result, out = unpack_ll(frames, r, by_stream["08:c0:eb:8c:28:2d->0c:42:a1:9f:58:f8 qpn=0xc99"])
    assert result.flag == 3 and result.bad_lines == 0
    got, want = out.view(np.float32), partial[5120:]
    seen = ~np.isnan(want)
    assert int(seen.sum()) == 2816 and np.array_equal(got[seen], want[seen])


def test_allreduce_p2p_final_ll_chunk_and_simple_p2p_copy_equal_the_reference():
    frames, _ = load("allreduce+p2p")
    _, r = decode(frames)
    final = np.load(PCAPS / "allreduce+p2p.all_iters.npy")[0]
    ring = r.find_stream("fe80::e42:a1ff:fe9f:58f8", "fe80::ac0:ebff:fe8c:282c", 0x836)
    step2 = [m for m in r.messages_of(ring) if unpack_ll(frames, r, m)[0].flag == 2]
    assert len(step2) == 1
    assert np.array_equal(unpack_ll(frames, r, step2[0])[1].view(np.int32), final[:2048])
    p2p = r.find_stream("fe80::e42:a1ff:fe9f:58f8", "fe80::ac0:ebff:fe8c:282d", 0x366)
    (m,) = r.messages_of(p2p)
    assert r.messages[m]["complete"] and r.messages[m]["dma_len"] == 4096 * 4
    out = np.zeros(4096, dtype=np.int32)
    assert roce.simple_copy(frames, r.segments_of(m), out) == 4096 * 4
    assert np.array_equal(out, final[:4096])


# ---------------------------------------------------------------- built traffic

def write(psn: int, n_bytes: int, *, flag: int = 1, imm: int | None = None, va: int = 0x604000000,
          dqpn: int = 0x71D, src: Endpoint = A, dst: Endpoint = B, mtu: int = 1024) -> list[bytes]:
    return write_frames(src, dst, sport=4000, dqpn=dqpn, psn=psn, va=va, data=ll_lines(n_bytes, flag, psn),
                        imm=imm, mtu=mtu)


def test_reordered_and_duplicated_packets_reassemble_completely():
    first, second = write(0, 4512, flag=1, imm=4512), write(5, 512, flag=2)
    wire = first + second
    random.Random(7).shuffle(wire)
    wire += [first[1], second[0], first[1]]  # mirrors duplicate
    frames = Frames.from_list(wire)
    _, r = decode(frames)
    assert len(r.streams) == 1 and r.streams[0]["n_duplicates"] == 3 and r.streams[0]["n_requests"] == 6
    assert list(r.messages["complete"]) == [True, True] and list(r.messages["first_psn"]) == [0, 5]
    assert list(r.messages["dma_len"]) == [4512, 512] and r.messages[0]["imm"] == 4512 and not r.messages[1]["has_imm"]
    assert len(r.gaps) == 0 and len(r.missing) == 0
    for m, (flag, psn, size) in enumerate([(1, 0, 4512), (2, 5, 512)]):
        result, out = unpack_ll(frames, r, m)
        assert result == (flag, size // 16, 0)
        assert out.tobytes() == ll_data(ll_lines(size, flag, psn))


def test_lost_middle_leaves_an_exact_byte_hole():
    wire = write(100, 4500)
    del wire[2]  # PSN 102 carries bytes [2048, 3072)
    _, r = decode(Frames.from_list(wire))
    (m,) = r.messages
    assert not m["complete"] and m["n_packets"] == 4 and m["n_expected"] == 5 and m["va"] == 0x604000000
    assert r.missing_of(0) == [(2048, 3072)] and r.gaps_of(0) == [(102, 103)]
    assert list(r.segments_of(0)["msg_offset"]) == [0, 1024, 3072, 4096]


def test_lost_first_starts_the_message_after_the_previous_one():
    wire = write(0, 1024, flag=1) + write(1, 3000, flag=2)
    del wire[1]  # the FIRST (with the RETH) of the second message
    frames = Frames.from_list(wire)
    _, r = decode(frames)
    done, lost = r.messages
    assert done["complete"] and not lost["complete"]
    assert lost["flags"] & MessageFlag.START_INFERRED and lost["first_psn"] == 1 and lost["va"] == -1
    assert lost["dma_len"] == -1 and lost["first_opcode"] == Opcode.WRITE_MIDDLE
    assert r.missing_of(1) == [(0, 1024)] and r.gaps_of(0) == [(1, 2)]
    assert list(r.segments_of(1)["msg_offset"]) == [1024, 2048]
    assert unpack_ll(frames, r, 1)[0].flag == 2


@pytest.mark.parametrize("at_end", [False, True])
def test_lost_last_ends_the_message_where_its_length_says(at_end):
    wire = write(0, 3000, flag=1, imm=3000) + ([] if at_end else write(3, 64, flag=2))
    del wire[2]  # LAST_IMM: bytes [2048, 3000)
    _, r = decode(Frames.from_list(wire))
    m = r.messages[0]
    assert not m["complete"] and m["flags"] & MessageFlag.END_INFERRED and m["last_psn"] == 2
    assert not m["has_imm"] and r.missing_of(0) == [(2048, 3000)]
    assert r.gaps_of(0, roce.GAP_TAIL if at_end else roce.GAP_HOLE) == [(2, 3)]
    if not at_end:
        assert r.messages[1]["complete"] and r.messages[1]["first_psn"] == 3


def test_capture_starting_mid_message_and_ending_without_a_length():
    wire = write(0, 3000) + write(3, 5000)
    frames = Frames.from_list(wire[1:3] + wire[3:5])  # starts at a MIDDLE; the second write loses its tail
    _, r = decode(frames)
    head, tail = r.messages
    assert head["flags"] & MessageFlag.START_UNKNOWN and head["n_expected"] == -1 and not head["complete"]
    assert list(r.segments_of(0)["msg_offset"]) == [0, 1024]  # counted from the first packet seen
    assert tail["dma_len"] == 5000 and tail["flags"] & MessageFlag.END_INFERRED
    assert r.missing_of(1) == [(2048, 5000)] and r.gaps_of(0, roce.GAP_TAIL) == [(5, 8)]
    send = send_frames(A, B, sport=1, dqpn=0x71D, psn=0, data=bytes(3000), imm=None, mtu=1024)
    _, r2 = decode(Frames.from_list(send[:2]))  # a SEND has no length: its end is unknown
    assert r2.messages[0]["flags"] & MessageFlag.END_UNKNOWN and r2.missing_of(0) == [(2048, -1)]


def test_psn_wraps_at_2_to_the_24():
    wire = write(0xFFFFFE, 4096, flag=5) + write(2, 100, flag=6)
    del wire[2]  # PSN 0 after the wrap
    frames = Frames.from_list(wire)
    _, r = decode(frames)
    assert list(r.messages["first_psn"]) == [0xFFFFFE, 0x1000002] and r.messages[0]["last_psn"] == 0x1000001
    assert r.gaps_of(0) == [(0x1000000, 0x1000001)] and r.missing_of(0) == [(2048, 3072)]
    assert r.messages[1]["complete"] and unpack_ll(frames, r, 1)[0].flag == 6


def test_ipv4_vlan_streams_sends_acks_and_ud_are_counted_apart():
    a4, b4 = Endpoint("02:00:00:00:00:01", "10.0.0.1", vlan=5), Endpoint("02:00:00:00:00:02", "10.0.0.2", vlan=5)
    wire = write(0, 2000, src=a4, dst=b4, imm=2000) + write(0, 32, dqpn=0x71C, src=a4, dst=b4)
    wire += send_frames(a4, b4, sport=4000, dqpn=0x71D, psn=2, data=bytes(1500), imm=9, mtu=1024)
    wire += [ack_frame(a4, b4, sport=4000, dqpn=0x71D, psn=7), ud_frame(A, B, sport=9)]
    _, r = decode(Frames.from_list(wire))
    data, cts, ud = (r.find_stream("10.0.0.1", "10.0.0.2", 0x71D), r.find_stream("10.0.0.1", "10.0.0.2", 0x71C),
                     r.find_stream(A.ip, B.ip, 1))
    s = r.streams[data]
    assert (s["ip_version"], s["vlan"], s["n_writes"], s["n_sends"], s["n_acks"]) == (4, 5, 2, 2, 1)
    kinds = r.messages["kind"][r.messages_of(data)]
    assert list(kinds) == [roce.KIND_WRITE, roce.KIND_SEND] and r.messages[1]["dma_len"] == 1500
    assert r.messages[1]["complete"] and r.messages[1]["imm"] == 9
    assert r.streams[cts]["n_messages"] == 1 and r.streams[ud]["n_ud"] == 1 and r.streams[ud]["n_messages"] == 0


def reseal(frame: bytearray, l3: int = 14) -> bytes:
    """Recompute the ICRC after editing a frame, so only the edit is wrong."""
    frame[-4:] = struct.pack("<I", icrc(bytes(frame[l3:-4])))
    return bytes(frame)


def test_statuses_of_broken_and_foreign_frames():
    good = write(0, 64)[0]
    bad_pad = bytearray(good)
    bad_pad[62 + 1] |= 0x30  # pad count 3: a 61-byte payload, but the RETH says 64
    middle = bytearray(write(0, 3000)[1])
    middle[62 + 1] |= 0x10  # pad on a MIDDLE packet, which must be full
    unknown = bytearray(good)
    unknown[62] = 0x1F  # reserved RC opcode
    udp_len = bytearray(good)
    udp_len[58:60] = struct.pack(">H", len(good) - 54 - 4)  # disagrees with the IPv6 payload length
    corrupt = bytearray(good)
    corrupt[100] ^= 0xFF
    arp = bytes.fromhex("ffffffffffff020000000001" "0806") + bytes(28)
    tcp4 = bytes.fromhex("020000000002020000000001" "0800" "45000028000040004006" "0000" "0a000001" "0a000002") + \
        struct.pack(">HH", 4791, 4791) + bytes(16)
    frames = Frames.from_list([good, reseal(bad_pad), reseal(middle), reseal(unknown), reseal(udp_len), bytes(corrupt),
                               good[:70], arp, tcp4, b"\x00" * 10])
    statuses = list(roce.parse(frames)["status"])
    assert statuses == [Status.OK, Status.MALFORMED, Status.MALFORMED, Status.MALFORMED, Status.MALFORMED,
                        Status.BAD_ICRC, Status.MALFORMED, Status.NOT_ROCE, Status.NOT_ROCE, Status.MALFORMED]


def test_ll_unpack_counts_lines_whose_flags_disagree():
    frames = Frames.from_list(write(0, 1024, flag=4))
    _, r = decode(frames)
    out = np.zeros(512, dtype=np.uint8)
    assert roce.ll_unpack(frames, r.segments_of(0), out) == (4, 64, 0)
    assert roce.ll_unpack(frames, r.segments_of(0), out, expected_flag=5) == (5, 64, 64)
    torn = bytearray(frames.frame(0))
    torn[62 + 28 + 16 * 3 + 4] ^= 1  # line 3's first flag
    frames = Frames.from_list([reseal(torn)])
    _, r = decode(frames)
    assert roce.ll_unpack(frames, r.segments_of(0), out) == (4, 64, 1)
    with pytest.raises(ValueError, match="output holds"):
        roce.ll_unpack(frames, r.segments_of(0), np.zeros(100, dtype=np.uint8))


def test_merge_send_places_only_whole_valid_segments_of_real_frames_and_clips_to_the_send():
    frames = Frames.from_list(write(0, 2048, flag=4))  # two 1 KiB packets: 2 segments of 64 lines
    _, r = decode(frames)
    segs = np.ascontiguousarray(r.segments_of(0))
    buf = np.frombuffer(frames.buf, np.uint8)
    ref = np.zeros(1024, np.uint8)
    roce.ll_unpack(frames, segs, ref)

    def merge(buf, shift, flag, ll, n):
        out, copies = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
        got = roce.merge_send(buf, [(segs, shift)], flag, ll, out, copies)
        return got, out, copies

    got, out, copies = merge(buf, 0, 4, True, 1024)
    assert got == (1024, 0, []) and out.tobytes() == ref.tobytes() and (copies == 1).all()
    got, out, copies = merge(buf, 0, 5, True, 1024)  # wrong flag: nothing written, both segments reported
    assert got[:2] == (0, 0) and [st for st, _ in got[2]] == [64, 64] and not out.any() and not copies.any()
    assert [st for st, _ in merge(buf, 0, None, True, 1024)[0][2]] == [64, 64]  # no flag known: every line is bad
    assert [st for st, _ in merge(buf, 8, 4, True, 1024)[0][2]] == [-1, -1]  # not on a line boundary
    got, short, _ = merge(buf, 0, 4, True, 700)  # the send ends inside the second segment, mid-line
    assert got[0] == 700 and short.tobytes() == ref[:700].tobytes()
    assert merge(buf, 1024, 4, True, 256)[0] == (0, 0, [])  # beyond the send
    torn = bytearray(frames.frame(1))
    torn[62 + 28 + 16 * 3 + 12] ^= 1  # the second packet's line 3, second flag
    frames = Frames.from_list([frames.frame(0), reseal(torn)])
    _, r = decode(frames)
    segs = np.ascontiguousarray(r.segments_of(0))
    got, out, copies = merge(np.frombuffer(frames.buf, np.uint8), 0, 4, True, 1024)
    assert got[0] == 512 and [st for st, _ in got[2]] == [1] and out[:512].tobytes() == ref[:512].tobytes()
    assert not out[512:].any() and not copies[512:].any()
    whole = np.zeros(2048, np.uint8)  # Simple: raw bytes at msg_offset + shift, clipped
    roce.simple_copy(frames, r.segments_of(0), whole)
    got, raw, copies = merge(np.frombuffer(frames.buf, np.uint8), 100, None, False, 1500)
    assert got[0] == 1400 and not raw[:100].any() and raw[100:].tobytes() == whole[:1400].tobytes()


def _rows(*rows: tuple[int, int, int]) -> np.ndarray:
    """SEGMENT rows (offset in the buffer, msg_offset, length)."""
    segs = np.zeros(len(rows), roce.SEGMENT)
    for i, (offset, msg_offset, length) in enumerate(rows):
        segs[i]["offset"], segs[i]["msg_offset"], segs[i]["length"] = offset, msg_offset, length
    return segs


def _place_reference(buf, segs, out, shift, flag, ll) -> np.ndarray:
    """Each segment's payload at out[msg_offset + shift] (LL: / 2, data words only), clipped; status per segment:
    0 placed, -1 misaligned (LL), > 0 lines whose flags differ from ``flag`` (LL, nothing written), -2 outside."""
    st = np.zeros(len(segs), np.int32)
    for i, (off, msg_offset, length) in enumerate(zip(segs["offset"].tolist(), segs["msg_offset"].tolist(),
                                                      segs["length"].tolist())):
        payload, pos = buf[off:off + length], msg_offset + shift
        if not ll:
            if pos < 0 or pos >= out.nbytes or not length:
                st[i] = -2
                continue
            m = min(length, out.nbytes - pos)
            out[pos:pos + m] = payload[:m]
            continue
        if length % 16 or pos % 16 or pos < 0:
            st[i] = -1
            continue
        words = payload.view("<u4").reshape(-1, 4)
        bad = len(words) if flag is None else int(((words[:, 1] != flag) | (words[:, 3] != flag)).sum())
        if bad:
            st[i] = bad
            continue
        lo = pos // 2
        if lo >= out.nbytes:
            st[i] = -2
            continue
        data = words[:, [0, 2]].reshape(-1).view(np.uint8)
        m = min(len(data), out.nbytes - lo)
        out[lo:lo + m] = data[:m]
    return st


def _merge_reference(buf, parts, flag, ll, data, copies):
    """The merge as decode did it in Python before merge_send: place into a zeroed send buffer, whole-element
    mask of each placed segment's byte range, first copy wins, later copies compared, copies saturate."""
    isz, n = data.itemsize, len(data)
    out = np.zeros(n * isz, np.uint8)
    mask, unplaced = np.zeros(n, bool), []
    for segs, shift in parts:
        st = _place_reference(buf, segs, out, shift, flag, ll)
        ok = st == 0
        if ll:
            unplaced += [(-1, int(segs["length"][i])) for i in np.flatnonzero(st == -1)]
            unplaced += [(int(st[i]), 0) for i in np.flatnonzero(st > 0)]
            lo = (segs["msg_offset"][ok] + shift) // 2
            hi = np.minimum(lo + segs["length"][ok] // 16 * 8, out.nbytes)
        else:
            lo = segs["msg_offset"][ok] + shift
            hi = np.minimum(lo + segs["length"][ok], out.nbytes)
        for a, b in zip(lo.tolist(), hi.tolist()):
            mask[-(-a // isz):min(b // isz, n)] = True
    word = {2: np.uint16, 4: np.uint32}[isz]
    new, old, have = out.view(word), data.view(word), copies > 0
    differing = int(np.count_nonzero((old != new) & have & mask))
    np.copyto(old, new, where=mask & ~have)
    np.add(copies, 1, out=copies, where=mask & (copies < 255))
    return int(mask.sum()), differing, unplaced


def test_merge_send_counts_whole_elements_only():
    buf = np.arange(64, dtype=np.uint8)
    data, copies = np.zeros(4, np.float32), np.zeros(4, np.uint8)
    # Simple, bytes [0, 6) and [6, 16): element 1 (bytes 4..8) is cut by both ranges, so it is not present
    got = roce.merge_send(buf, [(_rows((0, 0, 6), (6, 6, 10)), 0)], None, False, data, copies)
    assert got == (3, 0, []) and list(copies) == [1, 0, 1, 1]
    assert data.view(np.uint8)[:4].tobytes() == bytes(range(4)) and data[1] == 0
    assert data.view(np.uint8)[8:].tobytes() == bytes(range(8, 16))
    # a shifted part covering bytes [2, 10) of the send: only element 1 whole
    data, copies = np.zeros(4, np.float32), np.zeros(4, np.uint8)
    assert roce.merge_send(buf, [(_rows((20, 0, 8), ), 2)], None, False, data, copies)[:2] == (1, 0)
    assert list(copies) == [0, 1, 0, 0] and data.view(np.uint8)[4:8].tobytes() == bytes(range(22, 26))
    # nothing placeable: a segment beyond the send, an empty one, no parts at all
    assert roce.merge_send(buf, [(_rows((0, 16, 8), (0, 0, 0)), 0)], None, False, data, copies)[:2] == (0, 0)
    assert roce.merge_send(buf, [], None, False, data, copies) == (0, 0, []) and list(copies) == [0, 1, 0, 0]


def test_merge_send_ll_lines_conflicts_and_saturating_copies():
    words = np.arange(128, dtype=np.uint32) + 1000
    words[1::2] = 7  # 32 lines {data0, 7, data1, 7}: 64 data words
    buf = words.view(np.uint8)
    values = words[0::2]
    data, copies = np.zeros(64, np.uint32), np.zeros(64, np.uint8)
    parts = [(_rows((0, 0, 256)), 0), (_rows((256, 256, 256)), 0)]
    assert roce.merge_send(buf, parts, 7, True, data, copies) == (64, 0, [])
    assert (data == values).all() and (copies == 1).all()
    # a second copy that differs in 2 elements: counted, the first copy stays
    other = words.copy()
    other[[0, 10]] += 1
    assert roce.merge_send(other.view(np.uint8), parts, 7, True, data, copies) == (64, 2, [])
    assert (data == values).all() and (copies == 2).all()
    copies[:] = [254, 255] * 32
    assert roce.merge_send(buf, parts, 7, True, data, copies)[:2] == (64, 0)
    assert (copies == 255).all()
    # bad flags and misaligned segments place nothing and are reported per part, misaligned first
    data, copies = np.zeros(64, np.uint32), np.zeros(64, np.uint8)
    bad = [(_rows((0, 0, 256), (0, 8, 256), (0, 256, 24)), 0), (_rows((256, 256, 256)), 0)]
    got = roce.merge_send(buf, bad, 8, True, data, copies)
    assert got == (0, 0, [(-1, 256), (-1, 24), (16, 0), (16, 0)]) and not copies.any() and not data.any()
    assert roce.merge_send(buf, parts, None, True, data, copies) == (0, 0, [(16, 0), (16, 0)])  # no flag known
    # bfloat16-sized elements; the send ends mid-line: the partial last line still places its whole elements
    data, copies = np.zeros(61, np.uint16), np.zeros(61, np.uint8)
    assert roce.merge_send(buf, parts, 7, True, data, copies)[:2] == (61, 0)
    assert data.tobytes() == values.tobytes()[:122]


def test_merge_send_rejects_bad_arguments():
    buf = np.zeros(64, np.uint8)
    segs = _rows((0, 0, 16))
    data, copies = np.zeros(4, np.float32), np.zeros(4, np.uint8)
    for parts in ([(segs,)], [[segs, 0]], [(b"x" * 40, 0)], [(np.zeros(3, np.int64), 0)], [(segs, "0")],
                  [(segs, 2**64)], [(_rows((60, 0, 16)), 0)], [(_rows((-1, 0, 16)), 0)], [(_rows((0, 0, -1)), 0)],
                  [(np.zeros(4, roce.SEGMENT)[::2], 0)], [(segs, None)]):
        with pytest.raises(ValueError):
            roce.merge_send(buf, parts, 1, True, data, copies)
    for d, c in ((np.zeros(4, np.float32), np.zeros(3, np.uint8)), (np.zeros((2, 2), np.float32), np.zeros(4, np.uint8)),
                 (np.zeros(4, np.float32), np.zeros(4, np.uint16)), (np.zeros(8, np.float32)[::2], np.zeros(4, np.uint8)),
                 (np.zeros(4, "V3"), np.zeros(4, np.uint8))):
        with pytest.raises(ValueError):
            roce.merge_send(buf, [(segs, 0)], 1, True, d, c)
    with pytest.raises(ValueError):
        roce.merge_send(buf, [(segs, 0)], 2**64, True, data, copies)
    # offsets that overflow 64 bits are nowhere in the send
    assert roce.merge_send(buf, [(_rows((0, 2**62, 16)), 2**63 - 1)], 0, True, data, copies) == (0, 0, [])
    assert roce.merge_send(buf, [(_rows((0, 2**62, 16)), 2**63 - 1)], 0, False, data, copies) == (0, 0, [])


@pytest.mark.parametrize("seed", range(6))
def test_merge_send_equals_the_reference_merge_on_random_sends(seed):
    rng = np.random.default_rng(seed)
    for case in range(60):
        ll, isz = bool(rng.integers(2)), int(rng.choice([2, 4]))
        flag = 5
        words = rng.integers(0, 4, 1024, dtype=np.uint32)  # few values: copies often agree
        if ll:
            words[1::2] = flag
            words[rng.integers(0, 1024, rng.integers(0, 4)) | 1] = 6  # a few torn lines
        buf = words.view(np.uint8)
        n = int(rng.integers(0, 400))
        data = rng.integers(0, 4, n).astype(np.uint16 if isz == 2 else np.uint32)
        counts = [[0, 0, 0, 1, 254, 255], [0], [1, 2, 254, 255]][case % 3]  # mixed, none yet, all seen before
        copies = rng.choice(np.array(counts, np.uint8), n)
        ref_data, ref_copies = data.copy(), copies.copy()
        for _ in range(3):
            parts = []
            for _ in range(int(rng.integers(0, 4))):
                rows = []
                for _ in range(int(rng.integers(0, 5))):
                    length = int(rng.choice([16 * rng.integers(0, 20), rng.integers(0, 300)]))
                    offset = int(rng.integers(0, buf.nbytes - length + 1))
                    msg_offset = int(rng.choice([16 * rng.integers(0, 120), rng.integers(0, 2000)]))
                    rows.append((offset, msg_offset, length))
                parts.append((_rows(*rows), int(rng.choice([0, 0, 16, -16, 8, 3, 5000, -5000]))))
            f = None if rng.random() < 0.1 else flag
            got = roce.merge_send(buf, parts, f, ll, data, copies)
            want = _merge_reference(buf, parts, f, ll, ref_data, ref_copies)
            assert tuple(got) == want, (seed, case)
            assert data.tobytes() == ref_data.tobytes() and copies.tobytes() == ref_copies.tobytes(), (seed, case)


# Run with $FLOWCHECK_CRC capping the folding (read once, at import): every length and misaligned start against
# zlib, then the ICRC of simulated frames of every payload length (IPv4 + VLAN and IPv6, with and without extension
# headers) and the status counts of the real captures, printed for the parent to compare across paths.
CRC_CHILD = """
import json, sys, zlib
import numpy as np
from flowcheck import _mirror
from flowcheck.capture.mirror import roce
from flowcheck.capture.mirror.frames import Endpoint, Opcode, roce_frame
from flowcheck.capture.mirror.pcap import Frames, read_capture

rng = np.random.default_rng(5)
data = rng.integers(0, 256, (1 << 20) + 64, dtype=np.uint8)
for n in [*range(0, 601), 1024, 4096, 9000, 1 << 20]:
    for start in (0, 1, 3, 13):
        chunk, value = data[start:start + n], int(rng.integers(0, 2**32))
        assert _mirror.crc32(chunk, value) == zlib.crc32(chunk, value), (n, start)
v4 = (Endpoint("02:00:00:00:00:01", "10.0.0.1", vlan=7), Endpoint("02:00:00:00:00:02", "10.0.0.2", vlan=7))
v6 = (Endpoint("0c:42:a1:9f:58:f8", "fe80::e42:a1ff:fe9f:58f8"),
      Endpoint("08:c0:eb:8c:28:2c", "fe80::ac0:ebff:fe8c:282c"))
ops = (Opcode.WRITE_ONLY, Opcode.WRITE_MIDDLE, Opcode.WRITE_LAST_IMM)
frames = [roce_frame(src, dst, sport=7, opcode=op, dqpn=5, psn=n, payload=data[:n].tobytes(), va=64, imm=n)
          for src, dst in (v4, v6) for n in range(0, 1101) for op in ops]
status = roce.parse(Frames.from_list(frames))["status"]
counts = {p: roce.parse(read_capture(p)).status_counts for p in sys.argv[1:]}
print(json.dumps({"path": _mirror.crc_path(), "icrc": [_mirror.frame_icrc(f) for f in frames],
                  "trailer": [int.from_bytes(f[-4:], "little") for f in frames],
                  "bad_icrc": int((status == roce.Status.BAD_ICRC).sum()), "captures": counts}))
"""


@pytest.mark.parametrize("path", ["table", "pclmul", "vpclmul"])
def test_every_crc32_path_equals_zlib_and_gives_the_same_icrcs(path):
    """The three CRC32 paths (table, 128-bit PCLMULQDQ folding, 512-bit VPCLMULQDQ folding) are bit-identical."""
    import os
    import subprocess
    import sys

    captures = [str(PCAPS / f"{name}.pcapng") for name in CAPTURES if (PCAPS / f"{name}.pcapng").exists()]
    env = {**os.environ, "FLOWCHECK_CRC": path}
    proc = subprocess.run([sys.executable, "-c", CRC_CHILD, *captures], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    if got["path"] != path:
        pytest.skip(f"this CPU lacks {path} (the CRC fell back to {got['path']})")
    assert got["icrc"] == got["trailer"] and got["bad_icrc"] == 0
    for capture, counts in got["captures"].items():
        assert counts == roce.parse(read_capture(capture)).status_counts, capture


def test_ll128_unpack_and_simple_copy():
    lines = np.random.default_rng(3).integers(0, 256, (16, 128), dtype=np.uint8)
    lines[:, 120:] = np.frombuffer(struct.pack("<Q", 77), dtype=np.uint8)
    frames = Frames.from_list(write_frames(A, B, sport=1, dqpn=2, psn=0, va=0, data=lines.tobytes(), imm=None, mtu=1024))
    _, r = decode(frames)
    out = np.zeros(16 * 120, dtype=np.uint8)
    assert roce.ll128_unpack(frames, r.segments_of(0), out) == (77, 16, 0)
    assert out.tobytes() == lines[:, :120].tobytes()
    raw = np.zeros(2048, dtype=np.uint8)
    assert roce.simple_copy(frames, r.segments_of(0), raw) == 2048 and raw.tobytes() == lines.tobytes()


# ---------------------------------------------------------------- fuzz

def _real_roce_frames() -> list[bytes]:
    path = PCAPS / "rdma32.pcapng"
    if not path.exists():
        return write(0, 3000) + [ud_frame(A, B, sport=1), ack_frame(A, B, sport=1, dqpn=1, psn=1)]
    frames = read_capture(str(path))
    return [frames.frame(i) for i in range(len(frames))]


REAL = _real_roce_frames()


@settings(max_examples=400, deadline=None)
@given(picks=st.lists(st.integers(0, len(REAL) - 1), max_size=12),
       edits=st.lists(st.tuples(st.integers(0, 1200), st.integers(0, 255)), max_size=6),
       cut=st.integers(0, 1300), noise=st.lists(st.binary(max_size=120), max_size=4))
def test_fuzzed_frames_never_crash_parse_or_reassembly(picks, edits, cut, noise):
    wire = []
    for k, i in enumerate(picks):
        f = bytearray(REAL[i])
        for at, value in edits if k % 2 else ():
            if at < len(f):
                f[at] = value
        wire.append(bytes(f[: cut if k % 3 == 2 else None]))
    frames = Frames.from_list(wire + noise)
    packets = roce.parse(frames)
    t = packets.table
    assert set(t["status"]) <= {0, 1, 2, 3}
    ok = t["status"] == Status.OK
    ends = t["payload_off"][ok] + t["payload_len"][ok]
    assert (ends <= frames.offsets[ok] + frames.lengths[ok]).all()
    r = roce.reassemble(frames, packets)
    assert len(r.stream_of) == len(frames)
    assert (t["ll_flag"][~ok] == -1).all()
    seg_flags = roce.segment_flags(np.frombuffer(frames.buf, np.uint8), r.segments)
    assert np.array_equal(_parsed_flags(packets, r.segments), seg_flags)
    _assert_message_ll_summary(r, seg_flags)
    for m in range(len(r.messages)):
        seg = r.segments_of(m)
        if len(seg) and (seg["msg_offset"] >= 0).all():
            roce.simple_copy(frames, seg, np.zeros(int((seg["msg_offset"] + seg["length"]).max()), dtype=np.uint8))


def test_a_short_middle_packet_makes_the_message_bad_length_not_complete():
    wire = write(0, 3072)
    wire[1] = roce_frame(A, B, sport=4000, opcode=Opcode.WRITE_MIDDLE, dqpn=0x71D, psn=1, payload=bytes(512))
    _, r = decode(Frames.from_list(wire))
    m = r.messages[0]
    assert m["flags"] & MessageFlag.BAD_LENGTH and not m["complete"] and m["bytes_seen"] == 2560


def test_merge_sends_equals_merge_send_one_call_at_a_time():
    """The batched merge gives every job what merge_send gives it, in list order (later copies compared with the
    first), including bad lines and misaligned segments."""
    rng = np.random.default_rng(5)
    words = rng.integers(0, 2**32, 4 * 64, dtype=np.uint32)
    words[1::2] = 7
    other = words.copy()
    other[[0, 20, 64]] += 1  # a second copy that differs in three data words
    bufs = [words.view(np.uint8), other.view(np.uint8)]
    segs = [_rows((0, 0, 256), (256, 256, 256)), _rows((512, 0, 256), (0, 8, 256), (768, 256, 256))]
    plan = [(0, 0, 7, 0), (1, 0, 7, 0), (0, 1, 7, 32), (1, 1, 7, 0), (0, 0, 8, 0), (1, 0, None, 0)]

    def run(batched: bool):
        data, copies = np.zeros(96, np.uint32), np.zeros(96, np.uint8)
        jobs = [roce.merge_job(bufs[b], [(segs[s], shift)], flag, True, data[:64], copies[:64])
                for b, s, flag, shift in plan]
        got = roce.merge_sends(jobs) if batched else [roce.merge_send(bufs[b], [(segs[s], shift)], flag, True,
                                                                       data[:64], copies[:64]) for b, s, flag, shift in plan]
        return [tuple(g) for g in got], data.tobytes(), copies.tobytes()

    one, batch = run(False), run(True)
    assert one == batch
    assert any(g[1] for g in one[0]) and any(g[2] for g in one[0])  # conflicts and unplaced segments were exercised
    assert roce.merge_sends([]) == []


@pytest.mark.parametrize("ll", [True, False])
def test_merge_rows_equals_merge_sends_row_by_row(ll):
    """Rows over one segments table merge what merge_sends merges with the same runs, shifts, flags and destination
    slices, in order: copies counted and compared, bad lines and misaligned segments reported per row."""
    rng = np.random.default_rng(7)
    words = rng.integers(0, 2**32, 4 * 96, dtype=np.uint32)
    words[1::2] = 7
    words[4 * 40:4 * 48] += np.uint32(1)  # the same data again at 40..48, differing: a conflicting copy
    words[4 * 70 + 1] = 9  # one bad flag
    buf = words.view(np.uint8)
    segs = _rows((0, 0, 256), (256, 256, 256), (512, 0, 256), (640, 8, 256), (1024, 0, 512), (1528, 0, 8))
    plan = [(0, 2, 0, 7, 0, 32), (2, 3, 0, 7, 0, 16), (0, 2, 64, 7, 8, 48), (3, 4, 0, 7, 16, 40),
            (4, 5, 0, 7, 40, 72), (4, 5, 0, -1, 40, 72), (5, 6, 0, 7, 72, 80), (1, 1, 0, 7, 80, 80), (0, 1, 0, 8, 0, 16)]

    def run(rows: bool):
        data, copies = np.zeros(96, np.uint32), np.zeros(96, np.uint8)
        if rows:
            got = roce.merge_rows(buf, segs, np.array(plan, np.int64), ll, data, copies)
        else:
            got = roce.merge_sends([roce.merge_job(buf, [(segs[a:b], shift)], None if flag < 0 else flag, ll,
                                                   data[lo:hi], copies[lo:hi]) for a, b, shift, flag, lo, hi in plan])
        return [tuple(g) for g in got], data.tobytes(), copies.tobytes()

    by_rows, by_jobs = run(True), run(False)
    assert by_rows == by_jobs
    assert any(g[1] for g in by_rows[0]) and max(by_rows[2]) >= 2  # conflicts and repeated copies were exercised
    if ll:
        assert any(g[2] for g in by_rows[0])  # and unplaced LL segments
    assert roce.merge_rows(buf, segs, np.zeros((0, 6), np.int64), ll, np.zeros(4, np.uint32), np.zeros(4, np.uint8)) == []


def test_merge_rows_rejects_bad_rows_before_merging_any():
    buf = np.zeros(64, np.uint8)
    segs = _rows((0, 0, 16), (60, 16, 16))  # the second lies outside the 64-byte capture
    data, copies = np.zeros(8, np.float32), np.zeros(8, np.uint8)
    good = (0, 1, 0, 0, 0, 2)
    for bad, match in (((0, 3, 0, 0, 0, 2), "segments"), ((1, 0, 0, 0, 0, 2), "segments"), ((0, 1, 0, 0, 4, 9), "elements"),
                       ((0, 1, 0, 0, 3, 2), "elements"), ((0, 1, 0, -2, 0, 2), "flag"), ((1, 2, 0, 0, 0, 2), "outside the capture")):
        with pytest.raises(ValueError, match=match):
            roce.merge_rows(buf, segs, np.array([good, bad], np.int64), True, data, copies)
        assert not copies.any()
    with pytest.raises(ValueError, match=r"shape \(n, 6\)"):
        roce.merge_rows(buf, segs, np.array([good[:5]], np.int64), True, data, copies)
    with pytest.raises(ValueError, match="as long as data"):
        roce.merge_rows(buf, segs, np.array([good], np.int64), True, data, np.zeros(7, np.uint8))
    with pytest.raises(ValueError, match="Reassembly.segments"):
        roce.merge_rows(buf, np.zeros(2, np.int64), np.array([good], np.int64), True, data, copies)


def test_merge_sends_rejects_a_bad_job_before_merging_any():
    buf = np.zeros(64, np.uint8)
    buf[4:8] = 1
    data, copies = np.zeros(4, np.float32), np.zeros(4, np.uint8)
    good = roce.merge_job(buf, [(_rows((0, 0, 16)), 0)], 1, True, data, copies)
    for bad in ((buf, [], 0, True, data), (buf, [(_rows((60, 0, 16)), 0)], 0, True, data, copies),
                (buf, [], 0, True, data, np.zeros(3, np.uint8)), (buf, [], 0, True, b"xx", copies),
                (buf, ((_rows((0, 0, 16)), 0),), 0, True, data, copies), [buf, [], 0, True, data, copies]):
        with pytest.raises(ValueError, match="job 1"):
            roce.merge_sends([good, bad])
        assert not copies.any()
