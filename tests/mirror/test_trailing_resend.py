"""A step after the last allreduce that re-sends the final chunk each rank received (an NCCL that adds that step),
cut anywhere by the end of the capture, never makes an allreduce: the decode gives exactly the allreduces the traffic
carried and says it saw a trailing re-send.  The first step of a genuine next allreduce cut off the same way, and data
lost from the last allreduce, are still reported as before."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from flowcheck.capture.mirror import roce
from flowcheck.capture.mirror.anomalies import TrailingResend
from flowcheck.capture.mirror.decode import Decoded, concat_frames, decode
from flowcheck.capture.mirror.job import load_job
from flowcheck.capture.mirror.pcap import Frames, PcapWriter, read_capture
from flowcheck.capture.mirror.streaming import StreamingDecoder
from flowcheck.cli import main
from flowcheck.simulate import SimOptions, simulate

from .test_streaming import _key

# (dp, channels, bucket KiB, protocol): 2x2 with one bucket per iteration: the re-sends have the size and layout of the
# next allreduce's first step (the case seen on a real capture); 2x2 with 8 KiB buckets: the last bucket's re-send on
# channel 1 is a 0-byte write, and on channel 0 one rank's re-send has another size than the next first step; 2x1:
# a two-loop bucket; 4x3 and Simple for any ring and channel count
CONFIGS = [(2, 2, 128, "ll"), (2, 2, 8, "ll"), (2, 1, 128, "ll"), (4, 3, 64, "ll"), (2, 2, 128, "simple")]
_RUNS: dict[tuple, object] = {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    def run(dp: int, channels: int, bucket_kb: int, proto: str, tail: str):
        key = (dp, channels, bucket_kb, proto, tail)
        if key not in _RUNS:
            out = str(tmp_path_factory.mktemp("tail") / "-".join(map(str, key)))
            _RUNS[key] = simulate(SimOptions(out=out, dp=dp, iters=2, channels=channels, bucket_kb=bucket_kb,
                                             proto=proto, tail=tail, seed=dp * 10 + channels))
        return _RUNS[key]
    return run


def _ports(sim, keep: int | None, drop: dict[str, int] | None = None) -> list[Frames]:
    """Each mirror port's capture ending after the first ``keep`` frames of its tail (None: all of it); ``drop``:
    a frame index to leave out, per port file name."""
    out = []
    for name, rec in sorted(sim.injected["pcaps"].items()):
        frames = read_capture(os.path.join(sim.out, name))
        n = rec["written"] - rec["tail_written"] + (rec["tail_written"] if keep is None else min(keep, rec["tail_written"]))
        kept = [i for i in range(n) if (drop or {}).get(name) != i]
        out.append(Frames.from_list([frames.frame(i) for i in kept], frames.ts_ns[kept].tolist(), name))
    return out


def _decode(sim, ports: list[Frames]):
    info = Decoded()
    got = list(decode(load_job(sim.job_path), concat_frames(ports, "cut"), info))
    return got, info


def _cuts(sim) -> list[int | None]:
    """Where the capture ends in the tail: before it, after the flow-control posts, after a data packet or two,
    inside a multi-packet write (a frame group cut), one frame short, after all of it."""
    shortest = min(rec["tail_written"] for rec in sim.injected["pcaps"].values())
    return sorted({0, 1, 2, 3, 5, shortest // 2, max(0, shortest - 1)}) + [None]


def _resends(info: Decoded) -> list[dict]:
    return [a.to_json() for a in info.anomalies if isinstance(a, TrailingResend)]


@pytest.mark.parametrize("dp,channels,bucket_kb,proto", CONFIGS)
def test_a_trailing_resend_cut_anywhere_is_never_an_allreduce(runs, dp, channels, bucket_kb, proto):
    sim = runs(dp, channels, bucket_kb, proto, "resend")
    truth = [r["sha256"] for r in sim.allreduces]
    for keep in _cuts(sim):
        got, info = _decode(sim, _ports(sim, keep))
        assert [a.summary().get("sha256") for a in got] == truth, keep
        assert all(a.complete for a in got), keep
        resends = _resends(info)
        assert {a["resend_of"] for a in resends} <= {len(truth)}
        assert {(a["stream"], a["step"]) for a in resends} == \
            {(s["stream"], s["step"]) for s in info.skipped_sends if s.get("resend_of")}
        if keep is None:  # whole: every mirrored ring connection re-sent once, its 0-byte writes included
            mirrored = {s.stream for s in info.streams if s.role == "ring"}
            assert sorted(a["stream"] for a in resends) == sorted(mirrored)
            assert all(a["allreduce_step"] > 2 * (dp - 1) for a in resends)  # the step after the allreduce's last
    if (dp, channels) == (2, 2):  # one loop: the allreduce's two steps, then the re-send
        assert "trailing re-send of step 3 of allreduce" in resends[0]["detail"]


def test_the_zero_byte_resend_on_channel_1_is_recognised(runs):
    sim = runs(2, 2, 8, "ll", "resend")
    got, info = _decode(sim, _ports(sim, None))
    empty = [a for a in _resends(info) if a["range"][0] == a["range"][1]]
    assert empty and all(s["wire_bytes"] == 0 for s in info.skipped_sends
                         if s.get("resend_of") and (s["stream"], s["step"]) in {(a["stream"], a["step"]) for a in empty})


@pytest.mark.parametrize("dp,channels,bucket_kb,proto", CONFIGS)
def test_a_genuine_next_allreduce_cut_off_is_still_reported(runs, dp, channels, bucket_kb, proto):
    sim = runs(dp, channels, bucket_kb, proto, "next")
    truth = [r["sha256"] for r in sim.allreduces]
    # past each port's flow-control posts (one per channel): every port holds a data packet of it
    for keep in [k for k in _cuts(sim) if k is None or k > channels]:
        got, info = _decode(sim, _ports(sim, keep))
        assert len(got) == len(truth) + 1, keep
        assert [a.summary().get("sha256") for a in got[:-1]] == truth
        assert not got[-1].complete and got[-1].missing() and not _resends(info)


def _last_write_middle(frames: Frames, before: int) -> int:
    """Index of the last WRITE_MIDDLE packet among the first ``before`` frames (a data packet of the last
    allreduce's final send on a port that mirrors what its rank sends)."""
    table = roce.parse(frames.select(0, before)).table
    return int(np.flatnonzero(table["opcode"] == 7)[-1])


def test_data_lost_from_the_last_allreduce_is_still_reported(runs, tmp_path):
    sim = runs(2, 2, 128, "ll", "resend")
    name = "mirror-r0-out.pcap"
    rec = sim.injected["pcaps"][name]
    lost = _last_write_middle(read_capture(os.path.join(sim.out, name)), rec["written"] - rec["tail_written"])
    with_tail, info = _decode(sim, _ports(sim, None, {name: lost}))
    without, _ = _decode(sim, _ports(sim, 0, {name: lost}))
    assert len(with_tail) == len(sim.allreduces) and not with_tail[-1].complete
    assert [_key(a) for a in with_tail] == [_key(a) for a in without]
    assert _resends(info)  # the re-sends are still told apart, and fill nothing in
    paths = _write_pcaps(_ports(sim, None, {name: lost}), tmp_path)
    r = CliRunner().invoke(main, ["decode", "--job", sim.job_path, "--pcap", *paths, "--json"])
    assert r.exit_code == 3, r.output
    assert not json.loads(r.output)["allreduces"][-1]["complete"]


def test_decode_cli_exits_0_and_says_it_saw_the_resend(runs, tmp_path):
    sim = runs(2, 2, 128, "ll", "resend")
    paths = _write_pcaps(_ports(sim, 5), tmp_path)
    r = CliRunner().invoke(main, ["decode", "--job", sim.job_path, "--pcap", *paths, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert len(out["allreduces"]) == len(sim.allreduces)
    assert any(a["type"] == "trailing_resend" and "trailing re-send of step 3" in a["detail"] for a in out["anomalies"])
    r = CliRunner().invoke(main, ["decode", "--job", sim.job_path, "--pcap", *paths])
    assert r.exit_code == 0 and "trailing re-send of step 3" in r.output


@pytest.mark.parametrize("tail", ["resend", "next"])
def test_a_streaming_decode_gives_the_same(runs, tail):
    """The last allreduce is handed out (by the clock, the link quiet) before the tail arrives: the re-sends are
    then told apart in a window of their own."""
    sim = runs(2, 2, 8, "ll", tail)
    frames = concat_frames(_ports(sim, 5), "cut")
    order = np.argsort(frames.ts_ns, kind="stable")
    arrival = Frames.from_list([frames.frame(int(i)) for i in order], frames.ts_ns[order].tolist(), "merged")
    whole, whole_info = _decode(sim, [arrival])
    tail_at = min(int(read_capture(os.path.join(sim.out, name)).ts_ns[rec["written"] - rec["tail_written"]])
                  for name, rec in sim.injected["pcaps"].items())
    head = int(np.searchsorted(arrival.ts_ns, tail_at))
    now = [0]
    info = Decoded()
    decoder = StreamingDecoder(load_job(sim.job_path), info, settle_s=3e-3, min_frames=256, clock=lambda: now[0])
    streamed = [a for i in range(0, head, 256) for a in decoder.feed(arrival.select(i, min(i + 256, head)))]
    now[0] = int(arrival.ts_ns[head - 1]) + 10**9
    streamed += decoder.feed(arrival.select(head, head))  # quiet: what waits is settled by the clock
    assert len(streamed) == len(sim.allreduces)
    streamed += decoder.feed(arrival.select(head)) + decoder.finish()
    assert [_key(a) for a in streamed] == [_key(a) for a in whole]
    assert len(whole) == len(sim.allreduces) + (tail == "next")
    # (a window holding nothing of a connection but a 0-byte LL write cannot tell it is a ring connection: such
    # re-sends are labelled by the whole-capture decode only; they carry nothing)
    assert _with_data(info) == _with_data(whole_info) and bool(_with_data(info)) == (tail == "resend")


def _with_data(info: Decoded) -> list[tuple[str, int]]:
    return sorted((a["stream"], a["step"]) for a in _resends(info) if a["range"][1] > a["range"][0])


@pytest.mark.parametrize("channels,bucket_kb", [(2, 128), (2, 8), (1, 8)])
def test_resends_after_every_allreduce_never_shift_the_next_one(tmp_path, monkeypatch, channels, bucket_kb):
    """An NCCL that adds the re-send step to every allreduce: where the re-send has the size of the next allreduce's
    first step (2x2, one bucket per iteration: every chunk the same size), the next allreduce must not match one step
    early — it would take partial sums for final values and look complete."""
    from flowcheck.simulate.traffic import Wire

    allreduce = Wire.allreduce

    def with_resend(self, red):
        allreduce(self, red)
        self.tail(red, "resend")

    monkeypatch.setattr(Wire, "allreduce", with_resend)
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=2, iters=3, channels=channels, bucket_kb=bucket_kb, seed=1))
    ports = _ports(sim, None)
    got, info = _decode(sim, ports)
    assert [a.summary().get("sha256") for a in got] == [r["sha256"] for r in sim.allreduces]
    # where a re-send could be the next allreduce's start it is reported (the others do not fit it: other sends);
    # the last allreduce's always is
    resent = {a["resend_of"] for a in _resends(info) if a["range"][1] > a["range"][0]}
    assert resent == set(range(1, len(sim.allreduces) + 1)) if (channels, bucket_kb) == (2, 128) else \
        len(sim.allreduces) in resent
    frames = concat_frames(ports, "all")
    order = np.argsort(frames.ts_ns, kind="stable")
    arrival = Frames.from_list([frames.frame(int(i)) for i in order], frames.ts_ns[order].tolist(), "merged")
    streamed = list(StreamingDecoder(load_job(sim.job_path), Decoded(), settle_s=3e-3, min_frames=256).run(
        arrival.select(i, i + 256) for i in range(0, len(arrival), 256)))
    assert [_key(a) for a in streamed] == [_key(a) for a in _decode(sim, [arrival])[0]]


def _write_pcaps(ports, folder) -> list[str]:
    """Each mirror port's frames as a pcap file in ``folder``, for the CLI."""
    paths = []
    for frames in ports:
        paths.append(str(folder / frames.source))
        with PcapWriter(paths[-1]) as w:
            for i in range(len(frames)):
                w.write(frames.frame(i), int(frames.ts_ns[i]))
    return paths
