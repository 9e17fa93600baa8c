"""Restarts and rollbacks through a real node: parents follow what each state descends from, nothing is dropped."""
from __future__ import annotations

import numpy as np
import torch

from flowcheck.branches import MAIN
from flowcheck.store import open_store
from flowcheck.torch.checkpointer import Checkpointer

from .conftest import NodeProcess
from .test_push_node import _expected, _model, _train_step


def _push(node: NodeProcess, ck: Checkpointer, model, opt, gen, steps, snap_every: int) -> dict[int, dict]:
    """Train and push ``steps``; snapshot on the node after each multiple of ``snap_every``; what was held then."""
    held = {}
    for step in steps:
        _train_step(model, opt, gen)
        assert ck.save(step)
        if step % snap_every == 0:
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
            for step in range(4, 8):
                _train_step(model, opt, gen)
                assert ck.save(step)
                if step in (5, 7):
                    assert ck.flush(20)
                    node.wait_step(step)
                    assert node.post("/snapshot")[0] == 200
        model2, opt2 = _model(seed=3)
        with Checkpointer(model2, opt2, node=node.url, run="gpt", timeout_s=20) as ck2:
            assert ck2.load("latest", config=node.config) == 7
            for step in range(8, 12):
                _train_step(model2, opt2, gen)
                assert ck2.save(step)
                if step in (9, 11):
                    assert ck2.flush(20)
                    node.wait_step(step)
                    assert node.post("/snapshot")[0] == 200
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
            old = _push(node, ck, model, opt, gen, range(1, 31), snap_every=5)
        # the run diverged: roll back to 20 and continue with another learning rate and data order
        model2, opt2 = _model(seed=7)
        with Checkpointer(model2, opt2, node=node.url, run="gpt", timeout_s=20) as ck2:
            assert ck2.load(20, config=node.config) == 20
            for g in opt2.param_groups:
                g["lr"] = 3e-3
            new = _push(node, ck2, model2, opt2, torch.Generator().manual_seed(99), range(21, 33), snap_every=5)
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
