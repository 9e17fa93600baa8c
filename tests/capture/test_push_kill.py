"""A trainer killed with SIGKILL at any point of its pushes never costs the node the last acknowledged step.

Real processes: a `flowcheck serve` node, and trainers (1 or 4 gloo ranks, push_kill_trainer.py) that push every
step and are killed at random instants spread over their pushes — mid-copy, mid-send, while the node adopts, between
pushes.  After every kill the node must hold a complete step no older than the last one acknowledged to every rank,
``POST /snapshot`` must commit it, and its bytes must read back equal to what the trainer pushed at that step.
The default run kills a few times; ``FLOWCHECK_KILLS=200 pytest -m slow tests/capture/test_push_kill.py`` runs the
issue's 200 points.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from flowcheck.store import open_store

from tests.helpers import state_digest

from .conftest import NodeProcess, free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUND = 10_000  # each round's trainer starts at round * ROUND: step numbers never repeat across rounds


def _start(node: NodeProcess, logs: list[str], base: int, transport: str) -> list[subprocess.Popen]:
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", "tests.capture.push_kill_trainer", "--node", node.url, "--log", log,
                              "--base", str(base), "--transport", transport, "--rank", str(r), "--world",
                              str(len(logs)), "--port", str(port)], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
            for r, log in enumerate(logs)]


def _read(log: str) -> tuple[dict[int, str], int | None]:
    """(digest of every step the rank began pushing, the last step the node acknowledged to it)."""
    pushing, acked = {}, None
    if os.path.exists(log):
        with open(log) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[0] == "pushing":
                    pushing[int(parts[1])] = parts[2]
                elif len(parts) == 2 and parts[0] == "acked":
                    acked = int(parts[1])
    return pushing, acked


def _first_ack(logs: list[str], procs: list[subprocess.Popen], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(_read(log)[1] is not None for log in logs):
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError("a trainer exited before its first acknowledged push")
        time.sleep(0.05)
    raise AssertionError("no acknowledged push within 90 s")


def _inside_push(log: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Until the rank has begun a push not yet acknowledged to it (its log ends with a ``pushing`` line)."""
    deadline = time.monotonic() + timeout_s
    with open(log, "rb") as f:
        while time.monotonic() < deadline and proc.poll() is None:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 64))
            tail = f.read().rstrip(b"\n").rsplit(b"\n", 1)[-1]
            if tail.startswith(b"pushing"):
                return
            time.sleep(0.0005)
    raise AssertionError("the trainer never began another push")


def _settled(node: NodeProcess, timeout_s: float = 60.0) -> dict:
    """The node's status once no step is being received (a killed job's open step aborts after part_timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = node.get("/status")
        if status["push"]["receiving"] is None:
            return status
        time.sleep(0.05)
    raise AssertionError(f"a step stayed open: {node.get('/status')['push']}")


def _check_round(node: NodeProcess, logs: list[str]) -> tuple[bool, bool]:
    """After a kill: the node holds a whole step >= the last acknowledged to every rank; it commits and reads back
    bit for bit.  (whether the kill landed inside a push — a rank had begun a push not acknowledged to it —, whether
    the node holds a step newer than the last acknowledged to all: one whose acks the kill cut off)."""
    reads = [_read(log) for log in logs]
    acked_by_all = min(acked for _, acked in reads)
    status = _settled(node)
    held = status["memory"]["step"]
    assert held is not None and held >= acked_by_all and not status["memory"]["stale"], (held, acked_by_all, status)
    code, body = node.post("/snapshot")
    assert code == 200 and body["step"] == held, body
    local = open_store(node.config).find(held, "local")  # each round's trainer is a fresh job: a root of its own
    m = local.manifest(held)
    got = state_digest({name: local.read(held, name) for name in m.tensors})
    assert got == reads[0][0][held], f"step {held}: the node's state is not what the trainer pushed"
    return any(max(pushing) != acked for pushing, acked in reads), held > acked_by_all


def _kill_rounds(tmp_path, ranks: int, kills: int, transport: str) -> None:
    node = NodeProcess(str(tmp_path), every_steps=10**9, part_timeout_s=2.0).start()
    rng = random.Random(1234 + ranks)
    mid_push = newer = 0
    try:
        for r in range(1, kills + 1):
            logs = [str(tmp_path / f"round{r}-rank{k}.log") for k in range(ranks)]
            procs = _start(node, logs, r * ROUND, transport)
            try:
                _first_ack(logs, procs)
                time.sleep(rng.uniform(0.0, 0.3))  # anywhere in the next few iterations...
                if r % 2:  # ...or, every other round, a few milliseconds into a push
                    _inside_push(logs[0], procs[0])
                    time.sleep(rng.uniform(0.0, 0.005))
            finally:
                for p in procs:
                    p.send_signal(signal.SIGKILL)
                for p in procs:
                    p.wait(30)
            inside, ahead = _check_round(node, logs)
            mid_push, newer = mid_push + inside, newer + ahead
        print(f"\n{ranks} rank(s), {transport}: {kills} kills, {mid_push} inside a push; the node held the last step "
              f"acknowledged to all {kills - newer} times, a newer complete one (acks cut off) {newer} times; 0 lost")
        # most kills hit a push in flight: the test is about those (a push takes most of an iteration here)
        assert mid_push >= kills // 3, f"only {mid_push} of {kills} kills landed inside a push"
        assert node.get("/status")["memory"]["step"] is not None
    finally:
        node.stop()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_trainer_killed_mid_push_never_costs_the_acknowledged_step(tmp_path, transport):
    _kill_rounds(tmp_path, ranks=1, kills=int(os.environ.get("FLOWCHECK_KILLS", "6")), transport=transport)


def test_a_four_rank_job_killed_mid_push_never_costs_the_step_acknowledged_to_all(tmp_path):
    _kill_rounds(tmp_path, ranks=4, kills=int(os.environ.get("FLOWCHECK_KILLS_4", "3")), transport="shm")


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 4])
def test_two_hundred_kills(tmp_path, ranks):
    """The issue's measure: 200 kill points (FLOWCHECK_KILLS to change it), every one losing nothing acknowledged."""
    _kill_rounds(tmp_path, ranks=ranks, kills=int(os.environ.get("FLOWCHECK_KILLS", "200")), transport="shm")
