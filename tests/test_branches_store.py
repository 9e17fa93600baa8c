"""Branches through a real Store: a second state at a step is kept, rollbacks fork, GC and promotion follow the branch.

The reproductions failed before branches existed (a second state at a step was
dropped, "latest" and GC went by step number, a new step took an abandoned step
as its parent); a few guard what held already (the same state twice is one
state).  The end of the file drives a Store with random commit / rollback /
promote / gc sequences and checks that no state is ever lost silently; the
tests under "found by the model" are the failures it found, made plain.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flowcheck.branches import MAIN, Located
from flowcheck.config import Config, LocalConfig, ObjectConfig, PolicyConfig, TierPolicy, TiersConfig
from flowcheck.errors import StepNotFoundError
from flowcheck.manifest import Manifest, ParentRef
from flowcheck.state import Scalars, Shard, Snapshot
from flowcheck.store import Store
from flowcheck.tiers import retention
from flowcheck.tiers.base import step_dir
from tests.helpers import W, make_snapshot
from tests.test_store import advance

_plan = retention.plan  # the real planner, called with a chosen "now" where a test moves the clock


def make_store(root: str, object_url: str | None = None, local_keep: int = 3, object_keep: int = 2,
               abandoned_hours: float = 24.0) -> Store:
    def policy(keep: int) -> TierPolicy:
        return TierPolicy(keep_last=keep, tmp_grace_seconds=60, keep_abandoned_hours=abandoned_hours)

    return Store(Config(
        run="r1",
        tiers=TiersConfig(local=LocalConfig(root=os.path.join(root, "local")),
                          object=ObjectConfig(url=object_url or f"file://{root}/object", max_file_mib=1)),
        policy=PolicyConfig(local=policy(local_keep), object=policy(object_keep)),
    ))


def assert_same_state(got: Snapshot, want: Snapshot) -> None:
    """Every shard bit for bit, and the scalars."""
    assert got.step == want.step and set(got.data) == set(want.data)
    for shard in want.data:
        a, b = np.asarray(got.array(shard)), np.asarray(want.array(shard))
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), shard
    assert got.scalars.to_json() == want.scalars.to_json()


def rollback(store: Store, step: int | str, branch: str | None = None) -> Snapshot:
    """What a trainer restarting from an older state does: load it into RAM; the RAM state descends from it."""
    loaded = store.load(step, branch=branch)
    store.push(loaded)
    assert store.memory.head == loaded.origin.parent_ref()
    return loaded


def three_on_main(store: Store) -> dict[int, Manifest]:
    """main 250, 275, 300, snapshotted from RAM; their manifests by step."""
    store.push(make_snapshot(step=250))
    out = {250: store.snapshot()}
    for n in (275, 300):
        advance(store, n)
        out[n] = store.snapshot()
    return out


# ---- a. a second state at an existing step ---------------------------------------------------
def test_a_second_state_at_an_existing_step_is_kept_beside_the_first(tmp_path):
    store = make_store(str(tmp_path))
    old = store.write(make_snapshot(step=7, seed=1))
    store.push(make_snapshot(step=7, seed=2))
    new = store.snapshot()
    assert new.digest() != old.digest()
    hist = store.history()
    assert hist.branches() == [MAIN, "root-7"] and hist.current() == "root-7"
    assert_same_state(store.load(7), make_snapshot(step=7, seed=2))
    assert_same_state(store.load(7, branch=MAIN), make_snapshot(step=7, seed=1))
    assert store.manifest(7, "local").digest() == new.digest()
    assert store.manifest(7, "local", branch=MAIN).digest() == old.digest()


# ---- b. GC after a rollback ----------------------------------------------------------------------
def test_gc_after_a_rollback_keeps_the_new_branch_and_the_abandoned_one_within_its_grace(tmp_path):
    store = make_store(str(tmp_path), local_keep=3)
    main = three_on_main(store)
    rollback(store, 250)
    advance(store, 260)
    m260 = store.snapshot()
    assert m260.parent == main[250].parent_ref()
    branch = store.history().current()
    assert branch == "b250-260"
    report = store.gc(tiers=["local"])
    assert report.deleted["local"] == []
    assert report.kept["local"][Located(260, branch)] == "head of the current branch"
    assert report.kept["local"][Located(250)] == "last 3"
    for n in (275, 300):
        assert report.kept["local"][Located(n)].startswith("abandoned branch main until ")
    assert store.local.steps() == [250, 275, 300] and store.tier("local", branch).steps() == [260]
    assert store.load("latest").step == 260 and store.load("latest", branch=MAIN).step == 300

    # the same tiers, with no grace for abandoned branches: 275 and 300 go, each with a pruning record
    strict = make_store(str(tmp_path), local_keep=3, abandoned_hours=0)
    report = strict.gc(tiers=["local"])
    assert report.deleted["local"] == [Located(275), Located(300)]
    assert report.why["local"][Located(300)] == "abandoned branch main (no commit for 0 h)"
    assert strict.local.steps() == [250] and strict.tier("local", branch).steps() == [260]
    assert strict.local.pruned() == {275: main[275].digest(), 300: main[300].digest()}
    record = json.loads(strict.local._get_record(f"pruned/{step_dir(300)}.json"))
    assert record["branch"] == MAIN and record["parent"]["step"] == 275
    assert strict.load(250).step == 250 and strict.manifest(260).digest() == m260.digest()


def test_gc_past_the_grace_deletes_an_abandoned_branch_and_never_the_current_one(tmp_path):
    store = make_store(str(tmp_path), local_keep=1)
    three_on_main(store)
    rollback(store, 250)
    advance(store, 260)
    store.snapshot()
    later = datetime.now(timezone.utc) + timedelta(hours=25)
    with mock.patch.object(retention, "plan", lambda infos, policy: _plan(infos, policy, later)):
        report = store.gc(tiers=["local"])
    assert report.deleted["local"] == [Located(250), Located(275), Located(300)]
    assert report.why["local"][Located(250)] == "superseded on the current branch"
    assert report.why["local"][Located(275)] == "abandoned branch main (no commit for 24 h)"
    assert store.tier("local", "b250-260").steps() == [260] and store.local.steps() == []


# ---- c. parents after a rollback ------------------------------------------------------------------
def _rolled_back_past_260(tmp_path) -> tuple[Store, Manifest, Manifest]:
    """Main holds 250 and 260; RAM is rolled back to 250 (260 is the abandoned future)."""
    store = make_store(str(tmp_path))
    store.push(make_snapshot(step=250))
    m250 = store.snapshot()
    advance(store, 260)
    abandoned = store.snapshot()
    rollback(store, 250)
    return store, m250, abandoned


def test_a_step_after_a_rollback_descends_from_the_new_branch_never_the_abandoned_step(tmp_path):
    store, m250, abandoned = _rolled_back_past_260(tmp_path)
    advance(store, 260)  # a different 260: RAM was rolled back, then advanced once
    advance(store, 260)
    new260 = store.snapshot()
    assert new260.digest() != abandoned.digest() and new260.parent == m250.parent_ref()
    advance(store, 270)
    m270 = store.snapshot()
    assert m270.parent == new260.parent_ref() != abandoned.parent_ref()
    assert store.history().path("b250-260") == {250: MAIN, 260: "b250-260", 270: "b250-260"}


def test_a_step_straight_after_a_rollback_descends_from_the_state_rolled_back_to(tmp_path):
    store, m250, abandoned = _rolled_back_past_260(tmp_path)
    advance(store, 270)
    m270 = store.snapshot()
    assert m270.parent == m250.parent_ref() and m270.parent != abandoned.parent_ref()
    hist = store.history()
    assert hist.current() == "b250-270" and hist.records["b250-270"].fork.step == 250
    # a plain write continues the current branch: its parent is 270 of the new branch
    m280 = store.write(make_snapshot(step=280, seed=5))
    assert m280.parent == m270.parent_ref()


# ---- found by the model below ------------------------------------------------------------------------
def test_loading_by_digest_the_state_ram_holds_gives_that_state_not_the_current_branch_one(tmp_path):
    store = make_store(str(tmp_path))
    store.push(make_snapshot(step=250))
    store.snapshot()
    advance(store, 260)
    old260 = store.snapshot()
    want = store.load(260)
    rollback(store, 250)
    advance(store, 260)
    advance(store, 260)
    assert store.snapshot().digest() != old260.digest()  # b250-260 is current, with its own 260
    rollback(store, old260.digest())  # RAM now holds main's 260, off the current path
    assert store.find(old260.digest()) is store.memory
    got = store.load(old260.digest())  # the stored copy of that state, not 260 of the current branch
    assert got.origin.digest() == old260.digest()
    assert_same_state(got, want)


def test_a_state_restored_from_the_object_tier_is_snapshotted_with_its_identity(tmp_path):
    store = make_store(str(tmp_path))
    store.push(make_snapshot(step=10))
    store.snapshot()
    advance(store, 11)
    m11 = store.snapshot()
    store.promote()
    # a new node (empty local disk) restores RAM from the object tier, then snapshots it locally
    fresh = make_store(str(tmp_path / "node2"), object_url=f"file://{tmp_path}/object")
    rollback(fresh, 11)
    assert fresh.load(11).origin.digest() == m11.digest()  # RAM holds it: the stored copy is the object tier's
    again = fresh.snapshot()
    assert again.digest() == m11.digest() and again.parent == m11.parent  # one state, not a copy parented on itself
    assert fresh.local.manifest(11).digest() == fresh.object.manifest(11).digest()
    assert fresh.history().by_digest(m11.digest()) == [Located(11)]
    assert_same_state(fresh.load(11, prefer="local"), store.load(11, prefer="object"))
    advance(fresh, 12)
    assert fresh.snapshot().parent == m11.parent_ref()


# ---- d. idempotent commits and promotions ----------------------------------------------------------
def test_the_same_state_committed_twice_at_a_step_is_one_state(tmp_path):
    store = make_store(str(tmp_path))
    first = store.write(make_snapshot(step=10))
    again = store.write(make_snapshot(step=10))
    assert again.digest() == first.digest()
    store.push(make_snapshot(step=10))
    assert store.snapshot().digest() == first.digest()  # the RAM state equals the stored one
    run_dir = os.path.join(store.config.tiers.local.root, "r1")
    assert sorted(n for n in os.listdir(run_dir) if n.startswith("step-")) == ["step-000000010"]
    assert not os.path.exists(os.path.join(run_dir, "branches")) and store.history().branches() == [MAIN]


def test_promotion_is_idempotent_and_a_branch_state_lands_on_its_branch(tmp_path):
    store = make_store(str(tmp_path))
    _promote_branch_state(store)
    obj_root = store.object.root
    assert os.path.isdir(f"{obj_root}/branches/root-7/{step_dir(7)}")


def _promote_branch_state(store: Store) -> None:
    """Shared by the file:// and S3 object tiers."""
    old = store.write(make_snapshot(step=7, seed=1))
    store.push(make_snapshot(step=7, seed=2))
    new = store.snapshot()
    assert store.promote(7).digest() == new.digest()
    assert store.promote(7).digest() == new.digest()  # again: nothing written, same manifest
    assert store.promote().digest() == new.digest()
    assert store.tier("object", "root-7").steps() == [7] and store.object.steps() == []
    assert store.promote(7, branch=MAIN).digest() == old.digest()
    assert store.object.steps() == [7]
    assert store.tier("object", "root-7").branch_record() == store.tier("local", "root-7").branch_record()
    assert_same_state(store.load(7, prefer="object"), make_snapshot(step=7, seed=2))
    assert_same_state(store.load(7, prefer="object", branch=MAIN), make_snapshot(step=7, seed=1))
    assert store.history().current() == "root-7"


