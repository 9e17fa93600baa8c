"""Mirror ports copy exactly one rank's direction; loss, reordering and duplication are seeded and recorded."""
from __future__ import annotations

import itertools
import json
import os
from collections import Counter

import numpy as np
import pytest

from flowcheck.capture.mirror import roce
from flowcheck.capture.mirror.pcap import read_capture
from flowcheck.errors import ConfigError
from flowcheck.simulate import SimOptions, simulate
from flowcheck.simulate.mirror import MirrorSpec, parse_mirrors
from tests.simulate.conftest import file_bytes, mac_text, messages, pcap, tree_bytes

MAC = "02:fc:5e:00:00:{:02x}"


def _frames(path: str) -> list[bytes]:
    f = read_capture(path)
    return [f.frame(i) for i in range(len(f))]


def _macs(result, port: str) -> tuple[set[str], set[str]]:
    table = roce.parse(pcap(result, port)).table
    return {mac_text(m) for m in table["src_mac"]}, {mac_text(m) for m in table["dst_mac"]}


def test_out_holds_what_the_rank_sends_and_in_what_it_receives(sim_dir):
    for r in range(3):
        src, dst = _macs(sim_dir, f"{r}:out")
        assert src == {MAC.format(r + 1)} and MAC.format(r + 1) not in dst
        src, dst = _macs(sim_dir, f"{r}:in")
        assert dst == {MAC.format(r + 1)} and MAC.format(r + 1) not in src


def test_every_frame_is_seen_once_leaving_and_once_arriving(sim_dir):
    outs = Counter(f for r in range(3) for f in _frames(sim_dir.pcaps[f"{r}:out"]))
    ins = Counter(f for r in range(3) for f in _frames(sim_dir.pcaps[f"{r}:in"]))
    assert outs == ins
    # rank 0 -> rank 1 frames, as the two ports see them: same bytes, same order
    zero_out = [f for f in _frames(sim_dir.pcaps["0:out"]) if f[:6] == bytes.fromhex("02fc5e000002")]
    one_in = [f for f in _frames(sim_dir.pcaps["1:in"]) if f[6:12] == bytes.fromhex("02fc5e000001")]
    assert zero_out == one_in and zero_out
    both = _frames(sim_dir.pcaps["1:both"])
    assert Counter(both) == Counter(_frames(sim_dir.pcaps["1:out"])) + Counter(_frames(sim_dir.pcaps["1:in"]))


def test_timestamps_increase(sim_dir):
    for port in sim_dir.pcaps:
        ts = pcap(sim_dir, port).ts_ns
        assert (ts[1:] > ts[:-1]).all()


def test_ring_connections_carry_consecutive_flags_across_collectives(sim_dir):
    """Startup broadcasts, parameter broadcast, allreduces and rebuild broadcasts share each connection's steps."""
    with open(os.path.join(sim_dir.out, "truth", "traffic.json")) as f:
        conns = json.load(f)["connections"]
    msgs = messages(pcap(sim_dir, "0:out"))
    ring = [c for c in conns if c["kind"] == "ring" and c["src"] == 0]
    assert len(ring) == 2
    for c in ring:
        got = msgs[MAC.format(1), MAC.format(2), c["data_qpn"]]
        assert len(got) == c["steps"] > 40
        for step, m in enumerate(got, start=1):
            assert m.imm == len(m.data) and m.va == c["buffer_va"] + (step - 1) % 8 * c["step_bytes"]
            flags = set(memoryview(bytes(m.data)).cast("I")[1::2])
            assert flags <= {step}


def _lossy(tmp_path, name, **kw):
    return simulate(SimOptions(out=str(tmp_path / name), dp=4, iters=2, channels=2, mirror="0:out,3:in", seed=5, **kw))


def test_loss_drops_about_p_of_the_frames_and_the_record_matches_the_pcap(tmp_path):
    clean = _lossy(tmp_path, "clean")
    lossy = _lossy(tmp_path, "lossy", loss=0.2)
    for port, name in (("0:out", "mirror-r0-out.pcap"), ("3:in", "mirror-r3-in.pcap")):
        rec = lossy.injected["pcaps"][name]
        full = _frames(clean.pcaps[port])
        kept = _frames(lossy.pcaps[port])
        dropped = set(rec["dropped_indices"])
        assert rec["offered"] == len(full) and rec["written"] == len(kept) == len(full) - len(dropped)
        assert kept == [f for i, f in enumerate(full) if i not in dropped]
        assert abs(len(dropped) / len(full) - 0.2) < 0.03, len(dropped) / len(full)
    with open(os.path.join(lossy.out, "injected.json")) as f:
        assert json.load(f) == json.loads(json.dumps(lossy.injected))
    # the loss is the mirror's: training (and so the truth) is unaffected
    assert file_bytes(os.path.join(clean.out, "truth", "step-2.safetensors")) == \
        file_bytes(os.path.join(lossy.out, "truth", "step-2.safetensors"))


def test_reorder_and_duplication_are_recorded(tmp_path):
    clean = _lossy(tmp_path, "clean")
    noisy = _lossy(tmp_path, "noisy", reorder=0.05, dup=0.05)
    rec = noisy.injected["pcaps"]["mirror-r0-out.pcap"]
    full = _frames(clean.pcaps["0:out"])
    got = _frames(noisy.pcaps["0:out"])
    assert rec["dropped"] == 0 and rec["reordered"] > 0 and rec["duplicated"] > 0
    assert len(got) == rec["written"] == len(full) + rec["duplicated"]
    assert Counter(got) == Counter(full) + Counter(full[i] for i in rec["duplicated_indices"])
    assert got != full  # order changed


