"""A deleted DCP step that a later step references keeps every file the reference names; over random histories of
saves, references, promotions, deletes and GC, every committed step reads back bit for bit.

A DCP step keeps its packs under ``nodes/<part>/packs/``; the folder a delete retains for a later step's references
used to lose them (only a top-level ``packs/`` was kept), so the later step's bytes were gone.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import flowcheck.dcp
from flowcheck.audit import audit
from flowcheck.cli import main
from flowcheck.state import Snapshot
from flowcheck.store import open_store
from tests.dcp.test_dcp_fsdp import config


def _run(*args: str) -> None:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output


def test_deleting_a_dcp_step_keeps_the_bytes_a_later_step_references(tmp_path):
    cfg = config(str(tmp_path))
    w = torch.randn(256, 64)
    dcp.save({"model": {"w": w}}, storage_writer=flowcheck.dcp.Writer(cfg, run="gpt", step=7))
    out = str(tmp_path / "x.safetensors")
    _run("export", "--config", cfg, "--step", "7", "--out", out)
    _run("snapshot", "--config", cfg, "--state", out, "--step", "8")  # stores references to step 7's bytes
    store = open_store(cfg)
    assert store.local.manifest(8).refs, "step 8 should reference step 7's files"
    _run("delete", "--config", cfg, "--step", "7", "--tier", "local")
    report = audit(open_store(cfg))
    assert report.ok, report.problems
    store = open_store(cfg)
    m = store.local.manifest(8)
    for name in m.tensors:
        assert np.array_equal(store.local.read(8, name), w.numpy()), name
    _run("gc", "--config", cfg)  # a GC sweep of the retained holder keeps what step 8 needs, too
    assert audit(open_store(cfg)).ok


# ---- every committed step reads back bit for bit over random histories ---------------------------------------------
OPS = ("dcp", "snapshot", "import", "promote", "promote_back", "delete_local", "delete_object", "gc")


def _history_config(root: str) -> str:
    path = f"{root}/fc.yaml"
    with open(path, "w") as f:
        f.write(f"run: gpt\ntiers:\n  local: {{root: {root}/local}}\n  object: {{url: file://{root}/object}}\n"
                "policy:\n  local: {keep_last: 2, tmp_grace_seconds: 0.01}\n"
                "  object: {keep_last: 2, tmp_grace_seconds: 0.01}\n")
    return path


def _arrays(snap: Snapshot) -> dict:
    return {shard: np.array(snap.array(shard)) for shard in snap.shards()}


def _held(store) -> dict[str, dict[int, object]]:
    """Per persistent tier: every step it holds on any branch -> the tier opened at that branch."""
    return {name: {n: t for t in store.branch_tiers(name) for n in t.steps()} for name in ("local", "object")}


def _derived(tier, base: int, step: int, r: int) -> Snapshot:
    """A new step from a stored one: most shards equal (stored as references to it), one changed unless r is even."""
    snap = tier.load(base)
    data = _arrays(snap)
    if r % 2:
        shard = sorted(data, key=lambda s: s.tensor)[r % len(data)]
        data[shard] = data[shard].copy()
        data[shard].reshape(-1).view(np.uint8)[0] ^= 1
    return dataclasses.replace(snap, step=step, data=data, origin=None, source="restore")


def _check(cfg: str, truth: dict) -> None:
    store = open_store(cfg)
    for name, steps in _held(store).items():
        for step, tier in steps.items():
            got = _arrays(tier.load(step))
            assert got.keys() == truth[step].keys(), (name, step)
            for shard, arr in truth[step].items():
                assert arr.tobytes() == got[shard].tobytes(), (tier.name, step, shard)
    report = audit(store)
    assert report.ok, [str(p) for p in report.problems if p.severity == "error"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(OPS + ("snapshot", "delete_local", "dcp")), st.integers(0, 1 << 20)),
                    min_size=4, max_size=12))
@example(ops=[("dcp", 0), ("snapshot", 1), ("delete_local", 0)])  # the history
@example(ops=[("dcp", 3), ("promote", 0), ("snapshot", 2), ("delete_local", 0), ("promote_back", 0), ("gc", 0),
              ("import", 1), ("delete_object", 0), ("gc", 0)])
def test_every_committed_step_reads_back_bit_for_bit_over_random_histories(tmp_path_factory, ops):
    """DCP saves, snapshots derived from stored steps (references to their bytes), imports (a new root), promotions
    both ways, deletes from either tier and GC, in any order: every step any tier still lists reads back exactly."""
    root = str(tmp_path_factory.mktemp("history"))
    cfg = _history_config(root)
    truth: dict[int, dict] = {}
    step = 0
    for op, r in ops:
        store = open_store(cfg)
        held = _held(store)
        where = {**held["object"], **held["local"]}
        known = sorted(where)
        if op == "dcp" or (not known and op in ("snapshot", "import")):
            step += 1
            g = torch.Generator().manual_seed(r)
            dcp.save({"model": {"w": torch.randn(64, 32, generator=g), "b": torch.arange(7) * step}},
                     storage_writer=flowcheck.dcp.Writer(cfg, run="gpt", step=step))
            truth[step] = _arrays(open_store(cfg).load(step))
        elif op in ("snapshot", "import"):
            step += 1
            base = known[r % len(known)]
            snap = _derived(where[base], base, step, r)
            store.write(snap, "local", root=op == "import")
            truth[step] = _arrays(snap)
        elif op in ("promote", "promote_back", "delete_local", "delete_object"):
            tier = {"promote": "local", "promote_back": "object"}.get(op, op[7:])
            steps = sorted(held[tier])
            if not steps:
                continue
            n = steps[r % len(steps)]
            branch = held[tier][n].branch
            if op.startswith("delete_"):
                store.delete(n, tier, branch, force=True)
            else:
                store.promote(n, tier, "object" if tier == "local" else "local", branch=branch)
        elif op == "gc":
            store.gc()
        _check(cfg, truth)
