"""A rollback in a multi-node cluster: both nodes' new states commit as one step of a new branch on the object tier."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flowcheck.branches import MAIN
from flowcheck.errors import StepIncompleteError
from flowcheck.store import Store
from tests.integration.multinode_node import full_state, node_config, node_snapshot

NODES = ["n0", "n1", "n2"]  # the split multinode_node.owned makes


def _diverged(snap):
    """The state a rolled-back run reaches at the same step number: other bytes."""
    data = {s: (a + np.float32(1) if a.dtype == np.float32 else a) for s, a in snap.data.items()}
    return dataclasses.replace(snap, data=data)


def _promote_everywhere(stores: dict[str, Store], step: int | str | None = None):
    """The first nodes give up waiting for the others' parts; the last one commits the step."""
    for n in NODES[:-1]:
        with pytest.raises(StepIncompleteError):
            stores[n].promote(step)
    return stores[NODES[-1]].promote(step)


def _run(url: str, tmp_path) -> None:
    stores = {n: Store(node_config(url, n, NODES, str(tmp_path), 0.05)) for n in NODES}
    merged = {}
    for step in (1, 2, 3):
        for n, store in stores.items():
            store.push(node_snapshot(step, NODES, n))
            store.snapshot()
        merged[step] = _promote_everywhere(stores, step)
    # the run rolls back to step 1 and diverges: every node commits a different step 2
    for n, store in stores.items():
        store.push(store.local.load(1))
        store.push(_diverged(node_snapshot(2, NODES, n)))
        new_local = store.snapshot()
        assert new_local.parent.step == 1
    new = _promote_everywhere(stores, "latest")
    reader = Store(node_config(url, "n0", NODES, str(tmp_path / "reader"), 0.05))
    hist = reader.history(["object"])
    branch = hist.current()
    assert branch != MAIN and hist.own_steps(MAIN) == [1, 2, 3] and hist.own_steps(branch) == [2]
    assert new.parent == merged[1].parent_ref()  # the object tier's own step 1, not the abandoned 2 or 3
    assert [r.node for r in new.nodes] == NODES
    old_tier, new_tier = reader.tier("object"), reader.tier("object", branch)
    for name, want in full_state(2).items():
        assert old_tier.read(2, name).tobytes() == want.tobytes()
        got = new_tier.read(2, name)
        assert got.tobytes() == (want + np.float32(1) if want.dtype == np.float32 else want).tobytes()
    assert new_tier.verify(2) == [] and old_tier.verify(2) == []
    t, n = reader.locate(2, "object")
    assert t.branch == branch and n == 2


def test_cluster_rollback_commits_a_new_branch_on_a_file_object_store(tmp_path):
    _run(f"file://{tmp_path / 'object'}", tmp_path)


@pytest.mark.s3
def test_cluster_rollback_commits_a_new_branch_on_s3(tmp_path, object_bucket):
    _run(object_bucket, tmp_path)
