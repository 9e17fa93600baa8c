"""Streaming decode (what a live capture runs): frames in arrival order, fed in batches, give exactly the
allreduces that decoding the whole capture at once gives — data, copies, missing ranges — in a window that
holds only what is still in flight."""
from __future__ import annotations

import numpy as np
import pytest

from flowcheck.capture.mirror.anomalies import Duplicates, PsnGap
from flowcheck.capture.mirror.decode import Decoded, decode, read_all
from flowcheck.capture.mirror.job import load_job
from flowcheck.capture.mirror.pcap import Frames
from flowcheck.capture.mirror.streaming import StreamingDecoder
from flowcheck.errors import CaptureError
from flowcheck.simulate import SimOptions, simulate


def arrival_order(paths) -> Frames:
    """The frames of every mirror's capture merged by capture time into one buffer, as one socket delivers them."""
    frames = read_all(sorted(paths))
    order = np.argsort(frames.ts_ns, kind="stable")
    return Frames.from_list([frames.frame(int(i)) for i in order], frames.ts_ns[order].tolist(), "merged")


def _key(ar) -> tuple:
    return (ar.index, ar.iteration, ar.bucket, ar.complete, ar.missing(), ar.data.tobytes(), ar.copies.tobytes(),
            len(ar.conflicts))


def _lost_and_duplicated(info: Decoded) -> tuple[int, int]:
    return (sum(a.packets for a in info.anomalies if isinstance(a, PsnGap)),
            sum(a.packets for a in info.anomalies if isinstance(a, Duplicates)))


def _batches(frames: Frames, size: int, decoder: StreamingDecoder, held: list[int]):
    for i in range(0, len(frames), size):
        held.append(decoder.held_frames)
        yield frames.select(i, i + size)


@pytest.mark.parametrize("dp,channels,proto,mirror,loss,dup,reorder", [
    (4, 1, "ll", "0:out,1:out,2:out", 1e-3, 0.0, 0.0),
    (8, 2, "ll", "0:out,3:out,5:both", 3e-3, 2e-3, 2e-3),
    (4, 1, "simple", "0:out,1:out", 2e-3, 0.0, 0.0),
])
def test_streaming_decode_equals_the_whole_capture_decode(tmp_path, dp, channels, proto, mirror, loss, dup, reorder):
    iters = 6
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=dp, iters=iters, channels=channels, proto=proto,
                              mirror=mirror, loss=loss, dup=dup, reorder=reorder, seed=dp + channels))
    job, frames = load_job(sim.job_path), arrival_order(sim.pcaps.values())
    whole_info = Decoded()
    whole = [_key(a) for a in decode(job, frames, whole_info)]
    assert len(whole) >= iters
    settle = float(frames.ts_ns.max() - frames.ts_ns.min()) / 1e9 / iters  # an iteration of the capture's time
    for size, workers in ((997, 1), (128, 1), (997, 2), (311, 4)):  # K workers: threaded parse, reassembly, merge
        info, held = Decoded(), []
        decoder = StreamingDecoder(job, info, settle_s=settle, min_frames=size, workers=workers)
        streamed = [_key(a) for a in decoder.run(_batches(frames, size, decoder, held))]
        assert streamed == whole, (size, workers)
        assert info.packets == whole_info.packets
        assert _lost_and_duplicated(info) == _lost_and_duplicated(whole_info)
        assert decoder.held_frames == 0 and decoder.next_index == len(whole) + 1
        assert max(held) < len(frames) // 2, "the window keeps what is in flight, not the capture"


def test_an_allreduce_is_handed_out_once_settled_and_never_before(tmp_path):
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=4, iters=2, seed=1))
    job, frames = load_job(sim.job_path), arrival_order(sim.pcaps.values())
    whole = list(decode(job, frames, Decoded()))
    now = [int(frames.ts_ns.max())]
    decoder = StreamingDecoder(job, settle_s=3600, min_frames=1, clock=lambda: now[0])
    assert decoder.feed(frames) == []  # the clock says nothing is an hour old yet
    assert decoder.feed(frames.select(0, 0)) == []  # a quiet poll: still too early
    now[0] += 3601 * 10**9
    settled = decoder.feed(frames.select(0, 0))  # a quiet poll an hour later: all of them
    assert [_key(a) for a in settled] == [_key(a) for a in whole]
    assert decoder.finish() == [] and decoder.held_frames == 0


