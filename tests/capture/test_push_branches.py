"""Restarts and rollbacks through a real node: parents follow what each state descends from, nothing is dropped."""
from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowcheck.branches import MAIN
from flowcheck.store import Store, open_store
from flowcheck.torch.checkpointer import Checkpointer

from .conftest import NodeProcess
from .test_push_node import _expected, _model, _train_step


def _push(node: NodeProcess, ck: Checkpointer, model, opt, gen, steps, snap_at) -> dict[int, dict]:
    """Train and push ``steps``; snapshot on the node after each step in ``snap_at``; what was held then."""
    held = {}
    for step in steps:
        _train_step(model, opt, gen)
        assert ck.save(step)
        if step in snap_at:
            assert ck.flush(20), ck.stats.last_error
            node.wait_step(step)
            status, body = node.post("/snapshot")
            assert status == 200 and body["step"] == step, body
            held[step] = _expected(model, opt)
    return held


def _assert_stored(store, step: int, branch: str | None, want: dict) -> None:
    tier, n = store.locate(step, "local", branch)
    m = tier.manifest(n)
    assert set(m.tensors) == set(want)
    for name, arr in want.items():
        assert np.array_equal(tier.read(n, name), arr), (step, branch, name)


def test_restart_from_latest_parents_are_the_previous_commit(tmp_path):
    node = NodeProcess(str(tmp_path)).start()
    try:
        model, opt = _model()
        gen = torch.Generator().manual_seed(1)
        with Checkpointer(model, opt, node=node.url, run="gpt", timeout_s=20) as ck:
            _push(node, ck, model, opt, gen, range(4, 8), snap_at={5, 7})
        model2, opt2 = _model(seed=3)
        with Checkpointer(model2, opt2, node=node.url, run="gpt", timeout_s=20) as ck2:
            assert ck2.load("latest", config=node.config) == 7
            _push(node, ck2, model2, opt2, gen, range(8, 12), snap_at={9, 11})
        store = open_store(node.config)
        hist = store.history()
        assert hist.branches() == [MAIN], hist.branches()
        parents = {n: store.local.manifest(n).parent for n in store.local.steps()}
        assert parents[9].step == 7 and parents[11].step == 9, parents
        assert parents[9].manifest_digest == store.local.manifest(7).digest()
        assert node.get("/status")["lineage"]["current"] == MAIN
    finally:
        node.stop()


def test_rollback_keeps_both_branches_bit_exact_and_latest_follows_the_new_one(tmp_path):
    node = NodeProcess(str(tmp_path)).start()
    try:
        model, opt = _model()
        gen = torch.Generator().manual_seed(1)
        with Checkpointer(model, opt, node=node.url, run="gpt", timeout_s=20) as ck:
            old = _push(node, ck, model, opt, gen, range(1, 31), snap_at=range(5, 31, 5))
        # the run diverged: roll back to 20 and continue with another learning rate and data order
        model2, opt2 = _model(seed=7)
        with Checkpointer(model2, opt2, node=node.url, run="gpt", timeout_s=20) as ck2:
            assert ck2.load(20, config=node.config) == 20
            for g in opt2.param_groups:
                g["lr"] = 3e-3
            new = _push(node, ck2, model2, opt2, torch.Generator().manual_seed(99), range(21, 33),
                        snap_at=range(25, 33, 5))
        store = open_store(node.config)
        hist = store.history()
        current = hist.current()
        assert current != MAIN and hist.fork(current).step == 20, (hist.branches(), hist.records)
        for step, want in new.items():  # latest and plain step numbers follow the new branch
            _assert_stored(store, step, None, want)
        for step, want in old.items():  # the abandoned future stays addressable
            if step in store.local.steps():
                _assert_stored(store, step, MAIN, want)
        assert store.locate("latest")[1] == 30 and store.locate("latest")[0].branch == current
        assert store.local.manifest(25).digest() != store.tier("local", current).manifest(25).digest()
        first_new = store.tier("local", current).manifest(25)
        assert first_new.parent.step == 20 and first_new.parent.manifest_digest == store.local.manifest(20).digest()
        status = node.get("/status")
        assert status["lineage"]["current"] == current and status["lineage"]["branches"][current]["head"] == 30
        metrics = node.get("/metrics")["text"]
        assert f'flowcheck_branch_head_step{{branch="{current}",current="1"}} 30.0' in metrics
    finally:
        node.stop()


class _PolicyNode(NodeProcess):
    """A node whose own policy snapshots and promotes (every 5 steps locally, every second to the object
    tier, keep the last 3 of each), as a production node runs."""

    def __init__(self, root: str, object_url: str) -> None:
        super().__init__(root)
        with open(self.config, "w") as f:
            f.write(
                f"run: gpt\ntiers:\n  local:\n    root: {root}/local\n  object:\n    url: {object_url}\n"
                "policy:\n  local:\n    every_steps: 5\n    keep_last: 3\n"
                "  object:\n    every_seconds: 1\n    keep_last: 3\n    keep_hourly: 0\n    keep_daily: 0\n"
                f"serve:\n  push: 127.0.0.1:{self.push_port}\n  http: 127.0.0.1:{self.http_port}\n"
            )


