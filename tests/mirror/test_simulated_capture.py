"""Mirror capture against the simulator: the replica equals the trainer bit for bit, or says it cannot.

Every step the updater publishes is compared with the simulator's truth for that step; an
iteration that loses data on every copy must show up as stale + resynced, never as a wrong step.
"""
from __future__ import annotations

import os

import pytest
import torch

from flowcheck.capture.mirror.decode import Decoded, decode, read_all
from flowcheck.capture.mirror.job import load_job
from flowcheck.capture.mirror.pipeline import ResyncSource, Updater, initial_replica, load_state_file, run_pipeline
from flowcheck.simulate import SimOptions, simulate

ITERS = int(os.environ.get("FLOWCHECK_SIM_ITERS", "50"))


def _replay(sim, resync: bool = True):
    """Decode + update the simulator's pcaps; returns (report, {step: state published})."""
    published = {}
    stale = []

    def publish(replica):
        published[replica.step] = {k: v.clone() for k, v in replica.state().items()}

    job = load_job(sim.job_path)  # as a user would: init/resync relative to the file
    updater = Updater(job, initial_replica(job, None), publish=publish, on_stale=lambda it, why: stale.append(it),
                      resync=ResyncSource(job.resync if resync else None))
    info = Decoded()
    report = run_pipeline(decode(job, read_all(sorted(sim.pcaps.values())), info), updater)
    return report, published, info


def _assert_all_exact(sim, published):
    for step, state in published.items():
        truth = load_state_file(os.path.join(sim.out, "truth", f"step-{step}.safetensors"))
        assert set(state) == set(truth), step
        for name, t in truth.items():
            mine = state[name].reshape(t.shape)
            assert mine.dtype == t.dtype and mine.reshape(-1).view(torch.uint8).equal(t.reshape(-1).view(torch.uint8)), (step, name)


@pytest.mark.parametrize("dp,channels,proto,optimizer", [
    (2, 1, "ll", "sgd"), (4, 2, "ll", "adam"), (8, 2, "ll", "adamw"),
    (2, 2, "simple", "adamw"), (4, 1, "simple", "sgd"), (8, 1, "simple", "adam"),
])
def test_replica_equals_trainer_bit_for_bit_after_training(tmp_path, dp, channels, proto, optimizer):
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=dp, iters=ITERS, channels=channels, proto=proto,
                              optimizer=optimizer, seed=dp))
    report, published, info = _replay(sim, resync=False)
    assert report.stale == [] and report.iterations == ITERS
    assert sorted(published) == list(range(1, ITERS + 1))
    _assert_all_exact(sim, published)


@pytest.mark.parametrize("loss", [1e-4, 1e-3, 1e-2])
@pytest.mark.parametrize("mirrored", [1, 2, 3])
def test_loss_never_yields_a_silently_wrong_step(tmp_path, mirrored, loss):
    mirror = ",".join(f"{r}:out" for r in range(mirrored))
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=4, iters=10, mirror=mirror, loss=loss, reorder=1e-3,
                              dup=1e-3, seed=7 + mirrored))
    report, published, _ = _replay(sim)
    _assert_all_exact(sim, published)  # exact, every one of them
    # every iteration is accounted for: applied from the wire, or stale and resynced from the trainer's state
    assert report.iterations + len(report.stale) == 10
    assert sorted(s.step for s in report.stale) == report.resyncs
    if mirrored == 1:  # one outbound stream never carries its successor's final chunk
        assert report.iterations == 0


def test_an_unrecoverable_iteration_without_resync_leaves_the_state_stale(tmp_path):
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=4, iters=3, mirror="0:out"))
    report, published, _ = _replay(sim, resync=False)
    assert published == {} and len(report.stale) == 1 and report.skipped == 2 and report.iterations == 0