def test_a_window_that_never_settles_stops_with_an_error(tmp_path):
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=4, iters=2, seed=2))
    job, frames = load_job(sim.job_path), arrival_order(sim.pcaps.values())
    decoder = StreamingDecoder(job, settle_s=3600, min_frames=10**9, max_window_bytes=int(frames.lengths.sum()) // 2)
    with pytest.raises(CaptureError, match="no allreduce settled"):
        for i in range(0, len(frames), 256):
            decoder.feed(frames.select(i, i + 256))


def test_streaming_options_are_checked(tmp_path):
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=2, iters=1, seed=3))
    with pytest.raises(ValueError, match="settle_s >= 0"):
        StreamingDecoder(load_job(sim.job_path), settle_s=-1)


def test_traffic_without_ring_connections_is_not_held(tmp_path):
    """Frames that never form a ring connection (other traffic on the mirror port) leave the window after a
    second of capture time instead of filling it."""
    from flowcheck.capture.mirror.frames import Endpoint, ud_frame

    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=2, iters=1, seed=4))
    a, b = Endpoint("02:00:00:00:00:0a", "fe80::a"), Endpoint("02:00:00:00:00:0b", "fe80::b")
    noise = [ud_frame(a, b, sport=5000 + k % 7) for k in range(3000)]
    frames = Frames.from_list(noise, [k * 10_000_000 for k in range(3000)])  # 30 s of management datagrams
    decoder = StreamingDecoder(load_job(sim.job_path), min_frames=100, max_window_bytes=200 * len(noise[0]))
    for i in range(0, len(frames), 100):
        assert decoder.feed(frames.select(i, i + 100)) == []
    assert decoder.held_frames <= 200 and decoder.finish() == []
    assert decoder.info.packets["OK"] == 3000


@pytest.mark.parametrize("dp,channels,proto,loss,dup,reorder", [
    (2, 1, "ll", 0.0, 0.0, 0.0),
    (4, 2, "simple", 2e-3, 1e-3, 1e-3),
    (8, 2, "ll", 3e-3, 2e-3, 2e-3),
])
def test_decode_with_k_parse_workers_equals_one_worker(tmp_path, monkeypatch, dp, channels, proto, loss, dup, reorder):
    """K = 1, 2, 4 threads in the first pass and in the merge of final sends give byte-identical reports and
    vectors (the parse threshold is lowered so the small simulated captures split too)."""
    import json

    from flowcheck.capture.mirror import roce
    from flowcheck.capture.mirror.decode import report

    monkeypatch.setattr(roce, "PARALLEL_MIN_FRAMES", 64)
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=dp, iters=3, channels=channels, proto=proto,
                              loss=loss, dup=dup, reorder=reorder, seed=7))
    job, frames = load_job(sim.job_path), read_all(sorted(sim.pcaps.values()))
    outs = []
    for k in (1, 2, 4):
        info = Decoded()
        ars = list(decode(job, frames, info, workers=k))
        outs.append((json.dumps(report(ars, info), sort_keys=True, default=str), [_key(a) for a in ars]))
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.parametrize("dp,channels,proto,loss,dup,reorder", [
    (4, 2, "simple", 2e-3, 1e-3, 1e-3),
    (8, 2, "ll", 3e-3, 2e-3, 2e-3),
])
def test_reassembly_on_k_threads_gives_the_same_tables(tmp_path, dp, channels, proto, loss, dup, reorder):
    """Streams reassembled on K native threads and concatenated: every table (messages, segments with their
    message ids, missing ranges, gaps, the per-frame stream and message ids) equals one thread's, byte for byte."""
    from flowcheck.capture.mirror import roce

    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=dp, iters=2, channels=channels, proto=proto,
                              loss=loss, dup=dup, reorder=reorder, seed=3))
    frames = read_all(sorted(sim.pcaps.values()))
    packets = roce.parse(frames)
    tables = []
    for k in (1, 2, 3, 8):
        r = roce.reassemble(frames, packets, workers=k)
        tables.append([x.tobytes() for x in (r.streams, r.messages, r.segments, r.missing, r.gaps, r.stream_of, r.message_of)])
    assert len(r.streams) > 2 and len(r.missing) and len(r.gaps)  # several streams, and losses to place around
    assert tables[0] == tables[1] == tables[2] == tables[3]
    with pytest.raises(ValueError, match="workers"):
        roce.reassemble(frames, packets, workers=0)


def test_decode_of_the_shared_real_captures_does_not_depend_on_parse_workers(monkeypatch, real_captures):
    import json

    from flowcheck.capture.mirror import roce
    from flowcheck.capture.mirror.decode import report

    monkeypatch.setattr(roce, "PARALLEL_MIN_FRAMES", 64)
    for name, pcap, job_path in real_captures:
        job, frames = load_job(job_path), read_all([pcap])
        outs = set()
        for k in (1, 2, 4):
            info = Decoded()
            ars = list(decode(job, frames, info, workers=k))
            outs.add(json.dumps(report(ars, info), sort_keys=True, default=str) + repr([_key(a) for a in ars]))
        assert len(outs) == 1, name
