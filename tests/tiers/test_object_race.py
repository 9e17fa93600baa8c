"""Two writers of one step on the object tier, as real processes: exactly one wins, nobody's files are clobbered.

Each round, two spawned processes commit different states (or, in some rounds, the identical
promoted state) as the same step, released together by a barrier. In half the rounds a second
barrier holds both right before their manifest create, after both uploaded everything: the
interleaving where the loser's upload used to overwrite the winner's files under shared names.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass

import numpy as np
import pytest

from flowcheck.config import ClusterConfig, LocalConfig, ObjectConfig
from flowcheck.errors import FlowcheckError, StepExistsError, StepIncompleteError
from flowcheck.state import Scalars, Shard, Snapshot, StateLayout, TensorSpec
from flowcheck.tiers.base import step_dir
from flowcheck.tiers.cluster import part_dir
from flowcheck.tiers.local import LocalTier
from flowcheck.tiers.object import ObjectTier, attempt_dir
from tests.conftest import OBJECT_SERVERS, bucket_on
from tests.helpers import global_array, make_snapshot

ROUNDS = 20  # of different states
SAME = 4  # plus this many rounds where both writers hold the identical (promoted) state
WAIT_S = 60  # a barrier never waits longer: a broken writer fails the test instead of hanging it


@dataclass(frozen=True)
class Round:
    step: int
    same: bool  # both writers promote the identical state (else each its own)
    hold: bool  # both finish uploading before either creates its manifest


def rounds(same: bool = True) -> list[Round]:
    out = [Round(100 + i, False, i % 2 == 0) for i in range(ROUNDS)]
    return out + [Round(200 + i, True, i % 2 == 0) for i in range(SAME)] if same else out


class _HeldTier(ObjectTier):
    """The object tier with the first exclusive create of a round held at a barrier (``hold``)."""

    hold = None

    def create_exclusive(self, rel, data, what="committing the manifest"):
        if self.hold is not None:
            barrier, self.hold = self.hold, None
            barrier.wait(WAIT_S)
        return super().create_exclusive(rel, data, what)


# ---- the writer process --------------------------------------------------------------
def _writer(url: str, work: str, who: int, plan: list[Round], start, commit, results, cluster_nodes) -> None:
    cluster = ClusterConfig(nodes=cluster_nodes, commit_wait_s=0.05) if cluster_nodes else None
    tier = _HeldTier(ObjectConfig(url=url, max_file_mib=1), "r1", staging_dir=os.path.join(work, f"staging-{who}"),
                     node="n0" if cluster else f"w{who}", cluster=cluster)
    promoted = LocalTier(LocalConfig(root=os.path.join(work, "local")), "r1")
    for r in plan:
        snap = promoted.load(r.step) if r.same else state(r.step, who, cluster_nodes)
        try:
            start.wait(WAIT_S)
            tier.hold = commit if r.hold else None
            m = tier.write(snap)
            results.put((r.step, who, "committed", m.digest(), sorted(f.path for f in m.files)))
        except StepExistsError as e:
            results.put((r.step, who, "exists", str(e), None))
        except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
            results.put((r.step, who, "failed", traceback.format_exc(), None))


def state(step: int, who: int, cluster_nodes=None) -> Snapshot:
    """Writer ``who``'s state at ``step`` (in cluster mode: node n0's half of it)."""
    snap = make_snapshot(step=step, seed=who + 1)
    if not cluster_nodes:
        return snap
    return Snapshot(snap.run, step, CLUSTER_LAYOUT, half(snap, 0), Scalars(optimizer_step=step))


# a multi-node step of one tensor: node n0 owns rows 0-3, node n1 rows 4-7 (of the helpers' [8, 6] weight)
W = "w"
CLUSTER_LAYOUT = StateLayout((TensorSpec(W, "float32", (8, 6), "row"),))


def half(snap: Snapshot, node: int) -> dict:
    full = global_array(snap, next(iter(snap.layout.tensors)).name)
    return {Shard(W, (4 * node, 0), (4, 6)): full[4 * node:4 * node + 4].copy()}


def race(url: str, work: str, plan: list[Round], cluster_nodes=None) -> dict[int, list[tuple]]:
    """Run every round with two writer processes; step -> both writers' outcomes."""
    ctx = mp.get_context("spawn")
    start, commit, results = ctx.Barrier(2), ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(url, work, who, plan, start, commit, results, cluster_nodes))
             for who in (0, 1)]
    for p in procs:
        p.start()
    out: dict[int, list[tuple]] = {}
    try:
        for _ in range(2 * len(plan)):
            step, who, outcome, detail, files = results.get(timeout=WAIT_S * 2)
            out.setdefault(step, []).append((who, outcome, detail, files))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return out