# ---- e. the same on S3 --------------------------------------------------------------------------------
@pytest.mark.s3
def test_branch_states_on_s3_promote_read_back_and_are_pruned_with_their_branch(tmp_path, object_bucket):
    store = make_store(str(tmp_path), object_url=object_bucket, local_keep=3, object_keep=3)
    _promote_branch_state(store)
    store = make_store(str(tmp_path / "again"), object_url=object_bucket + "2", local_keep=3, object_keep=3)
    main = three_on_main(store)
    for n in (275, 300):
        store.promote(n)
    rollback(store, 250)
    advance(store, 260)
    m260 = store.snapshot()
    assert store.promote().digest() == m260.digest()
    assert store.tier("object", "b250-260").steps() == [260] and store.object.steps() == [275, 300]
    assert store.manifest(260, prefer="object").parent == main[250].parent_ref()
    # 250 is only local: the object tier holds the branch's fork record all the same
    assert store.tier("object", "b250-260").branch_record().fork.step == 250
    assert store.gc(tiers=["object"]).deleted["object"] == []
    strict = make_store(str(tmp_path / "again"), object_url=object_bucket + "2", object_keep=3, abandoned_hours=0)
    report = strict.gc(tiers=["object"])
    assert report.deleted["object"] == [Located(275), Located(300)]
    assert strict.object.pruned() == {275: main[275].digest(), 300: main[300].digest()}
    assert strict.tier("object", "b250-260").steps() == [260]
    assert strict.tier("object", "b250-260").verify(260) == []


