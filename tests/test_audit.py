"""Audit: every flipped byte in any stored file is caught; gaps, broken links and forks are reported."""
from __future__ import annotations

import json
import os

import pytest

import numpy as np

from flowcheck.audit import audit, info_lines, lineage
from flowcheck.branches import Located
from flowcheck.lineage_view import dumps
from flowcheck.manifest import ParentRef
from flowcheck.state import Scalars
from tests.helpers import make_snapshot
from tests.test_store import advance, make_store


def _store_with_steps(tmp_path, steps=(10, 11, 12)):
    store = make_store(tmp_path, local_keep=5, object_keep=5)
    store.push(make_snapshot(step=steps[0]))
    for i, step in enumerate(steps):
        if i:
            advance(store, step)
        store.snapshot()
    store.promote(steps[-1])
    return store


def diverge(store, step: int) -> None:
    """Train to ``step`` differently from ``advance`` (a rollback that changed something: another state)."""
    with store.memory.update(step, Scalars(optimizer_step=step)) as u:
        for shard in u.shards():
            arr = u.array(shard)
            if arr.dtype == np.float32:
                arr -= 1.0


def rolled_back(tmp_path):
    """Steps 1..3 on main (3 also in the object tier); then a rollback to step 1 and a different step 2,
    which lands on the new branch b1-2 (now the current branch)."""
    store = _store_with_steps(tmp_path, steps=(1, 2, 3))
    store.push(store.local.load(1))
    diverge(store, 2)
    store.snapshot()
    assert store.history().current() == "b1-2"
    return store


def _files(root: str):
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            yield os.path.join(dirpath, name)


def test_healthy_store_audits_clean(tmp_path):
    report = audit(_store_with_steps(tmp_path))
    assert report.ok, [str(p) for p in report.problems]
    assert report.checked_steps == 4 and len(report.nodes) == 3


def test_a_single_flipped_byte_in_any_stored_file_fails_the_audit(tmp_path):
    store = _store_with_steps(tmp_path, steps=(10,))
    step_dirs = [os.path.join(store.local.root, "step-000000010"), os.path.join(tmp_path, "object", "r1", "step-000000010")]
    files = [f for d in step_dirs for f in _files(d)]
    assert len(files) > 10
    for path in files:
        with open(path, "rb") as f:
            original = f.read()
        pos = len(original) // 2
        with open(path, "wb") as f:
            f.write(original[:pos] + bytes([original[pos] ^ 0x01]) + original[pos + 1:])
        try:
            store.object._headers.clear()
            report = audit(store)
            assert not report.ok, f"flipped byte in {path} went unnoticed"
            named = " ".join(str(p) for p in report.problems)
            rel = os.path.basename(path)
            assert rel in named or "manifest" in named or "integrity" in named, named
        finally:
            with open(path, "wb") as f:
                f.write(original)
    store.object._headers.clear()
    assert audit(store).ok


def test_gc_gaps_are_fine_but_lost_steps_are_not(tmp_path):
    store = _store_with_steps(tmp_path)
    store.local.delete(10)  # through GC's path: leaves a pruning record
    assert audit(store).ok
    import shutil

    shutil.rmtree(os.path.join(store.local.root, "step-000000011"))  # lost, not pruned
    report = audit(store)
    assert not report.ok
    assert any("lineage gap" in p.what and p.step == 12 for p in report.problems)


def test_restore_then_new_training_shows_a_fork(tmp_path):
    store = _store_with_steps(tmp_path)
    store.push(store.local.load(10))  # a restore of step 10 into RAM: the new branch descends from 10
    advance(store, 13)
    store.snapshot()
    report = lineage(store)
    assert (10, [11, 13]) in report.forks
    text = dumps(report, "text")
    assert "(fork)" in text
    data = json.loads(dumps(report, "json"))
    parents = {n["step"]: n["parent"]["step"] if n["parent"] else None for n in data["nodes"]}
    assert parents == {10: None, 11: 10, 12: 11, 13: 10}
    assert dumps(report, "dot").count("->") == 3


@pytest.mark.parametrize("field", ["step", "digest"])
def test_tampered_manifest_is_reported(tmp_path, field):
    store = _store_with_steps(tmp_path, steps=(10, 11))
    path = os.path.join(store.local.root, "step-000000011", "manifest.json")
    raw = json.loads(open(path, "rb").read())
    if field == "step":
        raw["scalars"]["optimizer_step"] = 999
    else:
        shard = next(iter(raw["tensors"].values()))["shards"][0]
        shard["digest"] = "xxh3-128:" + "0" * 32
    with open(path, "w") as f:
        json.dump(raw, f)
    report = audit(store)
    assert not report.ok and any("integrity" in p.what for p in report.problems)


