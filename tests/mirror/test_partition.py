"""Scaled-out mirror capture, in one process: which parameters a part owns, what its decode places, the config."""
from __future__ import annotations

import glob

import numpy as np
import pytest

from flowcheck import config as config_mod
from flowcheck.capture.mirror.decode import Decoded, decode, read_all
from flowcheck.capture.mirror.job import load_job
from flowcheck.capture.mirror.partition import NormExchange, Partition, owners
from flowcheck.errors import ConfigError, JobError
from flowcheck.simulate import SimOptions, simulate


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    out = simulate(SimOptions(out=str(tmp_path_factory.mktemp("sim")), dp=4, iters=2, seed=2, clip=None))
    return load_job(f"{out.out}/job.yaml"), read_all(sorted(glob.glob(f"{out.out}/mirror-*.pcap")))


def test_parts_are_contiguous_runs_of_the_allreduce_order_of_about_equal_size(sim):
    job, _ = sim
    numel = {p.name: p.numel for p in job.parameters}
    order = [n for b in job.buckets for n in b.params]
    for k in (2, 3):
        own = owners(job, k)
        assert [own[n] for n in order] == sorted(own[n] for n in order)  # contiguous, in allreduce order
        sizes = [sum(numel[n] for n in own if own[n] == i) for i in range(k)]
        assert max(sizes) < 1.5 * sum(sizes) / k, sizes
        assert set().union(*(Partition(i, k).owned(job) for i in range(k))) == set(numel)


def test_a_part_decodes_exactly_its_parameters_and_places_about_half(sim):
    job, frames = sim
    whole_info = Decoded()
    whole = list(decode(job, frames, whole_info))
    placed = []
    for i in range(2):
        info = Decoded()
        part = list(decode(job, frames, info, partition=Partition(i, 2)))
        placed.append(info.placed_bytes)
        assert [(a.iteration, a.bucket) for a in part] == [(a.iteration, a.bucket) for a in whole]
        for mine, full in zip(part, whole):
            assert mine.complete and mine.owned is not None
            for a, b in mine.owned:  # the owned elements are the whole decode's, bit for bit
                assert np.array_equal(mine.data[a:b].view(np.uint32), full.data[a:b].view(np.uint32))
    assert sum(placed) >= whole_info.placed_bytes
    assert all(0.4 * whole_info.placed_bytes < p < 0.65 * whole_info.placed_bytes for p in placed), placed


def test_partition_ranges_follow_the_bucket_layout(sim):
    job, _ = sim
    first = job.plan(1)[0]
    owned = Partition(1, 2).owned(job)
    ranges = Partition(1, 2).ranges(job, first)
    numel = {p.name: p.numel for p in job.parameters}
    assert sum(b - a for a, b in ranges) == sum(numel[n] for n in owned)
    assert Partition().ranges(job, first) == [(0, first.elements)] and Partition().whole


@pytest.mark.parametrize("index,of", [(2, 2), (-1, 2), (0, 0), (True, 2)])
def test_bad_partitions_are_refused(index, of):
    with pytest.raises(JobError, match="mirror partition"):
        Partition(index, of)


def test_more_parts_than_parameters_is_refused(sim):
    job, _ = sim
    with pytest.raises(JobError, match="at most one part per parameter"):
        owners(job, len(job.parameters) + 1)


def test_norm_exchange_round_trips_float32_bits_and_times_out(tmp_path):
    a, b = (NormExchange(str(tmp_path), Partition(i, 2), wait_s=0.2) for i in range(2))
    a.publish(7, {"x": 0.1, "y": 3.0e-30})
    assert a.gather(7) is None  # part 1 never reported
    b.publish(7, {"z": 2.5})
    got = b.gather(7)
    assert got == {"x": float(np.float32(0.1)), "y": float(np.float32(3.0e-30)), "z": 2.5}
    with pytest.raises(JobError, match="exchange directory"):
        NormExchange("", Partition(0, 2))


def test_config_partition_needs_a_cluster_of_that_many_nodes(tmp_path):
    base = "run: r\ntiers: {local: {root: ./l}, object: {url: file://./o}}\n"
    (tmp_path / "bad.yaml").write_text(base + "serve: {mirror_partition: {index: 0, of: 2}}\n")
    with pytest.raises(ConfigError, match="cluster.nodes to list at least 2 nodes"):
        config_mod.load(str(tmp_path / "bad.yaml"))
    (tmp_path / "range.yaml").write_text(base + "serve: {mirror_partition: {index: 2, of: 2}}\n")
    with pytest.raises(ConfigError, match="0 <= index < of"):
        config_mod.load(str(tmp_path / "range.yaml"))
    (tmp_path / "ok.yaml").write_text(base + "node: a\ncluster: {nodes: [a, b]}\n"
                                      "serve: {mirror_partition: {index: 1, of: 2, exchange: ./ex}}\n")
    part = config_mod.load(str(tmp_path / "ok.yaml")).serve.mirror_partition
    assert (part.index, part.of, part.exchange) == (1, 2, str(tmp_path / "ex"))


def test_the_example_mirror_node_config_loads():
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = config_mod.load(os.path.join(root, "configs", "mirror-node.yaml"))
    part = cfg.serve.mirror_partition
    assert (part.index, part.of) == (0, 2) and cfg.node in cfg.cluster.nodes


def test_a_streaming_decode_of_a_part_gives_what_the_whole_capture_decode_of_it_gives(sim):
    from flowcheck.capture.mirror.streaming import StreamingDecoder

    job, frames = sim
    part = Partition(1, 2)
    whole_info, stream_info = Decoded(), Decoded()
    whole = list(decode(job, frames, whole_info, partition=part))
    batches = (frames.select(i, min(i + 997, len(frames))) for i in range(0, len(frames), 997))
    streamed = list(StreamingDecoder(job, stream_info, min_frames=997, partition=part).run(batches))
    assert [(a.iteration, a.bucket, a.complete) for a in streamed] == [(a.iteration, a.bucket, a.complete) for a in whole]
    for s, w in zip(streamed, whole):
        for a, b in w.owned:
            assert np.array_equal(s.data[a:b].view(np.uint32), w.data[a:b].view(np.uint32))
    assert stream_info.placed_bytes == whole_info.placed_bytes


def test_a_live_part_settles_allreduces_it_owns_nothing_of_by_the_clock(sim):
    """An allreduce of only another part's parameters has no send this part merges; the time of the sends it skips
    still settles it (else a live node would wait for it forever)."""
    from flowcheck.capture.mirror.streaming import StreamingDecoder

    job, frames = sim
    whole = list(decode(job, frames, Decoded(), partition=Partition(1, 2)))
    assert any(not a.owned for a in whole)  # this capture has such an allreduce
    now = [int(frames.ts_ns.max())]
    decoder = StreamingDecoder(job, settle_s=3600, min_frames=1, clock=lambda: now[0], partition=Partition(1, 2))
    assert decoder.feed(frames) == []
    now[0] += 3601 * 10**9
    settled = decoder.feed(frames.select(0, 0))  # a quiet poll an hour later: every one, before finish()
    assert [(a.iteration, a.bucket) for a in settled] == [(a.iteration, a.bucket) for a in whole]