def test_cli_simulate_capture_diff(tmp_path):
    from click.testing import CliRunner

    from flowcheck.cli import main

    run = CliRunner().invoke
    sim = tmp_path / "sim"
    r = run(main, ["simulate", "--dp", "2", "--iters", "4", "--channels", "2", "--loss", "0.001", "--out", str(sim)])
    assert r.exit_code == 0, r.output
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: sim\ntiers: {local: {root: ./loc}, object: {url: file://./obj}}\n")
    pcaps = sorted(str(p) for p in sim.glob("mirror-*.pcap"))
    r = run(main, ["capture", "--config", str(cfg), "--job", str(sim / "job.yaml"), "--pcap", *pcaps, "--json"])
    assert r.exit_code == 0, r.output
    r = run(main, ["diff", "--config", str(cfg), "--step", "latest", "--against", str(sim / "truth" / "step-4.safetensors")])
    assert r.exit_code == 0 and "bit-exact" in r.output, r.output
    r = run(main, ["decode", "--job", str(sim / "job.yaml"), "--pcap", *pcaps, "--json"])
    assert r.exit_code in (0, 3) and '"allreduces"' in r.output
    # the same capture on two decode workers (threaded parse, reassembly, merge): the same report, the same state
    one = r.output
    r = run(main, ["decode", "--job", str(sim / "job.yaml"), "--pcap", *pcaps, "--json", "--workers", "2"])
    assert r.exit_code in (0, 3) and r.output == one
    cfg2 = tmp_path / "c2.yaml"
    cfg2.write_text("run: sim\ntiers: {local: {root: ./loc2}, object: {url: file://./obj2}}\n")
    r = run(main, ["capture", "--config", str(cfg2), "--job", str(sim / "job.yaml"), "--pcap", *pcaps, "--json",
                   "--decode-workers", "2"])
    assert r.exit_code == 0, r.output
    r = run(main, ["diff", "--config", str(cfg2), "--step", "latest", "--against", str(sim / "truth" / "step-4.safetensors")])
    assert r.exit_code == 0 and "bit-exact" in r.output, r.output


@pytest.mark.parametrize("seed,iters", [(5, 14), (2, 22)])
def test_lost_boundary_packets_never_shift_an_allreduce_onto_another(tmp_path, seed, iters):
    """Regressions found by the loss sweep (BENCHMARKS.md): at 1% loss the packets delimiting two sends
    were lost together; the decoder merged them, skipped ahead and labelled one iteration's buckets as
    another's (seed 5), or shifted a stream's steps (seed 2)."""
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=8, iters=iters, mirror="0:out,1:out,2:out", loss=0.01,
                              seed=seed))
    truth = {(a["iteration"], a["bucket"]): a["sha256"] for a in sim.allreduces}
    job = load_job(sim.job_path)
    pcaps = [sim.pcaps[k] for k in sorted(sim.pcaps)]
    for m in (2, 3):
        got = list(decode(job, read_all(pcaps[:m]), Decoded()))
        assert len(got) == len(truth)
        wrong = [a.index for a in got if a.complete and a.summary()["sha256"] != truth[(a.iteration, a.bucket)]]
        assert wrong == [], f"m={m}: complete but wrong: {wrong}"
        if m == 3:
            assert sum(not a.complete for a in got) <= 2  # no lasting misalignment


def test_a_capture_into_a_run_that_holds_its_step_number_keeps_both_states(tmp_path):
    """Issue reproduction: a state stored at step 4, then a capture whose 4th iteration is step 4 — the
    captured state was never written. Now it lands on a new root branch, bit-exact, and is what `latest`
    and `--step 4` mean; the first state stays on main."""
    from click.testing import CliRunner

    from flowcheck.cli import main
    from flowcheck.store import open_store

    run = CliRunner().invoke
    sim = tmp_path / "sim"
    assert run(main, ["simulate", "--dp", "2", "--iters", "4", "--channels", "2", "--out", str(sim)]).exit_code == 0
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: sim\ntiers: {local: {root: ./loc}, object: {url: file://./obj}}\n")
    other = str(sim / "truth" / "step-2.safetensors")
    r = run(main, ["snapshot", "--config", str(cfg), "--state", other, "--step", "4"])
    assert r.exit_code == 0, r.output
    pcaps = sorted(str(p) for p in sim.glob("mirror-*.pcap"))
    r = run(main, ["capture", "--config", str(cfg), "--job", str(sim / "job.yaml"), "--pcap", *pcaps, "--json"])
    assert r.exit_code == 0, r.output
    truth = str(sim / "truth" / "step-4.safetensors")
    for step in ("4", "latest"):
        r = run(main, ["diff", "--config", str(cfg), "--step", step, "--against", truth])
        assert r.exit_code == 0 and "bit-exact" in r.output, r.output
    r = run(main, ["diff", "--config", str(cfg), "--step", "4", "--branch", "main", "--against", other])
    assert r.exit_code == 0 and "bit-exact" in r.output, r.output
    hist = open_store(str(cfg)).history()
    assert hist.current() == "root-4" and hist.records["root-4"].fork is None