# ---- f. the files stay readable by their own libraries -----------------------------------------------
def test_branch_steps_open_with_zarr_and_safetensors(tmp_path):
    import zarr
    from safetensors import safe_open

    store = make_store(str(tmp_path))
    three_on_main(store)
    rollback(store, 250)
    advance(store, 260)
    m = store.snapshot()
    want = store.load(260).array(Shard(W, (0, 0), (4, 6)))
    path = os.path.join(store.config.tiers.local.root, "r1", "branches", "b250-260", step_dir(260))
    group = zarr.open_group(path, mode="r")
    attrs = group.attrs["flowcheck"]
    assert (attrs["run"], attrs["step"], attrs["layout"]) == ("r1", 260, "packed")
    (e,) = [e for e in attrs["tensors"][W] if e["offsets"] == [0, 0]]  # the tensor table: where it lies
    flat = np.asarray(group[e["array"]][e["start"]:e["start"] + int(np.prod(e["shape"]))])
    assert flat.reshape(e["shape"]).tobytes() == np.asarray(want).tobytes()

    promoted = store.promote()
    assert promoted.digest() == m.digest()
    files = [f.path for f in promoted.files]
    assert files and all(f.startswith(step_dir(260) + "/") for f in files)
    obj = os.path.join(str(tmp_path), "object", "r1", "branches", "b250-260", files[0])
    with safe_open(obj, framework="np") as f:
        assert f.metadata()["step"] == "260"
        key = next(k for k in f.keys() if k.startswith(W + "#0"))
        assert f.get_tensor(key).tobytes() == np.asarray(want).tobytes()


