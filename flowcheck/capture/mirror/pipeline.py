"""Mirror capture end to end: allreduces in, a RAM replica advanced per iteration, steps committed by policy.

Stages run pipelined as in FlowCheck's design: the decoder (reader -> native parse -> reassemble
-> assemble) feeds complete allreduces into a bounded queue; the updater thread applies each
bucket as it arrives and, when an iteration's last bucket is in, publishes the new step to the
memory tier and lets the policy snapshot it.  An iteration with any incomplete bucket marks the
state stale (no snapshot can be taken of it), a resync is requested, and — when a source of full
states is at hand (the trainer's push; offline: the job's ``resync`` directory) — the replica
restarts from the trainer's state after that iteration.

What went through and what loss did is counted by ``flowcheck.capture.mirror.stats`` (the node's metrics).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from flowcheck.capture.mirror.assemble import Allreduce
from flowcheck.capture.mirror.job import Job
from flowcheck.errors import JobError
from flowcheck.state import Snapshot
from flowcheck.capture.mirror.replica import PartNormsMissingError, Replica

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StaleIteration:
    """An iteration that could not be completed from the wire, and why (``CaptureReport.stale``)."""

    iteration: int
    step: int  # the step it would have made
    reason: str

    def to_json(self) -> dict:
        return {"iteration": self.iteration, "step": self.step, "reason": self.reason}


@dataclass
class CaptureReport:
    iterations: int = 0  # iterations applied from the wire
    steps: list[int] = field(default_factory=list)  # steps the replica reached (published to RAM)
    stale: list[StaleIteration] = field(default_factory=list)  # iterations that could not be completed, and why
    resyncs: list[int] = field(default_factory=list)  # steps a full state was taken from
    skipped: int = 0  # iterations passed over while stale, waiting for a resync
    allreduces: int = 0


def load_state_file(path: str) -> dict[str, torch.Tensor]:
    """A full state (canonical names) from a safetensors file; never unpickles."""
    from safetensors.torch import load_file

    from flowcheck.restore.diff import check_header

    check_header(path)
    return load_file(path)


class ResyncSource:
    """Full states standing in for the trainer's push: ``DIR/step-<N>.safetensors``."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory

    def state_at(self, step: int) -> dict[str, torch.Tensor] | None:
        if self.directory is None:
            return None
        path = os.path.join(self.directory, f"step-{step}.safetensors")
        return load_state_file(path) if os.path.exists(path) else None


class Updater:
    """Consumes allreduces in capture order and advances the replica one iteration at a time."""

    def __init__(self, job: Job, replica: Replica, *, publish: Callable[[Replica], None],
                 on_stale: Callable[[int, str], None], resync: ResyncSource) -> None:
        self.job, self.replica = job, replica
        self.publish, self.on_stale, self.resync = publish, on_stale, resync
        self.report = CaptureReport()
        self._iteration: int | None = None
        self._problem: str | None = None  # why the current iteration cannot be completed
        self._buckets_seen = 0
        self._stale = False

    def feed(self, ar: Allreduce) -> None:
        self.report.allreduces += 1
        if self._iteration is not None and ar.iteration != self._iteration:
            self._end_iteration()
        self._iteration = ar.iteration
        self._buckets_seen += 1
        self._apply(ar)
        if ar.bucket == len(self.job.plan(ar.iteration)) - 1:
            self._end_iteration()  # its last bucket: publish now, not when the next iteration's traffic starts

    def _apply(self, ar: Allreduce) -> None:
        if self._stale or self._problem:
            return  # the iteration is lost already; its remaining buckets change nothing
        if not ar.complete:
            missing = sum(b - a for a, b in ar.missing())
            self._problem = (f"allreduce {ar.index} (iteration {ar.iteration}, bucket {ar.bucket}): "
                             f"{missing} of {ar.elements} elements missing, {len(ar.conflicts)} conflicts")
            return
        if self.replica.step != self.job.start_step + ar.iteration - 1:
            self._problem = f"replica is at step {self.replica.step}, allreduce {ar.index} belongs to iteration {ar.iteration}"
            return
        self.replica.apply_bucket(self.job.plan(ar.iteration)[ar.bucket], ar.data)

    def close(self) -> CaptureReport:
        if self._iteration is not None:
            self._end_iteration()
        return self.report

    def _end_iteration(self) -> None:
        it, self._iteration = self._iteration, None
        problem, self._problem = self._problem, None
        seen, self._buckets_seen = self._buckets_seen, 0
        expected = len(self.job.plan(it))
        if not problem and seen != expected:
            problem = f"iteration {it}: {seen} of {expected} buckets seen"
        if self._stale:
            self._try_resync(it)
            self.report.skipped += self._stale
        elif problem:
            self._go_stale(it, problem)
        else:
            try:
                self.replica.finish_iteration()
            except PartNormsMissingError as e:
                self._go_stale(it, str(e))
                return
            self.report.iterations += 1
            self.report.steps.append(self.replica.step)
            self.publish(self.replica)

    def _go_stale(self, iteration: int, why: str) -> None:
        log.warning("mirror capture: iteration %d unrecoverable: %s", iteration, why,
                    extra={"event": "stale_iteration", "iteration": iteration, "step": self.job.start_step + iteration,
                           "reason": why})
        self.report.stale.append(StaleIteration(iteration, self.job.start_step + iteration, why))
        self._stale = True
        self.on_stale(iteration, why)
        self._try_resync(iteration)

    def _try_resync(self, iteration: int) -> None:
        """Take the trainer's full state after ``iteration`` (the resync push) and resume from it."""
        step = self.job.start_step + iteration
        state = self.resync.state_at(step)
        if state is None:
            return
        self.replica = Replica(self.job, state, step, owned=self.replica.owned, norms=self.replica.norms)
        self._stale = False
        log.info("mirror capture: resynced from the trainer's full state at step %d", step,
                 extra={"event": "resync", "step": step, "iteration": iteration})
        self.report.resyncs.append(step)
        self.report.steps.append(step)
        self.publish(self.replica)


