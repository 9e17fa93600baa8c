"""Incremental steps through the store: snapshots from RAM reuse the parent's shards, GC and delete keep what
kept states (any branch) reference, audit stays clean, promotion and export give whole steps."""
from __future__ import annotations

import os
import threading

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowcheck.audit import audit
from flowcheck.config import LocalConfig
from flowcheck.manifest import INCREMENTAL_VERSION
from flowcheck.tiers.local import LocalTier
from tests.test_branches_store import make_store, rollback
from tests.tiers.test_incremental import FROZEN, assert_reads_back, lora_state


def snapshot_steps(store, steps, seed=0):
    out = {}
    for step in steps:
        snap = lora_state(step, seed=seed)
        store.push(snap)
        store.snapshot()
        out[step] = snap
    return out


def test_snapshots_from_ram_are_incremental_and_gc_keeps_referenced_bytes(tmp_path):
    store = make_store(str(tmp_path), local_keep=3)
    snaps = snapshot_steps(store, range(1, 11))
    local = store.tier("local")
    assert local.manifest(10).format_version == INCREMENTAL_VERSION
    assert [r.step for r in local.manifest(10).refs] == [1]
    report = store.gc(tiers=["local"])
    assert sorted(k.step for k in report.deleted["local"]) == list(range(1, 8))
    assert local.steps() == [8, 9, 10]
    for step in (8, 9, 10):
        assert_reads_back(store.tier("local"), snaps[step])
    rep = audit(store)
    assert rep.ok, [str(p) for p in rep.problems]
    assert audit(store, data=False).ok
    # step 1's frozen pack stays (retained), its changed shards' pack went
    retained = os.listdir(os.path.join(local.root, "retained"))
    assert len(retained) == 1 and retained[0].startswith("step-000000001-")


def test_rollback_branch_references_and_survives_gc_of_main(tmp_path):
    store = make_store(str(tmp_path), local_keep=2, abandoned_hours=1000)
    snaps = snapshot_steps(store, range(1, 7))
    rollback(store, 3)
    other = {}
    for step in (4, 5):
        snap = lora_state(step, seed=3)
        store.push(snap)
        m = store.snapshot()
        other[step] = snap
    branch = next(b for b in store.tier("local").branch_names())
    bt = store.tier("local", branch)
    assert m.format_version == INCREMENTAL_VERSION and {r.branch for r in m.refs} == {"main"}
    store.gc(tiers=["local"])
    for step, snap in other.items():
        if step in bt.steps():
            assert_reads_back(store.tier("local", branch), snap)
    for step in store.tier("local").steps():
        assert_reads_back(store.tier("local"), snaps[step])
    assert audit(store).ok


def test_promotion_of_an_incremental_step_uploads_a_whole_step_with_the_same_digest(tmp_path):
    store = make_store(str(tmp_path))
    snaps = snapshot_steps(store, range(1, 4))
    promoted = store.promote(3)
    assert promoted.digest() == store.tier("local").manifest(3).digest()
    obj = store.object
    loaded = obj.load(3)
    for shard in snaps[3].data:
        assert np.asarray(loaded.array(shard)).tobytes() == snaps[3].array(shard).tobytes()


# ---- a random history of commits, branches, deletions and GC ----------------------------------
OPS = st.lists(st.tuples(st.sampled_from(["commit", "commit", "branch", "delete", "sweep"]), st.integers(0, 1000)),
               min_size=3, max_size=12)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_random_histories_never_break_a_kept_state(tmp_path_factory, ops):
    root = tmp_path_factory.mktemp("hist")
    tiers = {"main": LocalTier(LocalConfig(root=str(root), fsync=False), "r1")}
    kept: dict[tuple[str, int], tuple] = {}  # (branch, step) -> (snapshot, manifest)
    heads: dict[str, int] = {}
    nbranch = 0
    for op, x in ops:
        if op == "commit" or (op == "branch" and not kept):
            branch = sorted(heads)[x % len(heads)] if heads else "main"
            step = heads.get(branch, 0) + 1
            parent = kept.get((branch, step - 1))
            if parent is None and kept:
                parent = kept[sorted(kept)[x % len(kept)]]
        elif op == "branch":
            parent = kept[sorted(kept)[x % len(kept)]]
            nbranch += 1
            branch, step = f"b{nbranch}", parent[1].step + 1
            tiers[branch] = tiers["main"].at_branch(branch)
        elif op == "delete":
            if kept:
                key = sorted(kept)[x % len(kept)]
                tiers[key[0]].delete(key[1])
                del kept[key]
            continue
        else:
            for t in tiers.values():
                t.clean_incomplete(0)
            continue
        snap = lora_state(step, seed=x)
        m = tiers[branch].write(snap, None if parent is None else parent[1].parent_ref())
        kept[(branch, step)] = (snap, m)
        heads[branch] = step
        for (b, n), (s, _m) in kept.items():
            assert_reads_back(LocalTier(LocalConfig(root=str(root), fsync=False), "r1").at_branch(b)
                              if b != "main" else LocalTier(LocalConfig(root=str(root), fsync=False), "r1"), s)
    for t in tiers.values():
        t.clean_incomplete(0)
    for (b, n), (s, _m) in kept.items():
        fresh = LocalTier(LocalConfig(root=str(root), fsync=False), "r1")
        t = fresh if b == "main" else fresh.at_branch(b)
        assert_reads_back(t, s)
        assert t.verify(n) == []


