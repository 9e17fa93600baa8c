"""The column path of decode (connections whose messages are whole sends, matched and merged as arrays) gives what
the per-send object path (group_sends -> WireSend/SendPlacer, one Python object per send) gives: the same report, key
for key and in the same order, and the same vectors — on clean, lossy, duplicated and reordered captures, whole and
streamed, on one worker and several."""
from __future__ import annotations

import json

import pytest

from flowcheck.capture.mirror import roce, streams
from flowcheck.capture.mirror.decode import Decoded, decode, read_all, report
from flowcheck.capture.mirror.job import load_job
from flowcheck.capture.mirror.partition import Partition
from flowcheck.capture.mirror.send_columns import ColumnSources
from flowcheck.simulate import SimOptions, simulate


def _decode(job, frames, workers=1, partition=None) -> tuple[str, list]:
    info = Decoded()
    ars = list(decode(job, frames, info, workers=workers, partition=partition))
    # what a pipeline reads of the sources without building them (ColumnSources) is what the dicts say
    quick = [(a.latest_t0(), list(a.source_ranges())) for a in ars]
    vectors = [(a.index, a.data.tobytes(), a.copies.tobytes(), a.placed_bytes) for a in ars]
    out = json.dumps(report(ars, info), default=str), vectors + [info.placed_bytes]
    assert quick == [(max((s["t0"] for s in a.sources if s.get("t0") is not None), default=None),
                      [(*s.get("range", (0, 0)), s.get("elements_seen", 0)) for s in a.sources]) for a in ars]
    return out


def test_column_sources_are_built_on_first_use_and_hold_no_capture(tmp_path):
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=4, iters=2, seed=3))
    job, frames = load_job(sim.job_path), read_all(sorted(sim.pcaps.values()))
    ars = list(decode(job, frames, Decoded()))
    assert ars and all(isinstance(a.sources, ColumnSources) for a in ars)
    a = ars[0]
    assert a.sources._dicts is None and len(a.sources) > 0 and a.sources._dicts is None  # len builds nothing
    for block in a.sources.blocks:  # copies, not views of the window's tables
        assert all(x.base is None or x.base.nbytes < 1 << 20 for x in (block.first_psn, block.last_psn, block.t0))
    assert a.sources == list(a.sources) and a.sources[0]["elements_seen"] > 0 and a.sources._dicts is not None


def _both(monkeypatch, job, frames, **kw) -> tuple:
    columns = _decode(job, frames, **kw)
    with monkeypatch.context() as m:
        m.setattr(streams.MessageTable, "whole_sends", lambda self, ll: False)  # every connection through group_sends
        objects = _decode(job, frames, **kw)
    return columns, objects


@pytest.mark.parametrize("dp,channels,proto,mirror,loss,dup,reorder", [
    (2, 1, "ll", "", 0.0, 0.0, 0.0),
    (4, 2, "ll", "0:out,1:out,2:out", 3e-3, 2e-3, 2e-3),
    (8, 2, "ll", "0:out,3:out,5:both", 1e-2, 1e-3, 1e-3),
    (4, 1, "simple", "0:out,1:out", 2e-3, 1e-3, 0.0),
    (8, 2, "simple", "", 0.0, 0.0, 0.0),
])
def test_columns_equal_the_per_send_objects(tmp_path, monkeypatch, dp, channels, proto, mirror, loss, dup, reorder):
    monkeypatch.setattr(roce, "PARALLEL_MIN_FRAMES", 64)
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=dp, iters=3, channels=channels, proto=proto,
                              mirror=mirror or None, loss=loss, dup=dup, reorder=reorder, seed=dp + channels))
    job, frames = load_job(sim.job_path), read_all(sorted(sim.pcaps.values()))
    for workers in (1, 2):
        columns, objects = _both(monkeypatch, job, frames, workers=workers)
        assert columns == objects, workers
    part = Partition(1, 2)
    columns, objects = _both(monkeypatch, job, frames, partition=part)
    assert columns == objects


def test_columns_equal_the_per_send_objects_on_the_shared_real_captures(monkeypatch, real_captures):
    for name, pcap, job_path in real_captures:
        columns, objects = _both(monkeypatch, load_job(job_path), read_all([pcap]))
        assert columns == objects, name