def run_pipeline(allreduces: Iterable[Allreduce], updater: Updater, depth: int = 4) -> CaptureReport:
    """Decode on this thread, update on another, through a bounded queue (back-pressure, no unbounded RAM)."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    failure: list[BaseException] = []

    def consume() -> None:
        try:
            while (ar := q.get()) is not None:
                updater.feed(ar)
        except BaseException as e:  # noqa: BLE001 - handed to the producer thread, which re-raises it
            failure.append(e)
            while q.get() is not None:
                pass

    worker = threading.Thread(target=consume, name="fc-updater", daemon=True)
    worker.start()
    try:
        for ar in allreduces:
            if failure:
                break
            q.put(ar)
    finally:
        q.put(None)
        worker.join()
    if failure:
        raise failure[0]
    return updater.close()


def initial_replica(job: Job, init: str | None, store=None, **part) -> Replica:
    """The replica before the first captured iteration: a state file, or a step committed in the store
    (``part``: a scaled-out node's ``owned`` and ``norms``, see Replica)."""
    init = init or job.init
    if init is None:
        raise JobError("no initial state: pass --init STEP|FILE or set init: in the job")
    if str(init).isdigit():
        if store is None:
            raise JobError(f"init: step {init} needs a store to read it from")
        snap: Snapshot = store.load(int(init))
        if snap.origin is not None:  # the replica's states descend from the step it starts from
            store.memory.descends_from(snap.origin.parent_ref())
        from flowcheck.torch.state import torch_state_from_snapshot

        model, opt = torch_state_from_snapshot(snap)
        state = dict(model)
        if opt is not None:
            names = [n for g in snap.scalars.optimizer["param_groups"] for n in g["params"]]
            for idx, slots in opt["state"].items():
                for slot, v in slots.items():
                    if isinstance(v, torch.Tensor):
                        state[f"optimizer.{slot}.{names[idx]}"] = v
        return Replica(job, state, int(init), **part)
    return Replica(job, load_state_file(str(init)), job.start_step, **part)


def publish_to(store, run: str, on_step: Callable[[int], None] | None = None) -> Callable[[Replica], None]:
    """Copy each new replica step into the memory tier (full write when the layout is new), then tell the policy."""
    def publish(replica: Replica) -> None:
        snap = replica.snapshot(run)
        mem = store.memory
        if mem.step is None or mem.stale or mem.layout != snap.layout:
            store.push(snap)
        else:
            with mem.update(snap.step, snap.scalars) as u:
                for shard in u.shards():
                    np.copyto(u.array(shard), snap.array(shard))
        if on_step is not None:
            on_step(snap.step)

    return publish


class MirrorSession:
    """One mirror capture into a store, as the node, ``flowcheck capture`` and the demo run it: the replica starts
    from ``init`` (a state file or a committed step; default the job's) and is the RAM state; each iteration the
    updater completes is published to the memory tier, then ``on_step`` (the policy) is told; ``on_stale`` hears of
    an iteration that cannot be completed.  ``part``: a scaled-out node's ``owned`` and ``norms`` (Replica)."""

    def __init__(self, job: Job, store, *, on_step: Callable[[int], None] | None,
                 on_stale: Callable[[int, str], None], init: str | None = None, resync_dir: str | None = None,
                 **part) -> None:
        self.job, self.store = job, store
        self.replica = initial_replica(job, init, store, **part)
        store.push(self.replica.snapshot(store.config.run))
        self.updater = Updater(job, self.replica, publish=publish_to(store, store.config.run, on_step),
                               on_stale=on_stale, resync=ResyncSource(resync_dir or job.resync))

    @property
    def report(self) -> CaptureReport:
        """What the capture did so far (iterations, stale ones, resyncs, steps)."""
        return self.updater.report

    def run(self, allreduces: Iterable[Allreduce]) -> CaptureReport:
        """Feed every allreduce through the updater (decode here, update on another thread) and close it."""
        return run_pipeline(allreduces, self.updater)

