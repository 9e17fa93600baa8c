"""Two trainers pushing one run (a requeued job beside its zombie, two ranks calling themselves sender 0): the node
takes one launch at a time and one connection per sender place, so no step is ever torn between them."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from flowcheck.audit import audit
from flowcheck.capture.push.launch import Launch, Launches, Superseded
from flowcheck.store import open_store
from flowcheck.torch.checkpointer import Checkpointer
from flowcheck.torch.coords import Coordinates
from flowcheck.torch.launch import LAUNCH_ENV, agree_launch

from .conftest import NodeProcess

ROUNDS, STEPS = 20, 4


def test_a_newer_launch_supersedes_and_an_older_one_is_refused_by_name_or_by_start():
    launches = Launches()
    old, new = Launch("old", 100.0), Launch("new", 200.0)
    assert launches.admit(old, "10.0.0.1:1") is None and launches.admit(old, "10.0.0.1:2") is None
    assert launches.admit(new, "10.0.0.2:1") == old
    with pytest.raises(Superseded, match="launch old .* superseded by launch new .* pushing from 10.0.0.2:1"):
        launches.admit(old, "10.0.0.1:3")
    with pytest.raises(Superseded):  # never seen, but started before the current one: an old copy late to connect
        launches.admit(Launch("older", 50.0), "10.0.0.3:1")
    assert launches.admit(None, "10.0.0.4:1") is None  # a job whose ranks share no launch: claims still apply
    assert launches.current == new


def test_ranks_agree_on_one_launch_from_the_environment_and_single_senders_make_their_own(monkeypatch):
    monkeypatch.setenv(LAUNCH_ENV, "job-42-try-3")
    ranks = [agree_launch(Coordinates(dp_rank=r, dp=4)) for r in range(4)]
    assert {r.id for r in ranks} == {"job-42-try-3"}
    monkeypatch.delenv(LAUNCH_ENV)
    assert agree_launch(Coordinates(dp_rank=1, dp=4)) is None  # hand-made coordinates, no group: cannot agree
    a, b = agree_launch(Coordinates()), agree_launch(Coordinates())
    assert a.id != b.id and b.started >= a.started


def _fill(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def _trainer(node_url: str, steps: range, offset: float, start: threading.Barrier, errors: list) -> Checkpointer:
    model = torch.nn.Linear(256, 256)
    ck = Checkpointer(model, None, node=node_url, run="gpt", transport="tcp", timeout_s=20, hook=False)
    try:
        start.wait(20)
        for step in steps:
            _fill(model, step + offset)
            ck.save(step)
            ck.flush(20)
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(e)
    finally:
        ck.close()
    return ck


def test_two_trainers_on_one_run_never_commit_a_torn_or_mismatched_step(tmp_path):
    """The issue's attack, 20 times: two copies of a job push the same steps at once, values step+0.25 and step+0.75,
    every step snapshotted; each committed step holds one copy's values only, bytes matching its manifest."""
    node = NodeProcess(str(tmp_path), every_steps=1).start()
    refused, checked = 0, set()
    try:
        for r in range(ROUNDS):
            steps = range(r * STEPS + 1, (r + 1) * STEPS + 1)
            start, errors, done = threading.Barrier(2), [], []
            threads = [threading.Thread(target=lambda off=off: done.append(_trainer(node.url, steps, off, start, errors)))
                       for off in (0.25, 0.75)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not errors, errors
            refused += sum(ck.superseded is not None for ck in done)
            node.post("/snapshot")
            store = open_store(node.config)  # local keeps the last few steps: check each round's as it stands
            for tier in store.branch_tiers("local"):  # each fresh trainer starts a root branch of its own
                for step in tier.steps():
                    checked.add(step)
                    values = {float(v) for name in tier.manifest(step).tensors for v in np.unique(tier.read(step, name))}
                    assert len(values) == 1 and values.pop() - step in (0.25, 0.75), (step, values)
        status = node.get("/status")
    finally:
        node.stop()
    assert len(checked) >= ROUNDS, sorted(checked)
    report = audit(open_store(node.config))
    assert report.ok, report.problems
    assert refused >= ROUNDS, refused  # in every round one copy was superseded (or had its sender place refused)
    assert status["push"]["launch"]["superseded"] >= ROUNDS - 1, status["push"]


def test_a_second_connection_claiming_a_sender_place_is_refused_naming_both(tmp_path, monkeypatch):
    """Two processes of a job without a shared launch (hand-made coordinates) that both call themselves rank 0 of 2."""
    node = NodeProcess(str(tmp_path), part_timeout_s=5).start()
    try:
        models = [torch.nn.Linear(64, 64) for _ in range(2)]
        cks = [Checkpointer(m, None, node=node.url, run="gpt", transport="tcp", timeout_s=10, hook=False,
                            coords=Coordinates(dp_rank=0, dp=2)) for m in models]
        assert all(ck.launch is None for ck in cks)
        for ck in cks:
            ck.save(1)
        for ck in cks:
            ck.flush(15)
        errors = [ck.stats.last_error or "" for ck in cks]
        assert any("part 0 is already being sent by 127.0.0.1:" in e and "refused from 127.0.0.1:" in e
                   for e in errors), errors
        assert "part 0 is being sent by 127.0.0.1:" in node.tail()
        for ck in cks:
            ck.close()
    finally:
        node.stop()