def test_same_seed_same_bytes_other_seed_other_traffic(tmp_path):
    a = simulate(SimOptions(out=str(tmp_path / "a"), dp=2, iters=2, loss=0.1, reorder=0.1, dup=0.1, seed=1))
    b = simulate(SimOptions(out=str(tmp_path / "b"), dp=2, iters=2, loss=0.1, reorder=0.1, dup=0.1, seed=1))
    c = simulate(SimOptions(out=str(tmp_path / "c"), dp=2, iters=2, loss=0.1, reorder=0.1, dup=0.1, seed=2))
    ta, tb, tc = tree_bytes(a.out), tree_bytes(b.out), tree_bytes(c.out)
    assert ta == tb
    assert ta["mirror-r0-out.pcap"] != tc["mirror-r0-out.pcap"]


def test_default_mirrors_are_three_outbound_ports_capped_at_the_ring():
    assert SimOptions(out="x", dp=8).mirrors == tuple(MirrorSpec(r, "out") for r in range(3))
    assert SimOptions(out="x", dp=2).mirrors == (MirrorSpec(0, "out"), MirrorSpec(1, "out"))


@pytest.mark.parametrize("text", ["0", "0:sideways", "a:out", "0:out,0:out"])
def test_bad_mirror_lists_are_refused(text):
    with pytest.raises(ConfigError, match="--mirror"):
        parse_mirrors(text)


def test_within_each_qp_packets_are_in_psn_order(sim_dir):
    for port in ("0:out", "1:out", "2:out"):
        table = roce.parse(pcap(sim_dir, port)).table
        table = table[table["opcode"] != 0x64]  # UD datagrams: one per QP 1, PSNs of their own
        streams: dict[tuple, list[int]] = {}
        for row in table:
            streams.setdefault((row["dst_mac"].tobytes(), int(row["dqpn"]), int(row["opcode"]) == 17), []).append(int(row["psn"]))
        for (_, qpn, ack), psns in streams.items():
            steps = [(b - a) % (1 << 24) for a, b in itertools.pairwise(psns)]
            assert all(0 < s < 1 << 23 for s in steps) if ack else set(steps) <= {1}, (port, hex(qpn))


def test_p2p_sends_are_simple_writes_on_their_own_qp_and_port(sim_dir):
    with open(os.path.join(sim_dir.out, "truth", "traffic.json")) as f:
        traffic = json.load(f)
    p2p = [c for c in traffic["connections"] if c["kind"] == "p2p"]
    assert [(c["src"], c["dst"], c["steps"]) for c in p2p] == [(0, 1, 1)]  # after iteration 2
    ring_ports = {c["data_sport"] for c in traffic["connections"] if c["kind"] == "ring"}
    assert p2p[0]["data_sport"] not in ring_ports
    (msg,) = messages(pcap(sim_dir, "0:out"))[MAC.format(1), MAC.format(2), p2p[0]["data_qpn"]]
    assert msg.imm == msg.dma_len == len(msg.data) == 3000 * 4  # raw fp32, no LL flags
    table = roce.parse(pcap(sim_dir, "0:out")).table
    assert len({int(s) for s in table["sport"][table["dqpn"] == p2p[0]["data_qpn"]]}) == 1


def test_a_tail_cut_at_k_frames_is_the_whole_tail_s_first_k_frames(tmp_path):
    """``tail_frames`` ends each port's capture inside the step after the last allreduce; everything before it is
    the run's traffic unchanged."""
    whole = simulate(SimOptions(out=str(tmp_path / "whole"), dp=2, iters=1, channels=2, tail="resend", seed=3))
    cut = simulate(SimOptions(out=str(tmp_path / "cut"), dp=2, iters=1, channels=2, tail="resend", tail_frames=4,
                              seed=3))
    for port in ("0:out", "1:out"):
        rec, rec_cut = (r.injected["pcaps"][f"mirror-r{port[0]}-out.pcap"] for r in (whole, cut))
        full, short = _frames(whole.pcaps[port]), _frames(cut.pcaps[port])
        assert rec["tail_written"] > 4 and rec_cut["tail_written"] == 4 and rec_cut["written"] == len(short)
        assert short == full[:len(full) - rec["tail_written"] + 4]
    # rank 0's re-send on channel 0 is the final chunk it received last: chunk 1 of channel 0, elements [16384, 24576)
    finals = simulate(SimOptions(out=str(tmp_path / "finals"), dp=2, iters=1, channels=2, tail="resend", seed=3),
                      keep_finals=True).finals
    with open(os.path.join(whole.out, "truth", "traffic.json")) as f:
        qpn = next(c["data_qpn"] for c in json.load(f)["connections"]
                   if c["kind"] == "ring" and c["src"] == 0 and c["channel"] == 0)
    sends = messages(pcap(whole, "0:out"))[MAC.format(1), MAC.format(2), qpn]
    words = np.frombuffer(bytes(sends[-1].data), "<u4").reshape(-1, 2)
    assert (words[:, 1] == len(sends)).all()  # its LL flag: the connection's next step
    assert words[:, 0].tobytes() == finals[-1][16384:24576].tobytes()


@pytest.mark.parametrize("kw,flag", [({"tail": "again"}, "--tail"), ({"tail_frames": 3}, "--tail-frames"),
                                     ({"tail": "resend", "tail_frames": -1}, "--tail-frames")])
def test_bad_tail_options_are_refused(kw, flag):
    with pytest.raises(ConfigError, match=flag):
        SimOptions(out="x", **kw)