# ---- the checks ----------------------------------------------------------------------
def stored(tier: ObjectTier, step: int) -> set[str]:
    """Every file under a step's prefix, relative to the run root (one raw listing)."""
    prefix = tier._p(step_dir(step))
    tier.fs.invalidate_cache(prefix)
    return {p[len(tier.root) + 1:] for p in tier.fs.find(prefix)}


def check_round(tier: ObjectTier, r: Round, outcomes: list[tuple], want) -> list[str]:
    """``want(who)``: what writer ``who`` wrote, as {tensor: global array}."""
    failed = [d for _, o, d, _ in outcomes if o == "failed"]
    if failed:
        return [f"step {r.step}: a writer failed:\n{failed[0]}"]
    m = tier.manifest(r.step, fresh=True)
    committed = [(who, files) for who, o, d, files in outcomes if o == "committed"]
    bad = []
    if r.same:  # the loser gets the winner's manifest back (its own files removed)
        if len(committed) != 2 or any(files != sorted(f.path for f in m.files) for _, files in committed):
            bad.append(f"step {r.step}: expected both writers to get the committed manifest, got {outcomes}")
    elif len(committed) != 1 or [o for _, o, _, _ in outcomes].count("exists") != 1:
        bad.append(f"step {r.step}: expected one commit and one StepExistsError, got {outcomes}")
    else:
        winner = committed[0][0]
        for name, array in want(winner, r.step).items():
            try:
                if tier.read(r.step, name).tobytes() != array.tobytes():
                    bad.append(f"step {r.step}: {name} does not read back as writer {winner}'s state")
            except FlowcheckError as e:
                bad.append(f"step {r.step}: {name} does not read back as writer {winner}'s state: {e}")
    problems = tier.verify(r.step)
    if problems:
        bad.append(f"step {r.step}: verify: {[str(p) for p in problems]}")
    named = {f.path for f in m.files} | {f"{step_dir(r.step)}/manifest.json"}
    named |= {f"{part_dir(r.step, n.node)}/manifest.json" for n in m.nodes}
    if stored(tier, r.step) != named:
        bad.append(f"step {r.step}: files no manifest names remain: {sorted(stored(tier, r.step) - named)}")
    return bad


def _promoted_states(work: str) -> None:
    """The identical rounds' state, committed once on a local tier both writers promote from."""
    local = LocalTier(LocalConfig(root=os.path.join(work, "local")), "r1")
    for r in rounds():
        if r.same:
            local.write(make_snapshot(step=r.step, seed=7))


def arrays_of(snap: Snapshot) -> dict:
    return {t.name: global_array(snap, t.name) for t in snap.layout.tensors}


def written(who: int, step: int) -> dict:
    return arrays_of(make_snapshot(step=step, seed=who + 1))


def run_races(url: str, work: str) -> None:
    _promoted_states(work)
    began = time.monotonic()
    outcomes = race(url, work, rounds())
    tier = ObjectTier(ObjectConfig(url=url, max_file_mib=1), "r1", staging_dir=os.path.join(work, "staging"))
    bad = [b for r in rounds() for b in check_round(tier, r, outcomes[r.step], written)]
    assert not bad, f"{len(bad)} findings:\n" + "\n".join(bad[:10])
    assert tier.steps() == sorted(r.step for r in rounds())
    print(f"{len(rounds())} rounds of two racing writers on {url.split(':')[0]}: {time.monotonic() - began:.1f}s")


def test_two_writers_of_a_step_on_file_never_clobber_each_other(tmp_path):
    run_races(f"file://{tmp_path / 'object'}", str(tmp_path))


@pytest.mark.s3
def test_two_writers_of_a_step_on_s3_never_clobber_each_other(tmp_path, object_bucket):
    run_races(object_bucket, str(tmp_path))