def _train(ck, model, opt, gen, steps) -> dict[int, dict]:
    """Train and push every step; what the trainer held at each one."""
    held = {}
    for step in steps:
        _train_step(model, opt, gen)
        assert ck.save(step)
        held[step] = _expected(model, opt)
    assert ck.flush(20), ck.stats.last_error
    return held


def _every_state_is_what_its_trainer_held(store, old: dict, new: dict, current: str) -> int:
    """Each committed state, on either branch and in either tier, equals the trainer's state at its step."""
    checked = 0
    for t in store.tiers(include_memory=False):
        for bt in store.branch_tiers(t.name):
            for step in bt.steps():
                want = new[step] if bt.branch == current else old[step]
                for name, arr in want.items():
                    assert np.array_equal(bt.read(step, name), arr), (t.name, bt.branch, step, name)
                checked += 1
    return checked


def _rollback_end_to_end(tmp_path, object_url: str) -> None:
    import subprocess
    import sys
    import time

    node = _PolicyNode(str(tmp_path), object_url).start()
    try:
        model, opt = _model()
        with Checkpointer(model, opt, node=node.url, run="gpt", timeout_s=20) as ck:
            old = _train(ck, model, opt, torch.Generator().manual_seed(1), range(1, 61))
        node.wait_step(60)
        time.sleep(2.5)  # the policy's last snapshot and promotion land
        # the run diverged: restore from the second-newest local state and continue with another learning
        # rate and data order (the node's policy picked the step numbers it snapshotted)
        fork_at = open_store(node.config).local.steps()[-2]
        model2, opt2 = _model(seed=5)
        with Checkpointer(model2, opt2, node=node.url, run="gpt", timeout_s=20) as ck2:
            assert ck2.load(fork_at, config=node.config) == fork_at
            for g in opt2.param_groups:
                g["lr"] = 3e-3
            new = _train(ck2, model2, opt2, torch.Generator().manual_seed(99), range(fork_at + 1, 67))
        new.update({s: old[s] for s in range(1, fork_at + 1)})  # the shared past, as the new branch's path sees it
        node.wait_step(66)
        assert node.post("/snapshot")[0] == 200
        time.sleep(2.5)
        status = node.get("/status")
    finally:
        node.stop()
    store = open_store(node.config)
    hist = store.history()
    current = hist.current()
    assert current != MAIN and hist.fork(current).step == fork_at and status["lineage"]["current"] == current
    assert _every_state_is_what_its_trainer_held(store, old, new, current) >= 6
    # a plain step number is the new branch's; --branch reaches the old one (kept: within its grace)
    abandoned = [s for s in store.local.steps() if s > fork_at]
    assert abandoned and 66 in hist.own_steps(current)
    for step in abandoned:
        tier = store.find(step, "local", branch=MAIN)
        assert np.array_equal(tier.read(step, "0.weight"), old[step]["0.weight"])
    for step in hist.own_steps(current):
        assert store.find(step).branch == current
    env = dict(os.environ)
    cli = [sys.executable, "-m", "flowcheck"]
    audit = subprocess.run(cli + ["audit", "--config", node.config], capture_output=True, text=True, env=env)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    # both branches are audited; the "[info] fork" line needs the fork-point state, which GC may have pruned
    assert "on 2 branches" in audit.stdout, audit.stdout
    shown = subprocess.run(cli + ["show", "--step", str(abandoned[-1]), "--branch", MAIN, "--config", node.config],
                           capture_output=True, text=True, env=env)
    assert shown.returncode == 0 and store.local.manifest(abandoned[-1]).digest() in shown.stdout, shown.stdout
    if shutil.which("dot"):
        png = os.path.join(str(tmp_path), "lineage.png")
        drawn = subprocess.run(cli + ["lineage", "--format", "png", "--out", png, "--config", node.config],
                               capture_output=True, text=True, env=env)
        assert drawn.returncode == 0 and os.path.getsize(png) > 0, drawn.stdout + drawn.stderr
    # the grace ends: GC prunes the abandoned future, keeps the new branch's last 3, and says so
    cfg = dataclasses.replace(store.config, policy=dataclasses.replace(
        store.config.policy, local=dataclasses.replace(store.config.policy.local, keep_abandoned_hours=0)))
    report = Store(cfg).gc(tiers=["local"])
    assert {k.branch for k in report.deleted["local"]} <= {MAIN, current}
    assert set(abandoned) <= {k.step for k in report.deleted["local"] if k.branch == MAIN}
    assert set(abandoned) <= set(store.local.pruned())
    left = Store(cfg).history(["local"])
    assert len(left.own_steps(current)) == min(3, len(hist.own_steps(current)))  # keep_last 3 along the path
    assert not [s for s in left.own_steps(MAIN) if s > fork_at]


def test_rollback_end_to_end_with_the_node_policy_on_a_file_object_store(tmp_path):
    _rollback_end_to_end(tmp_path, f"file://{tmp_path}/object")


