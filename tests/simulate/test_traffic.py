"""Ring sends become RoCE frames the way NCCL over RoCEv2 puts them on the wire."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from flowcheck.capture.mirror import roce
from flowcheck.capture.mirror.pcap import Frames
from flowcheck.capture.mirror.ring import RingParams, ring_sends
from flowcheck.simulate.allreduce import ring_allreduce
from flowcheck.simulate.traffic import FIFO_ENTRY, SLOTS, Wire, ll_encode, rank_endpoint
from tests.simulate.conftest import ll_decode, messages


def _wire(n: int, channels: int, proto: str, *, mtu: int = 1024, ipv4: bool = False) -> Wire:
    simple = proto == "simple"
    rp = RingParams(n, channels, proto, 4, step_bytes=524288 if simple else 65536, chunk_steps=4 if simple else 1)
    eps = [rank_endpoint(r, ipv4=ipv4) for r in range(n)]
    return Wire(eps, rp, mtu=mtu, seed=3, wanted=lambda s, d: True)


def _reduce(wire: Wire, count: int, seed: int):
    rng = np.random.default_rng(seed)
    red = ring_allreduce([rng.standard_normal(count).astype(np.float32) for _ in range(wire.ring.nranks)], wire.ring)
    wire.allreduce(red)
    return red


def _frames(wire: Wire) -> Frames:
    drained = wire.drain()
    assert all(a.t_ns <= b.t_ns for a, b in itertools.pairwise(drained))
    return Frames.from_list([f.data for f in drained], [f.t_ns for f in drained])


def test_ll_lines_interleave_data_and_flags():
    v = np.array([1.5, -2.0, 3.25], dtype=np.float32)
    lines = np.frombuffer(ll_encode(v, 7), dtype="<u4").reshape(-1, 4)
    assert lines.shape == (2, 4)
    assert (lines[:, 1] == 7).all() and (lines[:, 3] == 7).all()
    assert lines[:, 0::2].reshape(-1)[:3].view(np.float32).tolist() == [1.5, -2.0, 3.25]
    assert lines[1, 2] == 0  # odd tail word padded with zero
    assert ll_encode(v[:0], 1) == b""


@pytest.mark.parametrize("n,channels,proto,count", [(3, 2, "ll", 20000), (4, 1, "ll", 5000), (2, 2, "simple", 9000),
                                                     (4, 2, "ll", 100)])
def test_each_send_is_one_write_with_its_step_slot_size_and_values(n, channels, proto, count):
    wire = _wire(n, channels, proto, mtu=512)
    wire.links[0, 0].data.psn = (1 << 24) - 5  # PSNs wrap
    reds = [_reduce(wire, count, seed) for seed in (1, 2)]
    msgs = messages(_frames(wire))
    for (i, b), link in wire.links.items():
        src, dst = wire.ep[i].mac, wire.ep[(i + 1) % n].mac
        got = msgs[src, dst, link.data.dqpn]
        expected = [(red, s) for red in reds for s in ring_sends(count, wire.ring, i, b)]
        assert len(got) == len(expected) == link.steps
        psns = [p for m in got for p in m.psns]
        assert psns == [(psns[0] + k) % (1 << 24) for k in range(len(psns))]
        for step, (m, (red, s)) in enumerate(zip(got, expected), start=1):
            assert m.va == link.base + ((step - 1) % SLOTS) * link.step_bytes
            assert m.imm == m.dma_len == len(m.data)
            want = red.payload(i, s).tobytes()
            if proto == "ll":
                data, flags = ll_decode(bytes(m.data))
                assert (flags == step).all()
                assert data[:len(want)] == want and not data[len(want):].strip(b"\0")
            else:
                assert bytes(m.data) == want
        # the receiver's flow-control post precedes every send, on its own QP in the reverse direction
        posts = msgs[dst, src, link.fifo.dqpn]
        assert len(posts) == len(got) and all(p.dma_len == FIFO_ENTRY and p.imm is None for p in posts)


def test_empty_chunks_are_zero_byte_writes_with_immediate():
    wire = _wire(8, 2, "ll")
    _reduce(wire, 100, seed=4)  # 16 chunks of 1024 elements: most are empty
    msgs = messages(_frames(wire))
    empty = [m for stream in msgs.values() for m in stream if m.dma_len == 0]
    assert empty and all(m.imm == 0 and len(m.psns) == 1 for m in empty)


def test_data_qpns_grow_with_the_channel_and_every_qp_has_its_own_port():
    wire = _wire(4, 3, "ll")
    for i in range(4):
        qpns = [wire.links[i, b].data.dqpn for b in range(3)]
        assert qpns == sorted(qpns) and len(set(qpns)) == 3
    wire.p2p(0, 1, np.ones(10, np.float32))
    ports = [q.sport for link in list(wire.links.values()) + list(wire.p2p_links.values()) for q in (link.data, link.fifo)]
    assert len(set(ports)) == len(ports)
    p2p = wire.p2p_links[0, 1]
    assert p2p.data.dqpn > max(link.data.dqpn for (i, _), link in wire.links.items() if i == 0)


def test_receivers_ack_on_the_data_qp_and_psns_never_go_back():
    wire = _wire(3, 1, "ll")
    _reduce(wire, 30000, seed=5)
    table = roce.parse(_frames(wire)).table
    acks = table[table["opcode"] == 17]
    assert len(acks) and acks["has_aeth"].all()
    link = wire.links[0, 0]
    mine = acks[acks["dqpn"] == link.data.sqpn]
    assert len(mine) > 1 and (np.diff(mine["psn"].astype(np.int64)) > 0).all()


def test_collectives_other_than_the_allreduce_consume_steps():
    wire = _wire(3, 2, "ll")
    wire.broadcast(np.arange(2, dtype=np.int64))
    assert [wire.links[i, 0].steps for i in range(3)] == [1, 1, 0]  # ring broadcast from rank 0: the last does not send
    assert [wire.links[i, 1].steps for i in range(3)] == [0, 0, 0]
    wire.broadcast(np.zeros(20000, np.float32), chunk=8192, spread=True)  # 3 chunks over 2 channels
    assert wire.links[0, 0].steps == 3 and wire.links[0, 1].steps == 1
    wire.p2p(1, 2, np.ones(5000, np.float32))
    wire.management(2, 0)
    table = roce.parse(_frames(wire)).table
    assert (table["status"] == roce.Status.OK).all()
    ud = table[table["opcode"] == 0x64]
    assert len(ud) == 1 and ud["dqpn"][0] == 1
    assert wire.p2p_links[1, 2].steps == 1


def test_ipv4_frames_parse():
    wire = _wire(2, 1, "ll", ipv4=True)
    _reduce(wire, 3000, seed=6)
    table = roce.parse(_frames(wire)).table
    assert (table["status"] == roce.Status.OK).all() and (table["ip_version"] == 4).all()
