"""Trailing sends that repeat data already final (a modified NCCL re-sending final chunks after the last
allreduce) are re-sends, not a new allreduce with everything missing; trailing sends whose content is new
still make a truncated allreduce."""
from __future__ import annotations

import numpy as np
import pytest

from flowcheck.capture.mirror.decode import Decoded, decode, read_all
from flowcheck.capture.mirror.job import load_job
from flowcheck.capture.mirror.ring import ring_sends
from flowcheck.simulate import SimOptions, simulate
from flowcheck.simulate import run as sim_run
from flowcheck.simulate.traffic import Wire

from .test_streaming import _key, arrival_order
from flowcheck.capture.mirror.streaming import StreamingDecoder


def _simulate_with_trailing(tmp_path, monkeypatch, *, dp: int, proto: str, channels: int, fresh: bool, loss=0.0):
    """A run whose last allreduce is followed, on every ring link, by its final chunks sent again (``fresh``:
    by sends of the same sizes carrying new values — the start of an allreduce the capture cut off)."""
    last = {}
    original_allreduce, original_between = Wire.allreduce, sim_run._between_iterations

    def allreduce(self, red):
        original_allreduce(self, red)
        last["red"] = red

    def between(wire, it, options, rng):
        if it == options.iters:
            red, p = last["red"], last["red"].params
            t = wire.now + 10_000
            for (i, b), link in sorted(wire.links.items()):
                for k, send in enumerate(s for s in ring_sends(red.count, p, i, b) if s.final and s.count):
                    values = red.payload(i, send)
                    if fresh:
                        values = np.random.default_rng(k).standard_normal(values.size).astype(values.dtype)
                    wire.send(t + k * 200_000 + b * 90, link, values)
            wire.now = t + 10_000_000
        original_between(wire, it, options, rng)

    monkeypatch.setattr(Wire, "allreduce", allreduce)
    monkeypatch.setattr(sim_run, "_between_iterations", between)
    return simulate(SimOptions(out=str(tmp_path / "sim"), dp=dp, iters=3, proto=proto, channels=channels,
                               bucket_kb=1 << 20, loss=loss, seed=dp + channels))


@pytest.mark.parametrize("dp,proto,channels", [(2, "ll", 1), (4, "ll", 2), (4, "simple", 1), (8, "ll", 1)])
def test_resent_final_chunks_after_the_last_allreduce_are_not_a_new_allreduce(tmp_path, monkeypatch, dp, proto,
                                                                               channels):
    sim = _simulate_with_trailing(tmp_path, monkeypatch, dp=dp, proto=proto, channels=channels, fresh=False)
    job, frames = load_job(sim.job_path), read_all(sorted(sim.pcaps.values()))
    info = Decoded()
    got = list(decode(job, frames, info))
    assert [a.summary()["sha256"] for a in got] == [r["sha256"] for r in sim.allreduces]
    assert all(a.complete for a in got)
    # where the re-sent chunks have the sizes the next allreduce would start with, they are told apart by content
    assert {s["resend_of"] for s in info.skipped_sends if s.get("resend_of")} <= {len(sim.allreduces)}
    # what a live capture decodes gives the same
    arrival = arrival_order(sim.pcaps.values())
    streamed = list(StreamingDecoder(job, Decoded(), settle_s=1e-3, min_frames=256).run(
        arrival.select(i, i + 256) for i in range(0, len(arrival), 256)))
    assert [_key(a) for a in streamed] == [_key(a) for a in decode(job, arrival, Decoded())]


def test_trailing_sends_with_new_content_are_still_a_truncated_allreduce(tmp_path, monkeypatch):
    sim = _simulate_with_trailing(tmp_path, monkeypatch, dp=4, proto="ll", channels=1, fresh=True)
    job, frames = load_job(sim.job_path), read_all(sorted(sim.pcaps.values()))
    got = list(decode(job, frames, Decoded()))
    assert len(got) == len(sim.allreduces) + 1
    assert all(a.complete for a in got[:-1]) and not got[-1].complete