def test_two_writers_with_one_node_name_never_clobber_each_others_part(tmp_path):
    """Multi-node mode: node n1's part is in; two writers both named n0 race with different halves.
    The winner's part commits the step; the loser's files go."""
    url, work, nodes = f"file://{tmp_path / 'object'}", str(tmp_path), ["n0", "n1"]
    cluster = ClusterConfig(nodes=nodes, commit_wait_s=0.05)
    n1 = ObjectTier(ObjectConfig(url=url, max_file_mib=1), "r1", staging_dir=str(tmp_path / "n1"), node="n1",
                    cluster=cluster)
    for r in rounds(same=False):
        snap = make_snapshot(step=r.step, seed=9)
        with pytest.raises(StepIncompleteError, match=r"still missing \['n0'\]"):
            n1.write(Snapshot("r1", r.step, CLUSTER_LAYOUT, half(snap, 1), Scalars(optimizer_step=r.step)))
    outcomes = race(url, work, rounds(same=False), nodes)

    def want(who: int, step: int) -> dict:
        rows = {**half(make_snapshot(step=step, seed=who + 1), 0), **half(make_snapshot(step=step, seed=9), 1)}
        return {W: np.concatenate([rows[s] for s in sorted(rows, key=lambda s: s.offsets)])}

    bad = [b for r in rounds(same=False) for b in check_round(n1, r, outcomes[r.step], want)]
    assert not bad, f"{len(bad)} findings:\n" + "\n".join(bad[:10])


# ---- leftovers of a loser killed before it removed its files ----------------------------
@pytest.fixture(params=["file", *OBJECT_SERVERS])
def object_url(request, tmp_path) -> str:
    return f"file://{tmp_path / 'object'}" if request.param == "file" else bucket_on(request, request.param)


def _abandoned(tier: ObjectTier, step: int, name: str = "shard-00000-of-00001.safetensors") -> str:
    """A killed loser's upload inside a committed step: an attempt folder no manifest names."""
    folder = attempt_dir(step_dir(step))
    _put(tier, f"{folder}/{name}", b"a loser's bytes")
    return folder


def _put(tier: ObjectTier, rel: str, data: bytes) -> None:
    tier.fs.makedirs(tier._p(rel).rsplit("/", 1)[0], exist_ok=True)
    tier.fs.pipe_file(tier._p(rel), data)


def _tier(url: str, tmp_path, **kw) -> ObjectTier:
    return ObjectTier(ObjectConfig(url=url, max_file_mib=1), "r1", staging_dir=str(tmp_path / "s"), **kw)


def test_a_losers_leftovers_warn_within_the_grace_and_fail_audit_after(object_url, tmp_path):
    young = _tier(object_url, tmp_path, grace_s=3600)
    young.write(make_snapshot(step=5))
    folder = _abandoned(young, 5)
    _put(young, f"{folder}/shard-00001-of-00002.safetensors", b"more of them")
    (warning,) = young.verify(5)  # one finding per folder
    assert warning.severity == "warning" and warning.path == folder and "another writer" in warning.what
    assert young.clean_incomplete(older_than_s=3600) == []  # perhaps still in flight: kept
    old = _tier(object_url, tmp_path, grace_s=0.01)
    time.sleep(0.05)
    (error,) = old.verify(5)
    assert error.severity == "error" and error.path == folder and "abandoned" in error.what
    assert old.clean_incomplete(older_than_s=0.01) == [old._p(folder)]
    assert old.verify(5) == []
    assert stored(old, 5) == {f.path for f in old.manifest(5).files} | {f"{step_dir(5)}/manifest.json"}
    assert all(old.read(5, n).tobytes() == a.tobytes() for n, a in arrays_of(make_snapshot(step=5)).items())


def test_a_killed_commits_manifest_temporary_is_only_a_warning_and_gc_removes_it(tmp_path):
    tier = _tier(f"file://{tmp_path / 'object'}", tmp_path, grace_s=0.01)
    tier.write(make_snapshot(step=5))
    rel = f"{step_dir(5)}/manifest.json.123.456.partial"  # a kill between the hard link and the unlink
    _put(tier, rel, tier._manifest_bytes(5))
    time.sleep(0.05)
    (warning,) = tier.verify(5)
    assert warning.severity == "warning" and warning.path == rel
    assert tier.clean_incomplete(older_than_s=0.01) == [tier._p(rel)] and tier.verify(5) == []


def test_gc_of_a_step_removes_every_attempts_files(object_url, tmp_path):
    tier = _tier(object_url, tmp_path)
    tier.write(make_snapshot(step=5))
    tier.write(make_snapshot(step=6))
    _abandoned(tier, 5)
    tier.delete(5)
    assert tier.steps() == [6] and stored(tier, 5) == set() and tier.incomplete() == []
    assert tier.verify(6) == []