def test_a_rollback_fork_is_information_not_a_finding(tmp_path):
    store = rolled_back(tmp_path)
    report = audit(store)
    assert report.ok and report.problems == [], [str(p) for p in report.problems]
    assert report.checked_steps == 5 and len(report.nodes) == 4  # both states at step 2 are nodes
    assert report.forks == [(1, [2, 2])]
    assert {n.at for n in report.nodes.values()} == {Located(1), Located(2), Located(3), Located(2, "b1-2")}
    assert info_lines(report) == [
        "[info] lineage fork after step 1 (branch main): branches main, b1-2 start at steps 2, 2"]


def test_a_branch_state_is_verified_like_any_other(tmp_path):
    store = rolled_back(tmp_path)
    step_dir = os.path.join(store.local.root, "branches", "b1-2", "step-000000002")
    shard = max((f for f in _files(step_dir) if not f.endswith(".json")), key=os.path.getsize)
    with open(shard, "r+b") as f:
        raw = bytearray(f.read())
        raw[-1] ^= 0x01
        f.seek(0)
        f.write(raw)
    report = audit(store)
    assert not report.ok and {p.tier for p in report.problems if p.severity == "error"} == {"local@b1-2"}
    damaged = [n.at for n in report.nodes.values() if not n.ok]
    assert damaged == [Located(2, "b1-2")]  # main's step 2 is another state: untouched


def test_a_fork_whose_parent_gc_pruned_is_fine_and_never_prints_a_placeholder(tmp_path):
    store = _store_with_steps(tmp_path)
    store.push(store.local.load(10))
    advance(store, 13)
    store.snapshot()
    store.local.delete(10)  # through GC's path: leaves a pruning record
    report = audit(store)
    assert report.ok, [str(p) for p in report.problems]
    assert report.forks == [(10, [11, 13])]
    lines = info_lines(report)
    assert lines == ["[info] lineage fork after step 10 (no longer stored): branches main, b10-13 start at steps 11, 13"]
    assert "step -1" not in " ".join(lines) and "step -1" not in dumps(report, "text")


def test_a_second_root_lineage_is_information_naming_its_branch(tmp_path):
    store = _store_with_steps(tmp_path, steps=(1, 2))
    store.write(make_snapshot(step=5, seed=1), root=True)  # an imported checkpoint: a lineage of its own
    report = audit(store)
    assert report.ok and report.forks == []
    assert report.roots == [Located(1), Located(5, "root-5")]
    assert info_lines(report) == ["[info] lineage: step 5 on branch root-5 starts another root lineage "
                                  "(no parent; the run's first lineage starts at step 1)"]


def test_a_wrong_parent_digest_is_still_an_error(tmp_path):
    store = _store_with_steps(tmp_path, steps=(1, 2, 3))
    store.write(make_snapshot(step=4, seed=2), parent=ParentRef(3, "sha256:" + "0" * 64))
    report = audit(store)
    assert not report.ok
    assert [(p.tier, p.step, p.what) for p in report.problems] == [
        ("local", 4, "parent step 3 exists with another digest: broken hash chain")]


def test_a_branch_whose_parent_link_names_no_stored_state_is_an_error(tmp_path):
    store = _store_with_steps(tmp_path, steps=(1, 2, 3))
    store.write(make_snapshot(step=2, seed=3), parent=ParentRef(1, "sha256:" + "1" * 64))  # starts a branch
    report = audit(store)
    assert not report.ok
    assert [(p.tier, p.step, p.what) for p in report.problems] == [
        ("local@b1-2", 2, "parent step 1 is missing and was not pruned by GC: lineage gap")]


def test_a_branch_without_its_fork_record_is_a_warning_and_a_damaged_one_an_error(tmp_path):
    store = rolled_back(tmp_path)
    record = os.path.join(store.local.root, "branches", "b1-2", "branch.json")
    raw = open(record, "rb").read()
    os.remove(record)
    report = audit(store)
    assert report.ok and [(p.tier, p.severity, p.path) for p in report.problems] == [("local@b1-2", "warning", "branch.json")]
    with open(record, "wb") as f:
        f.write(raw[:-5])
    report = audit(store)
    assert not report.ok and [(p.tier, p.severity) for p in report.problems] == [("local@b1-2", "error")]
