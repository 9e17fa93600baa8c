"""The mirror-capture half of the demo: simulate -> capture -> tiers -> diff against the trainer.

A 4-rank data-parallel GPT is trained by the simulator, which writes what the switch's mirror ports
of three ranks would copy (with a little packet loss injected); the capture pipeline rebuilds the
training state from those frames alone, commits steps to its own store (``WORKDIR/mirror/flowcheck.yaml``),
and the last committed step is compared bit for bit with the trainer's own state.  An iteration whose
frames were lost on every copy cannot be rebuilt: it is marked stale and resynced from the trainer's
full state, as the injected loss makes expected.
"""
from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from flowcheck.config import (
    Config,
    LocalConfig,
    ObjectConfig,
    PolicyConfig,
    TierPolicy,
    TiersConfig,
)
from flowcheck.demo.checks import Check, command
from flowcheck.demo.setup import write_config

ITERS, DP, CHANNELS, MIRROR, LOSS, SEED = 20, 4, 2, "0:out,1:out,2:out", 0.02, 1
# the loggers that report an iteration lost on every copy (as a WARNING: in production nobody injected it)
_LOSS_LOGGERS = ("flowcheck.capture.mirror.pipeline", "flowcheck.tiers.memory", "flowcheck.policy")


def mirror_config(base: str) -> Config:
    return Config(run="mirror", tiers=TiersConfig(local=LocalConfig(root=os.path.join(base, "local")),
                                                  object=ObjectConfig(url="file://" + os.path.join(base, "object"))),
                  policy=PolicyConfig(local=TierPolicy(every_steps=5, keep_last=5),
                                      object=TierPolicy(every_steps=10, keep_last=2)))


def run_mirror(workdir: str) -> tuple[Check, ...]:
    """The three steps of the mirror half as checks (simulate, capture, diff), in order."""
    from flowcheck.simulate import SimOptions, simulate

    base = os.path.join(os.path.abspath(workdir), "mirror")
    shutil.rmtree(base, ignore_errors=True)  # deterministic: each demo run rebuilds it from scratch
    os.makedirs(base)
    cfg_path = os.path.join(base, "flowcheck.yaml")
    write_config(mirror_config(base), cfg_path)
    sim_dir = os.path.join(base, "sim")
    sim = simulate(SimOptions(out=sim_dir, dp=DP, iters=ITERS, channels=CHANNELS, mirror=MIRROR, loss=LOSS, seed=SEED))
    dropped = sum(p["dropped"] for p in sim.injected["pcaps"].values())
    said = (f"simulated {sim.job.nranks} DP ranks x {ITERS} iterations: {len(sim.allreduces)} allreduces, "
            f"{len(sim.pcaps)} mirror pcaps, {dropped} frames dropped at the mirror ports (--loss {LOSS})")
    simulated = Check("simulate", True, "", command=command(
        "simulate", "--dp", str(DP), "--iters", str(ITERS), "--channels", str(CHANNELS), "--mirror", MIRROR,
        "--loss", str(LOSS), "--seed", str(SEED), "--out", sim_dir), report=(said,))
    pcaps = sorted(sim.pcaps.values())
    captured, store, last = _capture(cfg_path, sim.job_path, pcaps)
    return simulated, captured, _diff(cfg_path, store, last, os.path.join(sim_dir, "truth", f"step-{last}.safetensors"))


def _capture(cfg_path: str, job_path: str, pcaps: list[str]):
    """What ``flowcheck capture --config CFG --job JOB --pcap ...`` does, its loss warnings gathered."""
    from flowcheck.capture.mirror.decode import Decoded, decode, read_all
    from flowcheck.capture.mirror.job import load_job
    from flowcheck.capture.mirror.pipeline import MirrorSession
    from flowcheck.policy import PolicyRunner
    from flowcheck.store import open_store

    store = open_store(cfg_path)
    job = load_job(job_path)
    runner = PolicyRunner(store).start()
    try:
        with _gathered(_LOSS_LOGGERS):
            session = MirrorSession(job, store, on_step=runner.on_step,
                                    on_stale=lambda it, why: store.memory.mark_stale(why))
            result = session.run(decode(job, read_all(pcaps), Decoded()))
            runner.flush()
    finally:
        runner.stop()
    stale = [s.iteration for s in result.stale]
    resynced = sorted(set(stale)) == sorted(set(result.resyncs))
    lost = (f"{len(stale)} iterations ({', '.join(map(str, stale))}) lost on every copy, as injected: marked stale "
            f"(never snapshotted) and resynced from the trainer's full state" if stale
            else "no iteration lost on every copy")
    lines = (f"rebuilt {result.iterations} iterations from the wire; {lost}; local steps {store.local.steps()}",)
    ok = resynced and not store.memory.stale
    problem = "" if ok else f"stale iterations {stale} but resyncs at {result.resyncs}"
    cmd = command("capture", "--config", cfg_path, "--job", job_path, "--pcap", *pcaps)
    return Check("capture", ok, "", problem, cmd, lines), store, store.local.latest()


def _diff(cfg_path: str, store, last: int, truth: str) -> Check:
    """What ``flowcheck diff --step LAST --branch main --against TRUTH`` does.  ``--branch main``: the demo
    captured into an empty store; a capture run again into it makes a branch of its own (a second lineage of
    the same steps), and the printed command still names this one."""
    from flowcheck.restore.diff import diff_step, report
    from flowcheck.restore.source import open_step

    tier, manifest = open_step(store, last, "auto", "main")
    diffs = report(diff_step(tier, manifest, truth))
    ok = diffs["bit_exact"]
    line = f"step {last} == the simulated trainer's state bit for bit: {ok} ({diffs['counts']})"
    return Check("mirror", ok, f"state rebuilt from mirrored frames == trainer's (step {last})",
                 "" if ok else f"step {last} differs from the trainer's state: {diffs['counts']}",
                 command("diff", "--step", str(last), "--branch", "main", "--against", truth, "--config", cfg_path),
                 (line,))


@contextmanager
def _gathered(names: tuple[str, ...]) -> Iterator[list[logging.LogRecord]]:
    """Hold back (and collect) these loggers' reports of an iteration lost on every copy, and of a timed
    snapshot skipped while the state it left stale waits for its resync: the demo injected the loss, and says so
    itself; anything else they log goes through."""
    records: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        skipped_stale = getattr(record, "event", None) == "snapshot_skipped" and "is stale" in message
        if "unrecoverable" in message or "marked stale" in message or skipped_stale:
            records.append(record)
            return False
        return True

    loggers = [logging.getLogger(n) for n in names]
    for lg in loggers:
        lg.addFilter(hold)
    try:
        yield records
    finally:
        for lg in loggers:
            lg.removeFilter(hold)