# ---- a model: random commit / rollback / promote / gc sequences against a real Store -----------------
@dataclass(frozen=True)
class Committed:
    """A state the model committed: what its data is and what it descends from."""

    step: int
    parent: ParentRef | None
    snapshot: Snapshot


class StoreModel:
    """A Store on tmp dirs (local + file:// object) and what it must hold after each operation."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.store = make_store(root, local_keep=2, object_keep=1)
        self.reader = make_store(root)  # checks list the tiers through their own Store: no warmed caches
        self.states: dict[str, Committed] = {}  # manifest digest -> the state
        self.present: dict[tuple[str, Located], str] = {}  # (tier, state) -> digest stored there
        self.pruned: dict[tuple[str, Located], str] = {}  # deleted by a GC whose plan said so
        self.ram = make_snapshot(step=1)
        self.ram_parent: ParentRef | None = None
        self.fills = 0
        self.store.push(self.ram)

    # ---- operations ------------------------------------------------------------------
    def commit(self, gap: int) -> None:
        """Train ``gap`` steps in RAM (the weights change), then snapshot."""
        step, self.fills = self.ram.step + gap, self.fills + 1
        with self.store.memory.update(step, Scalars(optimizer_step=step)) as u:
            for shard in u.shards():
                if shard.tensor == W:
                    u.array(shard)[...] = self.fills
        data = {s: (np.full(s.shape, self.fills, np.float32) if s.tensor == W else a) for s, a in self.ram.data.items()}
        self.ram = Snapshot("r1", step, self.ram.layout, data, Scalars(optimizer_step=step))
        self.snapshot(new=True)

    def snapshot(self, new: bool = False) -> None:
        """Snapshot RAM; unchanged since the last commit or rollback, it is the state RAM came from while
        a tier still holds that state (GC may have deleted it everywhere: then it is committed anew)."""
        m = self.store.snapshot()
        assert m.step == self.ram.step
        if new or self.ram_parent.manifest_digest not in self.present.values():
            assert m.digest() not in self.states and m.parent == self.ram_parent, (m.parent, self.ram_parent)
            self.states[m.digest()] = Committed(m.step, m.parent, self.ram)
        else:  # the same state again: no new identity, whichever tier holds it
            assert m.digest() == self.ram_parent.manifest_digest, (m.parent, self.ram_parent)
        self._stored("local", m.digest())
        self.ram_parent = m.parent_ref()

    def rollback(self, pick: int) -> None:
        """Load any state still stored (by its digest) into RAM, as a restarted trainer does."""
        held = set(self.present.values())
        digests = [d for d in self.states if d in held]  # in commit order: the same pick on every run
        d = digests[pick % len(digests)]
        loaded = self.store.load(d)
        assert loaded.origin.digest() == d
        assert_same_state(loaded, self.states[d].snapshot)
        self.store.push(loaded)
        self.ram, self.ram_parent = self.states[d].snapshot, ParentRef(loaded.step, d)

    def promote(self) -> None:
        latest = self.reader.history().resolve("latest")
        try:
            m = self.store.promote()
        except StepNotFoundError:
            assert ("local", latest) not in self.present
            return
        assert self.present[("local", latest)] == m.digest()
        self._stored("object", m.digest())

    def gc(self, hours: float) -> None:
        now = datetime.now(timezone.utc) + timedelta(hours=hours)
        with mock.patch.object(retention, "plan", lambda infos, policy: _plan(infos, policy, now)):
            report = self.store.gc()
        for tier, deleted in report.deleted.items():
            for at in deleted:
                assert report.why[tier][at]
                self.pruned[(tier, at)] = self.present.pop((tier, at))

    def _stored(self, tier: str, digest: str) -> None:
        at = next(Located(s.step, s.branch) for s in self.reader.history().states
                  if s.digest == digest and s.tier == tier)
        assert self.present.setdefault((tier, at), digest) == digest

    # ---- invariants ------------------------------------------------------------------
    def check(self) -> None:
        hist = self.reader.history()
        stored = {(s.tier, Located(s.step, s.branch)): s.digest for s in hist.states}
        assert stored == self.present  # nothing appeared, nothing vanished without a GC plan saying so
        for (tier, at), digest in self.pruned.items():
            if (tier, at) not in self.present:  # (a later state at the same step of a branch replaces the record)
                assert self.reader.tier(tier, at.branch).pruned()[at.step] == digest
        for (tier, at), digest in self.present.items():
            t = self.reader.tier(tier, at.branch)
            want = self.states[digest]
            assert t.manifest(at.step).parent == want.parent  # what the state really descends from
            assert_same_state(t.load(at.step), want.snapshot)
        latest = hist.resolve("latest")  # GC never deletes the current head
        assert any(at == latest for (_t, at) in self.present)
        leftovers = [os.path.join(d, n) for d, dirs, files in os.walk(self.root) for n in dirs + files
                     if n.endswith(".tmp") or os.path.basename(d) == ".staging"]
        assert leftovers == []  # no partial write, no staged upload, once every operation has returned


OPS = st.one_of(
    st.tuples(st.just("commit"), st.integers(1, 3)),
    st.tuples(st.just("snapshot"), st.none()),
    st.tuples(st.just("rollback"), st.integers(0, 1000)),
    st.tuples(st.just("promote"), st.none()),
    st.tuples(st.just("gc"), st.sampled_from([0.0, 1.0, 25.0, 100.0])),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OPS, min_size=1, max_size=14))
# a GC deleted the object copy of step 2 while a snapshot's look for the same state still listed it
@example([("promote", None), ("commit", 1), ("commit", 1), ("promote", None), ("rollback", 0), ("gc", 0.0),
          ("snapshot", None)])
def test_random_commits_rollbacks_promotions_and_gc_never_lose_a_state_silently(ops):
    with tempfile.TemporaryDirectory() as root:
        model = StoreModel(root)
        model.commit(1)
        model.check()
        for name, arg in ops:
            if name == "snapshot":
                model.snapshot()
            else:
                getattr(model, name)(*(() if arg is None else (arg,)))
            model.check()


def test_a_step_number_pruned_twice_on_one_branch_keeps_both_records(tmp_path):
    """A rollback that reuses a pruned step number: GC deleting the second state keeps the first one's record."""
    store = make_store(str(tmp_path))
    first, second = make_snapshot(step=3, seed=1), make_snapshot(step=3, seed=2)
    m1 = store.local.write(first)
    store.local.delete(3)
    m2 = store.local.write(second)
    store.local.delete(3)
    assert sorted(d for s, d in store.local.pruned_records() if s == 3) == sorted([m1.digest(), m2.digest()])


