"""Audit: every flipped byte in any stored file is caught; gaps, broken links and forks are reported."""
from __future__ import annotations

import json
import os

import pytest

from flowcheck.audit import audit, dumps, lineage
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