def test_store_audit_names_the_referencing_and_referenced_steps(tmp_path):
    store = make_store(str(tmp_path), local_keep=2)
    snapshot_steps(store, range(1, 5))
    store.gc(tiers=["local"])  # step 1 (the holder) is deleted, its frozen pack retained
    local = store.tier("local")
    folder = os.path.join(local.root, "retained", os.listdir(os.path.join(local.root, "retained"))[0])
    data = next(os.path.join(dp, f) for dp, _d, fs in os.walk(folder) for f in fs if f == "0")
    os.unlink(data)
    for report in (audit(store), audit(store, data=False)):
        assert not report.ok
        bad = [p for p in report.problems if p.severity == "error"]
        assert {p.step for p in bad} == {3, 4}
        assert all("step 1 of branch main" in p.what for p in bad), [str(p) for p in bad]


def test_cli_snapshots_of_a_partly_frozen_state_show_their_references_and_audit_clean(tmp_path):
    import torch
    from click.testing import CliRunner

    from flowcheck.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: r\ntiers:\n  local: {{root: {tmp_path / 'l'}}}\n  object: {{url: 'file://{tmp_path / 'o'}'}}\n")
    frozen = torch.randn(256, 256)
    for step in (5, 6):
        torch.save({"frozen": frozen, "adapter": torch.full((4, 4), float(step))}, tmp_path / "state.pt")
        got = CliRunner().invoke(main, ["snapshot", "--state", str(tmp_path / "state.pt"), "--step", str(step),
                                        "--config", str(cfg)])
        assert got.exit_code == 0, got.output
    shown = CliRunner().invoke(main, ["show", "--step", "6", "--config", str(cfg)])
    assert shown.exit_code == 0 and "references" in shown.output and "in step 5" in shown.output, shown.output
    assert CliRunner().invoke(main, ["audit", "--config", str(cfg)]).exit_code == 0
    assert CliRunner().invoke(main, ["audit", "--no-data", "--config", str(cfg)]).exit_code == 0


# ---- the memory tier's digests: a snapshot hashes only what was written since the last one ----------------------
def _update_adapters(store, snap):
    """Apply ``snap``'s adapters and counter in place (what a push with kept frozen shards writes)."""
    with store.memory.update(snap.step, snap.scalars) as u:
        for shard in snap.data:
            if shard.tensor not in FROZEN:
                np.copyto(u.array(shard), snap.array(shard))


def test_snapshots_from_ram_hash_only_the_shards_written_since_the_last_one(tmp_path, monkeypatch):
    from flowcheck.tiers import local_refs

    hashed = []
    real = local_refs._digest
    monkeypatch.setattr(local_refs, "_digest", lambda arr: hashed.append(arr.nbytes) or real(arr))
    store = make_store(str(tmp_path))
    snaps = {1: lora_state(1)}
    store.push(snaps[1])
    store.snapshot()
    frozen = sum(a.nbytes for s, a in snaps[1].data.items() if s.tensor in FROZEN)
    for step in (2, 3):
        snaps[step] = lora_state(step)
        _update_adapters(store, snaps[step])
        hashed.clear()
        m = store.snapshot()
        assert sum(hashed) == snaps[step].nbytes - frozen  # the adapters and the counter only
        assert [r.step for r in m.refs] == [1]
        assert_reads_back(store.tier("local"), snaps[step])
    assert audit(store).ok


def test_a_shard_written_while_a_snapshot_is_in_flight_is_hashed_again(tmp_path):
    """The digests a commit records are kept only for shards nothing wrote after the pin: a frozen shard changed
    during the snapshot (copy-on-write) is compared by its new bytes next time, never by the old digest."""
    store = make_store(str(tmp_path))
    first = lora_state(1)
    store.push(first)
    pinned = store.memory.pin()
    changed = next(s for s in first.data if s.tensor in FROZEN)

    def update() -> None:  # lands while step 1 is pinned: copied on write, or written once the snapshot wrote it
        with store.memory.update(2) as u:
            u.array(changed)[...] += 1.0

    writer = threading.Thread(target=update)
    writer.start()
    m1 = store.commit(pinned, "local", None)
    writer.join()
    store.memory.learn(pinned, m1)
    store.memory.release(pinned)
    store.memory.descends_from(m1.parent_ref())
    assert changed not in store.memory._known_digests_for_tests()
    m2 = store.snapshot()
    want = np.asarray(first.array(changed)) + 1.0
    assert store.tier("local").read(2, changed.tensor)[:changed.shape[0]].tobytes() == want.tobytes()
    assert m2.tensors[changed.tensor].shards[0].digest != m1.tensors[changed.tensor].shards[0].digest


def test_promotion_keeps_the_digest_when_a_tensors_shards_lie_in_two_steps(tmp_path):
    """A read-back incremental step comes in storage order (its own packs, then the parent's, or the reverse);
    the promoted copy still lists each tensor's shards in the stored order, so its manifest digest is the same."""
    from flowcheck.state import Scalars, Shard, Snapshot, StateLayout, TensorSpec

    layout = StateLayout((TensorSpec("w", "float32", (64, 16)),))
    rng = np.random.default_rng(5)
    first, second = rng.standard_normal((2, 32, 16)).astype(np.float32)
    store = make_store(str(tmp_path))
    for step, (a, b) in enumerate([(first, second), (first, second + 1), (first + 1, second + 1)], 1):
        data = {Shard("w", (0, 0), (32, 16)): a, Shard("w", (32, 0), (32, 16)): b}
        store.push(Snapshot("r1", step, layout, data, Scalars(optimizer_step=step)))
        store.snapshot()
    for step in (2, 3):  # step 2: the second shard changed, step 3: the first
        local = store.tier("local").manifest(step)
        assert local.refs
        assert store.promote(step).digest() == local.digest()