# ---- a run that never branched: the parent and branch come from the tiers' listings ---------------------------
def _as_the_history_says(store: Store, step: int, parent: ParentRef | None) -> tuple[ParentRef | None, str]:
    """``head_before`` and the branch ``placement`` picks, from every stored manifest (the listings' shortcut off)."""
    with mock.patch.object(Store, "_unbranched", lambda self: None):
        fresh = Store(store.config)
        return fresh.head_before(step), fresh.history(live={"local"}).place(step, parent)[0]


@pytest.mark.parametrize("local_keep", [2, 10])
def test_an_unbranched_run_finds_parent_and_branch_from_its_listings_as_the_history_does(tmp_path, local_keep):
    store = make_store(str(tmp_path), local_keep=local_keep, object_keep=10)
    assert store.head_before(5) is None and store.placement(5, "local", None).branch == MAIN  # an empty run
    committed = {}
    for step in (10, 20, 30, 40):
        committed[step] = store.write(make_snapshot(step=step, seed=step))
        store.promote(step)
        store.gc()  # local_keep=2: the object tier alone holds the oldest steps
    assert not store.local.branch_names() and store.history().current() == MAIN
    parents = [None] + [m.parent_ref() for m in committed.values()]
    for step in (0, 5, 10, 15, 20, 30, 35, 40, 45):
        want_parent, _ = _as_the_history_says(store, step, None)
        assert store.head_before(step) == want_parent, step
        for parent in parents:
            _, want_branch = _as_the_history_says(store, step, parent)
            if want_branch == MAIN:
                assert store.placement(step, "local", parent).branch == MAIN, (step, parent)
            else:  # a fork writes its branch record: asked of a copy of the store
                copy = tmp_path / "copy"
                shutil.rmtree(copy, ignore_errors=True)
                shutil.copytree(tmp_path / "local", copy / "local")
                shutil.copytree(tmp_path / "object", copy / "object")
                twin = make_store(str(copy), local_keep=local_keep, object_keep=10)
                assert twin.placement(step, "local", parent).branch == want_branch, (step, parent)
    # writing an earlier step again (a rollback by step number) forks a branch, as the history rules
    forked = store.placement(25, "local", committed[20].parent_ref())
    assert forked.branch == "b20-25" and store.local.branch_names() == ["b20-25"]
    assert store.write(make_snapshot(step=50, seed=50)).parent == committed[40].parent_ref()
