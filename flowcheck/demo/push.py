"""The push half of the demo: a trainer process pushes every step to a node process, is killed, and resumes.

The node (``flowcheck serve``) holds the pushed state in RAM, snapshots it to the
local zarr tier every K steps and promotes to the object tier on a timer.  The
first trainer is killed mid-run (SIGKILL); a second one restores the newest
committed step and finishes; its losses must equal an uninterrupted run's bit
for bit.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from flowcheck.config import Config
from flowcheck.demo.setup import (
    DemoOptions,
    demo_config,
    ensure_bucket,
    prepare_workdir,
    write_config,
)
from flowcheck.errors import FlowcheckError

Echo = Callable[[str], None]
# what Python's resource tracker prints when it unlinks a shared-memory segment its (killed) process left
_TRACKER_RECLAIM = "leaked shared_memory objects"


@dataclass(frozen=True)
class TrainerRun:
    """One trainer process: how it ended, and its output lines that were not step/loss records."""

    returncode: int
    killed: bool
    log: str  # the file holding everything it (and its resource tracker) printed
    segment_reclaimed: bool  # its shared-memory push buffer was unlinked by its resource tracker after the kill


@dataclass(frozen=True)
class PushResult:
    """What the push half did and saw; verify() turns it into checks."""

    config: Config
    config_path: str
    first: int
    last: int
    parameters: int
    reference: dict[int, float]  # the uninterrupted run's loss per step
    losses: dict[int, float]  # the pushing trainers' losses per step (the resumed trainer's after the kill)
    resumed_from: int | None  # the step trainer 2 restored (None: it did not restore)
    trainers: tuple[TrainerRun, ...]
    reference_s: float
    push_s: float
    status: dict[str, Any] = field(default_factory=dict)  # the node's /status at the end
    final_state: str = ""  # the trainer's live state at the last step (safetensors), "" when it wrote none

    @property
    def loss_summary(self) -> str:
        losses = [self.losses[s] for s in sorted(self.losses)]
        if not losses:
            return "no loss was reported"
        n = max(1, len(losses) // 10)
        first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
        return f"loss {first:.3f} -> {last:.3f} (mean of the first/last {n} steps)"

    @property
    def identical(self) -> bool:
        """The resumed trainer's losses equal the uninterrupted run's, bit for bit, from the restored step on."""
        if self.resumed_from is None:
            return False
        steps = range(self.resumed_from + 1, self.last + 1)
        return all(s in self.losses and self.losses[s] == self.reference[s] for s in steps)


def prepare(opts: DemoOptions) -> Config:
    """The workdir, the merged config (written to WORKDIR/flowcheck.yaml), the bucket: everything a bad option
    or config is refused by, before anything runs."""
    prepare_workdir(opts.root)
    cfg = demo_config(opts)
    if cfg.tiers.object.url.startswith("s3://"):
        ensure_bucket(cfg)
    write_config(cfg, opts.config_path)
    return cfg


def run_push(opts: DemoOptions, cfg: Config, echo: Echo = print) -> PushResult:
    """Start a node on ``cfg`` (from ``prepare``), run trainer 1 (killed), trainer 2 (resumed); see the module doc."""
    from flowcheck.demo.model import parameter_count, setup, train_step
    from flowcheck.simulate.trainer import one_thread
    from flowcheck.store import Store

    hist = Store(cfg, progress=False).history()
    start = max(hist.path(hist.current()), default=0)  # a re-run continues the current branch
    first, last = start + 1, start + opts.steps

    t0 = time.perf_counter()
    with one_thread():
        model, opt, sched, tokens = setup(last)
        reference = {s: train_step(model, opt, sched, tokens) for s in range(first, last + 1)}
    reference_s = time.perf_counter() - t0
    echo(f"demo: a {parameter_count(model):,}-parameter GPT in megatron-core's GPTModel layout, steps {first}..{last}; "
         f"uninterrupted reference run: {reference_s:.1f} s")
    with _node(cfg, opts) as node_pid:
        local, obj = cfg.policy.local, cfg.policy.object
        echo(f"node: `flowcheck serve` (pid {node_pid}) takes pushes on tcp://{cfg.serve.push}, control API "
             f"http://{cfg.serve.http}; local snapshot {_every(local)}, object promotion {_every(obj)}")
        t1 = time.perf_counter()
        losses, resumed_from, trainers = _two_trainers(cfg, opts, first, last, echo)
        push_s = time.perf_counter() - t1
        status = _settle(cfg, last)
    final = os.path.join(opts.root, "trainer-final.safetensors")
    return PushResult(cfg, opts.config_path, first, last, parameter_count(model), reference, losses, resumed_from,
                      trainers, reference_s, push_s, status,
                      final if trainers[-1].returncode == 0 and os.path.exists(final) else "")


def _every(p) -> str:
    parts = ([f"every {p.every_steps} steps"] if p.every_steps else []) + (
        [f"every {p.every_seconds:g} s"] if p.every_seconds else [])
    return (" and ".join(parts) or "never (no trigger)") + f", keep last {p.keep_last}"


@contextmanager
def _node(cfg: Config, opts: DemoOptions) -> Iterator[int]:
    """``flowcheck serve`` on the demo's config, answering its control API; SIGTERMed after the block.  Its pid."""
    path = os.path.join(opts.root, "node.log")
    with open(path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "flowcheck", "serve", "--config", opts.config_path],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_node(cfg, proc, path)
        yield proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _two_trainers(cfg: Config, opts: DemoOptions, first: int, last: int,
                  echo: Echo) -> tuple[dict[int, float], int | None, tuple[TrainerRun, TrainerRun]]:
    """Trainer 1 (killed at 3/5 of the steps), trainer 2 (resumed): (losses by step, the step trainer 2
    restored or None, both runs)."""
    losses: dict[int, float] = {}
    resumed: list[int] = []
    kill_at = first + max(1, (opts.steps * 3) // 5)

    def seen(line: str, kill: bool) -> bool:
        if line.startswith("resumed "):
            resumed.append(int(line.split()[1]))
        if line.startswith("step "):
            _, step, _, loss = line.split()
            losses[int(step)] = float(loss)
            return kill and int(step) >= kill_at
        return False

    args = ["--config", opts.config_path, "--first", str(first), "--last", str(last)]
    t1 = _run_trainer(args, os.path.join(opts.root, "trainer-1.log"), lambda line: seen(line, True))
    killed_after = max(losses, default=None)
    reclaimed = "; its shared-memory push buffer was unlinked by its resource tracker" if t1.segment_reclaimed else ""
    if t1.killed:
        echo(f"trainer 1: trained steps {first}..{killed_after} pushing every step, then killed (SIGKILL){reclaimed}")
    else:
        echo(f"trainer 1: exited with status {t1.returncode} before the kill (see {t1.log})")
    time.sleep(0.5)
    status = _api(cfg, "/status")
    echo(f"node: RAM at step {status['memory']['step']}, newest local snapshot {status['tiers'].get('local')}")
    final = os.path.join(opts.root, "trainer-final.safetensors")
    if os.path.exists(final):
        os.remove(final)  # a previous run's: only this run's trainer may leave one
    t2 = _run_trainer([*args, "--resume", "--final", final], os.path.join(opts.root, "trainer-2.log"),
                      lambda line: seen(line, False))
    resumed_from = resumed[0] if resumed else None
    if resumed_from is None:
        echo(f"trainer 2: did not restore a step: exited with status {t2.returncode} (see {t2.log})")
    else:
        echo(f"trainer 2: restored step {resumed_from} from the store, trained {resumed_from + 1}..{last}")
    return losses, resumed_from, (t1, t2)


def _run_trainer(args: list[str], log_path: str, on_line: Callable[[str], bool]) -> TrainerRun:
    """Run a trainer process, hand each output line to on_line; on_line returning True kills it (SIGKILL).

    Its stderr goes to the same pipe, and so does its resource tracker's (a child that inherits both): after a
    kill the tracker unlinks the push buffer the trainer could not, and says so there, not on the terminal.
    """
    proc = subprocess.Popen([sys.executable, "-m", "flowcheck.demo.trainer", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    killed = False
    with open(log_path, "a", encoding="utf-8") as log:
        for line in proc.stdout:
            log.write(line)
            if on_line(line.rstrip("\n")):
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
        code = proc.wait()
        rest = _drain(proc.stdout, timeout=15.0)
        log.write(rest)
    proc.stdout.close()
    return TrainerRun(code, killed, log_path, killed and _TRACKER_RECLAIM in rest)


def _drain(stream, timeout: float) -> str:
    """What is left in a pipe until every writer closed it (or ``timeout``)."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(stream.read()), daemon=True)
    reader.start()
    reader.join(timeout)
    return got[0] if got else ""


def _settle(cfg: Config, last: int) -> dict[str, Any]:
    """Wait until the node's RAM holds the last step, snapshot it, let the timer promote it; the final status."""
    deadline = time.monotonic() + 30
    while _api(cfg, "/status")["memory"]["step"] != last and time.monotonic() < deadline:
        time.sleep(0.1)
    _api(cfg, "/snapshot", "POST")
    promote = cfg.policy.object.every_seconds
    time.sleep((promote if promote and promote < 30 else 0) + 0.5)  # let the timer promote the newest local step
    return _api(cfg, "/status")


def _api(cfg: Config, path: str, method: str = "GET") -> dict:
    import urllib.request

    from flowcheck.capture.push.auth import read_token
    from flowcheck.node.client import control_request

    req = control_request(f"http://{cfg.serve.http}{path}", method, token=read_token(cfg.serve.auth_token_env))
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _wait_node(cfg: Config, node: subprocess.Popen, log: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.poll() is not None:
            raise FlowcheckError(f"the node exited with status {node.returncode}; see {log}")
        try:
            _api(cfg, "/status")
            return
        except OSError:
            time.sleep(0.2)
    raise FlowcheckError(f"the node did not answer its control API within {timeout:g} s; see {log}")