@pytest.mark.s3
def test_rollback_end_to_end_with_the_node_policy_on_s3(tmp_path, object_bucket):
    _rollback_end_to_end(tmp_path, object_bucket)


def test_a_fresh_trainer_is_a_new_root_and_one_that_names_its_parent_continues_it(tmp_path):
    """A trainer that loaded nothing descends from nothing stored, even when the node holds another job's steps
    (recovered as its head); one that resumed by other means and says ``parent=N`` descends from step N."""
    from flowcheck import evidence

    node = NodeProcess(str(tmp_path)).start()
    try:
        model, opt = _model()
        gen = torch.Generator().manual_seed(1)
        with Checkpointer(model, opt, node=node.url, run="gpt", timeout_s=20) as ck:
            _push(node, ck, model, opt, gen, range(1, 6), snap_at={3, 5})
        node.stop()
        node.start()  # a restarted node recovers step 5 as its head
        evidence.forget()  # a second process: resumed from step 5 (a directory `flowcheck restore` wrote), says so
        with Checkpointer(model, opt, node=node.url, run="gpt", timeout_s=20, parent=5) as ck2:
            _push(node, ck2, model, opt, gen, range(6, 8), snap_at={7})
        evidence.forget()  # a third: it trains a freshly initialised model
        model3, opt3 = _model(seed=3)
        with Checkpointer(model3, opt3, node=node.url, run="gpt", timeout_s=20) as ck3:
            _push(node, ck3, model3, opt3, gen, range(1, 4), snap_at={2, 3})
        with Checkpointer(model3, opt3, node=node.url, run="gpt", timeout_s=20, parent=99) as ck4:
            assert ck4.save(4) and not ck4.flush(20)  # a parent the node does not hold: refused, said in one line
            assert "parent step 99: step 99 is not committed" in ck4.stats.last_error, ck4.stats.last_error
    finally:
        node.stop()
    store = open_store(node.config)
    assert store.local.steps() == [3, 5, 7]
    assert store.local.manifest(7).parent == store.local.manifest(5).parent_ref()
    hist = store.history()
    roots = [b for b in hist.branches() if b.startswith("root-")]
    assert len(roots) == 1 and hist.fork(roots[0]) is None, hist.branches()
    fresh = store.tier("local", roots[0])
    assert fresh.steps() == [2, 3] and fresh.manifest(2).parent is None
    assert fresh.manifest(3).parent == fresh.manifest(2).parent_ref()


def _in_process_node(tmp_path, token: str):
    from flowcheck.node.receiver import PushReceiver

    store = open_store(NodeProcess(str(tmp_path)).config)
    return store, PushReceiver(store, part_timeout_s=10, token=token).start()


def _pushed_and_committed(store, ck, model, opt, gen, step: int):
    """Train, push ``step``, wait until it is the RAM state, snapshot it: the committed manifest."""
    import time

    _train_step(model, opt, gen)
    assert ck.save(step) and ck.flush(20), ck.stats.last_error
    deadline = time.monotonic() + 10
    while store.memory.step != step and time.monotonic() < deadline:
        time.sleep(0.005)
    return store.snapshot()


_job = st.one_of(
    st.tuples(st.just("fresh"), st.integers(1, 3)),  # a new process training a new model: pushes n steps from 1
    st.tuples(st.just("load"), st.integers(0, 30), st.integers(1, 3)),  # a new process: loads a stored state, n more
    st.tuples(st.just("more"), st.integers(1, 2)),  # the same process pushes n more steps
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(jobs=st.lists(_job, min_size=2, max_size=5))
def test_every_pushed_states_parent_is_what_its_trainer_loaded_or_pushed_before(tmp_path_factory, node_token, jobs):
    """Through a node: a fresh trainer's first state has no parent, a loaded one's first the state it loaded
    (older or not: a rollback), every later one the state its own trainer pushed before — never what the node held
    from another job."""
    from flowcheck import evidence

    store, receiver = _in_process_node(tmp_path_factory.mktemp("node"), node_token)
    url = f"tcp://127.0.0.1:{receiver.address[1]}"
    gen = torch.Generator().manual_seed(5)
    committed, expect = [], {}
    ck, step, last, seed = None, 0, None, 0
    try:
        for job in jobs:
            if job[0] != "more" or ck is None:
                if ck is not None:
                    ck.close()
                evidence.forget()  # a new process
                seed += 1
                model, opt = _model(seed=seed)
                ck = Checkpointer(model, opt, node=url, run="gpt", transport="tcp", timeout_s=20)
                step, last = 0, None
                if job[0] == "load" and committed:
                    m = committed[job[1] % len(committed)]
                    step = ck.load(m.digest()[:30], store=store)
                    last = m.parent_ref()
            for _ in range(job[-1]):
                step += 1
                m = _pushed_and_committed(store, ck, model, opt, gen, step)
                expect[m.digest()] = last
                committed.append(m)
                last = m.parent_ref()
        ck.close()
    finally:
        receiver.close()
    for m in committed:
        assert m.parent == expect[m.digest()], (m.step, jobs)
