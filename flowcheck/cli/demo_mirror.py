"""The mirror-capture half of `flowcheck demo`: simulate -> capture -> tiers -> diff against the trainer.

A 4-rank data-parallel GPT is trained by the simulator, which writes what the switch's mirror ports
of three ranks would copy (with a little packet loss); the capture pipeline rebuilds the training
state from those frames alone, commits steps to local and object tiers, and the last committed step
is compared bit for bit with the trainer's own state.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable

from flowcheck.config import (
    Config,
    LocalConfig,
    ObjectConfig,
    PolicyConfig,
    TierPolicy,
    TiersConfig,
)


def run_mirror_demo(workdir: str, *, iters: int = 20, loss: float = 0.02, echo: Callable[[str], None] = print) -> dict:
    from flowcheck.capture.decode import Decoded, decode, read_all
    from flowcheck.capture.job import load_job
    from flowcheck.capture.mirror import (
        ResyncSource,
        Updater,
        initial_replica,
        publish_to,
        run_pipeline,
    )
    from flowcheck.policy import PolicyRunner
    from flowcheck.restore.diff import diff_step, report
    from flowcheck.simulate import SimOptions, simulate
    from flowcheck.store import open_store

    base = os.path.join(os.path.abspath(workdir), "mirror")
    shutil.rmtree(base, ignore_errors=True)  # deterministic: each demo run rebuilds it from scratch
    echo(f"\n$ flowcheck simulate --dp 4 --iters {iters} --channels 2 --mirror 0:out,1:out,2:out --loss {loss} --out {base}/sim")
    sim = simulate(SimOptions(out=os.path.join(base, "sim"), dp=4, iters=iters, channels=2, mirror="0:out,1:out,2:out",
                              loss=loss, seed=1))
    echo(f"simulated {sim.job.nranks} DP ranks x {iters} iterations: {len(sim.allreduces)} allreduces, "
         f"{len(sim.pcaps)} mirror pcaps")
    cfg = Config(run="mirror", tiers=TiersConfig(local=LocalConfig(root=os.path.join(base, "local")),
                                                 object=ObjectConfig(url="file://" + os.path.join(base, "object"))),
                 policy=PolicyConfig(local=TierPolicy(every_steps=5, keep_last=5), object=TierPolicy(every_steps=10, keep_last=2)))
    store = open_store(cfg)
    job = load_job(sim.job_path)
    replica = initial_replica(job, None)
    runner = PolicyRunner(store).start()
    try:
        store.push(replica.snapshot(cfg.run))
        updater = Updater(job, replica, publish=publish_to(store, cfg.run, runner.on_step),
                          on_stale=lambda it, why: store.memory.mark_stale(why), resync=ResyncSource(job.resync))
        pcaps = sorted(sim.pcaps.values())
        echo(f"$ flowcheck capture --job {sim.job_path} --pcap {' '.join(os.path.basename(p) for p in pcaps)}")
        result = run_pipeline(decode(job, read_all(pcaps), Decoded()), updater)
        runner.flush()
    finally:
        runner.stop()
    last = store.local.latest()
    diffs = report(diff_step(store.local, store.local.manifest(last), os.path.join(sim.out, "truth", f"step-{last}.safetensors")))
    echo(f"rebuilt {result.iterations} iterations from the wire; {len(result.stale)} unrecoverable "
         f"(loss on every copy) -> stale, resynced from the trainer at steps {result.resyncs}; "
         f"local steps {store.local.steps()}")
    echo(f"$ flowcheck diff --step {last} --against truth/step-{last}.safetensors\n"
         f"step {last} == trainer's state bit for bit: {diffs['bit_exact']} ({diffs['counts']})")
    return {"iterations": result.iterations, "stale": result.stale, "resyncs": result.resyncs, "last_step": last,
            "exact": diffs["bit_exact"]}
