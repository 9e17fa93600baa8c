"""Incremental steps in the local tier: unchanged shards are not written again, their manifest points at the
earlier step holding them (manifest v4), and every step reads back bit-exact."""
from __future__ import annotations

import os

import numpy as np
import pytest

from flowcheck.config import LocalConfig
from flowcheck.manifest import INCREMENTAL_VERSION, PACKED_VERSION, parse
from flowcheck.state import Scalars, Shard, Snapshot, StateLayout, TensorSpec
from flowcheck.tiers.local import LocalTier

FROZEN = [f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(4)]
ADAPTERS = [f"decoder.layers.{i}.lora_a.weight" for i in range(4)]
LAYOUT = StateLayout(tuple([TensorSpec(n, "float32", (64, 256), "column") for n in FROZEN]
                           + [TensorSpec(n, "float32", (8, 16)) for n in ADAPTERS]
                           + [TensorSpec("optimizer.step_count", "int64", ())]))
FROZEN_BYTES = 4 * 64 * 256 * 4
CHANGED_BYTES = 4 * 8 * 16 * 4 + 8
# a pack file rounds up to whole 64 KiB chunks (+ CRC32C and index); a step's changed shards fill two packs
# (float32, int64), and its zarr metadata and tensor table add a few KiB
OVERHEAD = 2 * ((64 << 10) + 4 + 16 + 4) + (16 << 10)


def lora_state(step: int, run: str = "r1", seed: int = 0) -> Snapshot:
    """Frozen weights (two row shards each, the same every step) plus adapters and a counter that change."""
    frozen = np.random.default_rng(1234).standard_normal((4, 64, 256)).astype(np.float32)
    rng = np.random.default_rng(seed * 100_000 + step)
    data = {}
    for i, n in enumerate(FROZEN):
        data[Shard(n, (0, 0), (32, 256))] = frozen[i, :32].copy()
        data[Shard(n, (32, 0), (32, 256))] = frozen[i, 32:].copy()
    for n in ADAPTERS:
        data[Shard(n, (0, 0), (8, 16))] = rng.standard_normal((8, 16)).astype(np.float32)
    data[Shard("optimizer.step_count", (), ())] = np.array(step, np.int64)
    return Snapshot(run, step, LAYOUT, data, Scalars(optimizer_step=step))


def local(tmp_path, branch: str = "main") -> LocalTier:
    t = LocalTier(LocalConfig(root=str(tmp_path / "local")), "r1")
    return t if branch == "main" else t.at_branch(branch)


def commit_history(tier: LocalTier, steps, parent=None, seed: int = 0):
    out = {}
    for step in steps:
        snap = lora_state(step, seed=seed)
        m = tier.write(snap, parent)
        out[step] = snap
        parent = m.parent_ref()
    return out, parent


def assert_reads_back(tier: LocalTier, snap: Snapshot) -> None:
    loaded = tier.load(snap.step)
    for shard in snap.data:
        assert loaded.array(shard).tobytes() == snap.array(shard).tobytes(), shard
    got = tier.read(snap.step, FROZEN[1], (slice(20, 40), slice(3, 200)))
    want = np.concatenate([snap.array(Shard(FROZEN[1], (0, 0), (32, 256))),
                           snap.array(Shard(FROZEN[1], (32, 0), (32, 256)))])[20:40, 3:200]
    assert got.tobytes() == want.tobytes()


def test_lora_history_writes_only_changed_shards_and_reads_back_bit_exact(tmp_path):
    tier = local(tmp_path)
    snaps, _ = commit_history(tier, range(1, 16))
    first = tier.manifest(1)
    assert first.format_version == PACKED_VERSION and first.nbytes > FROZEN_BYTES
    for step in range(2, 16):
        m = tier.manifest(step)
        assert m.format_version == INCREMENTAL_VERSION
        # every frozen shard points at step 1, which holds the bytes (references never chain)
        assert [(r.branch, r.step) for r in m.refs] == [("main", 1)]
        assert m.nbytes <= CHANGED_BYTES + OVERHEAD, (m.nbytes, first.nbytes)
        on_disk = sum(os.path.getsize(os.path.join(dp, f)) for dp, _d, fs in os.walk(tier.root + f"/step-{step:09d}")
                      for f in fs)
        assert on_disk <= CHANGED_BYTES + OVERHEAD + 4096  # + manifest.json
        assert m.referenced_nbytes >= FROZEN_BYTES
        assert m.digest() == m.parent_ref().manifest_digest
    for snap in snaps.values():
        assert_reads_back(local(tmp_path), snap)
        assert local(tmp_path).verify(snap.step) == []


def test_v4_manifest_digest_equals_the_full_steps_digest(tmp_path):
    """References are where the bytes lie, not what the state is: a step's digest does not depend on them."""
    inc = local(tmp_path / "a")
    _, parent = commit_history(inc, [1])
    m_inc = inc.write(lora_state(2), parent)
    full = local(tmp_path / "b")
    full.write(lora_state(1))
    m_full = full.write(lora_state(2))  # no parent given: nothing reused
    assert m_inc.refs and not m_full.refs
    body = m_full.to_json(integrity=False)
    body["parent"] = m_inc.to_json()["parent"]  # same state, same parent: same digest
    assert m_inc.digest() == parse(m_inc.to_bytes(), "x").digest()
    assert m_inc.format_version == INCREMENTAL_VERSION


def test_branch_state_at_an_existing_step_references_its_parent_on_main(tmp_path):
    main = local(tmp_path)
    snaps, _ = commit_history(main, range(1, 6))
    parent = main.manifest(3).parent_ref()
    branch = local(tmp_path, "b3-4")
    other = lora_state(4, seed=7)
    m = branch.write(other, parent)
    assert {(r.branch, r.step) for r in m.refs} == {("main", 1)}
    assert_reads_back(branch, other)
    assert_reads_back(main, snaps[4])
    m5 = branch.write(lora_state(5, seed=7), m.parent_ref())
    assert {(r.branch, r.step) for r in m5.refs} == {("main", 1)}


def test_parent_changed_shard_is_written_and_digest_not_recomputed_wrong(tmp_path):
    tier = local(tmp_path)
    _, parent = commit_history(tier, [1])
    snap = lora_state(2)
    changed = dict(snap.data)
    s = Shard(FROZEN[0], (0, 0), (32, 256))
    changed[s] = np.ones((32, 256), np.float32)
    snap = Snapshot("r1", 2, LAYOUT, changed, snap.scalars)
    m = tier.write(snap, parent)
    e = next(e for e in m.tensors[FROZEN[0]].shards if e.offsets == (0, 0))
    assert e.location[0].ref is None
    assert_reads_back(local(tmp_path), snap)
    assert local(tmp_path).verify(2) == []


def test_plain_zarr_reader_finds_a_referenced_shard(tmp_path):
    zarr = pytest.importorskip("zarr")
    tier = local(tmp_path)
    snaps, _ = commit_history(tier, [1, 2])
    step = os.path.join(tier.root, "step-000000002")
    table = zarr.open_group(step, mode="r").attrs["flowcheck"]["tensors"]
    e = table[FROZEN[2]][1]
    holder = zarr.open_group(os.path.normpath(os.path.join(step, e.get("in", "."))), mode="r")
    n = int(np.prod(e["shape"]))
    got = holder[e["array"]][e["start"]:e["start"] + n].reshape(e["shape"])
    want = snaps[2].array(Shard(FROZEN[2], tuple(e["offsets"]), tuple(e["shape"])))
    assert np.asarray(got).tobytes() == want.tobytes()


# ---- deleting and GC by reference ----------------------------------------------------------------
def retained(tier: LocalTier) -> list[str]:
    base = os.path.join(tier.root, "retained")
    return sorted(os.listdir(base)) if os.path.isdir(base) else []


def test_deleting_the_holder_keeps_its_referenced_bytes_until_nothing_references_them(tmp_path):
    tier = local(tmp_path)
    snaps, _ = commit_history(tier, range(1, 7))
    tier.delete(1)
    assert 1 not in tier.steps() and tier.pruned().get(1) is not None
    assert retained(tier) == [f"step-000000001-{tier.pruned()[1].partition(':')[2][:16]}"]
    for step in range(2, 7):
        assert_reads_back(local(tmp_path), snaps[step])
        assert local(tmp_path).verify(step) == []
    for step in range(2, 6):
        tier.delete(step)
        tier.clean_incomplete(3600)
    assert len(retained(tier)) == 1  # step 6 still references step 1's frozen shards
    assert_reads_back(local(tmp_path), snaps[6])
    # the retained folder lost the pack of step 1's changed shards, kept the frozen one
    folder = os.path.join(tier.root, "retained", retained(tier)[0])
    assert len(os.listdir(os.path.join(folder, "packs"))) < len(os.listdir(os.path.join(tier.root, "step-000000006",
                                                                                         "packs"))) + 2
    tier.delete(6)
    assert retained(tier)  # the last reference went with step 6: GC's sweep removes the folder
    tier.clean_incomplete(3600)
    assert retained(tier) == []


def test_a_step_no_one_references_is_deleted_as_before(tmp_path):
    tier = local(tmp_path)
    commit_history(tier, range(1, 4))
    tier.delete(3)
    assert retained(tier) == [] and not os.path.exists(os.path.join(tier.root, "step-000000003"))


def test_branch_references_keep_main_bytes(tmp_path):
    main = local(tmp_path)
    snaps, _ = commit_history(main, range(1, 4))
    branch = local(tmp_path, "b2-3")
    other = lora_state(3, seed=9)
    branch.write(other, main.manifest(2).parent_ref())
    for step in (1, 2, 3):
        main.delete(step)
    main.clean_incomplete(3600)
    assert retained(main)
    assert_reads_back(local(tmp_path, "b2-3"), other)
    assert local(tmp_path, "b2-3").verify(3) == []


class Boom(Exception):
    pass


def fail_at(monkeypatch, n: int) -> list[int]:
    """Make the n-th filesystem mutation of a delete or GC sweep raise (rename, rmtree, unlink)."""
    import shutil

    from flowcheck.tiers import local as local_mod
    from flowcheck.tiers import local_refs

    calls = [0]

    def wrap(fn):
        def inner(*a, **kw):
            calls[0] += 1
            if calls[0] == n:
                raise Boom(f"injected failure at I/O event {n}")
            return fn(*a, **kw)
        return inner

    fake_os = type("os", (), {})()
    for name in dir(os):
        setattr(fake_os, name, getattr(os, name))
    fake_os.rename, fake_os.unlink = wrap(os.rename), wrap(os.unlink)
    fake_shutil = type("shutil", (), {"rmtree": staticmethod(wrap(shutil.rmtree))})()
    for mod in (local_mod, local_refs):
        monkeypatch.setattr(mod, "os", fake_os)
        monkeypatch.setattr(mod, "shutil", fake_shutil)
    return calls


@pytest.mark.parametrize("n", range(1, 12))
def test_a_gc_failing_at_any_io_event_leaves_every_kept_step_readable(tmp_path, monkeypatch, n):
    tier = local(tmp_path)
    snaps, parent = commit_history(tier, range(1, 6))
    branch = local(tmp_path, "b3-4")
    other = lora_state(4, seed=5)
    branch.write(other, tier.manifest(3).parent_ref())
    calls = fail_at(monkeypatch, n)
    try:
        for step in (1, 2, 3, 4):
            local(tmp_path).delete(step)
        local(tmp_path).clean_incomplete(0)
        local(tmp_path, "b3-4").clean_incomplete(0)
    except Boom:
        pass
    monkeypatch.undo()
    kept = {s: snaps[s] for s in local(tmp_path).steps()}
    assert 5 in kept
    for snap in kept.values():
        assert_reads_back(local(tmp_path), snap)
    assert_reads_back(local(tmp_path, "b3-4"), other)
    # a later GC finishes the work and still breaks nothing
    for step in sorted(set(local(tmp_path).steps()) - {5}):
        local(tmp_path).delete(step)
    local(tmp_path).clean_incomplete(0)
    assert_reads_back(local(tmp_path), snaps[5])
    assert_reads_back(local(tmp_path, "b3-4"), other)
    assert calls[0] >= min(n, 1)


# ---- audit follows references -----------------------------------------------------------------
def holder_data_file(tier: LocalTier, step: int) -> str:
    m = tier.manifest(step)
    ref = m.refs[0]
    f = next(f for f in ref.files if f.path.endswith("/c/0"))
    return os.path.join(tier.root, f.path)


@pytest.mark.parametrize("data", [True, False])
def test_audit_names_both_steps_when_referenced_bytes_are_missing(tmp_path, data):
    tier = local(tmp_path)
    commit_history(tier, range(1, 4))
    os.unlink(holder_data_file(tier, 3))
    problems = local(tmp_path).verify(3, data=data)
    assert problems and any("step 1 of branch main" in p.what and "step 3 references" in p.what for p in problems)
    assert all(p.step == 3 for p in problems)


def test_audit_finds_a_flipped_byte_in_a_retained_referenced_shard(tmp_path):
    tier = local(tmp_path)
    commit_history(tier, range(1, 4))
    tier.delete(1)
    folder = os.path.join(tier.root, "retained", retained(tier)[0])
    data_files = [os.path.join(dp, f) for dp, _d, fs in os.walk(folder) for f in fs if f == "0"]
    with open(data_files[0], "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    problems = local(tmp_path).verify(3, data=False)
    assert any("step 1 of branch main" in p.what and "digest" in p.what for p in problems), problems
    with pytest.raises(Exception, match="step 1"):
        local(tmp_path).load(3).array(Shard(FROZEN[0], (0, 0), (32, 256)))


def test_export_of_an_incremental_step_is_self_contained(tmp_path):
    from safetensors.numpy import load_file

    from flowcheck.restore.export import export_file

    tier = local(tmp_path)
    snaps, _ = commit_history(tier, range(1, 5))
    out = str(tmp_path / "step3.safetensors")
    export_file(tier, tier.manifest(3), out)
    tier.delete(1)
    tier.delete(3)
    tier.clean_incomplete(0)
    import shutil
    shutil.rmtree(tier.root)  # the export needs nothing of the store
    got = load_file(out)
    for name in FROZEN:
        want = np.concatenate([snaps[3].array(Shard(name, (0, 0), (32, 256))),
                               snaps[3].array(Shard(name, (32, 0), (32, 256)))])
        assert got[name].tobytes() == want.tobytes()
    assert got[ADAPTERS[0]].tobytes() == snaps[3].array(Shard(ADAPTERS[0], (0, 0), (8, 16))).tobytes()


# ---- references stay inside the run, and are signed like the rest of the manifest -------------
def test_a_referenced_file_swapped_for_a_symlink_out_of_the_run_is_refused(tmp_path):
    tier = local(tmp_path)
    commit_history(tier, range(1, 3))
    target = holder_data_file(tier, 2)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(open(target, "rb").read())  # an identical copy: still not the store's to vouch for
    os.unlink(target)
    os.symlink(outside, target)
    with pytest.raises(Exception, match="outside the run folder|symlink"):
        local(tmp_path).load(2).array(Shard(FROZEN[0], (0, 0), (32, 256)))
    problems = local(tmp_path).verify(2, data=False)
    assert any("step 1 of branch main" in p.what for p in problems)


def test_signed_incremental_steps_read_back_and_a_forged_reference_is_refused(tmp_path):
    from flowcheck.errors import ManifestError

    key = b"k" * 32
    tier = LocalTier(LocalConfig(root=str(tmp_path / "local")), "r1", signing_key=key, require_signature=True)
    snaps, _ = commit_history(tier, range(1, 4))
    m = tier.manifest(3)
    assert m.refs and m.signature_valid(key)
    assert_reads_back(LocalTier(LocalConfig(root=str(tmp_path / "local")), "r1", signing_key=key,
                                require_signature=True), snaps[3])
    # pointing a reference elsewhere (even resealing the integrity field) breaks the signature
    import json

    from tests.test_manifest import reseal
    path = os.path.join(tier.root, "step-000000003", "manifest.json")
    raw = json.loads(open(path, "rb").read())
    raw["refs"][0]["files"][0]["digest"] = "xxh3-128:" + "0" * 32
    with open(path, "wb") as f:
        f.write(reseal(raw))
    with pytest.raises(ManifestError, match="signature"):
        LocalTier(LocalConfig(root=str(tmp_path / "local")), "r1", signing_key=key, require_signature=True).manifest(3)


def test_deleting_a_referenced_step_whose_manifest_was_damaged_still_keeps_the_referenced_bytes(tmp_path):
    tier = local(tmp_path)
    snaps, _ = commit_history(tier, range(1, 4))
    path = os.path.join(tier.root, "step-000000001", "manifest.json")
    with open(path, "ab") as f:
        f.write(b"garbage")
    local(tmp_path).delete(1)
    assert retained(tier)
    assert_reads_back(local(tmp_path), snaps[3])


# ---- the dedup check's probe: large shards whose first rows changed are not hashed before the write ------------
@pytest.mark.parametrize("same_tier", [True, False], ids=["probes-remembered", "parent-read"])
def test_probed_changed_shards_are_written_without_a_hash_pass_and_equal_first_rows_still_hash(tmp_path, monkeypatch,
                                                                                                same_tier):
    """The tier that wrote the parent compares the probe digests it kept (no parent pack is opened); another tier
    object (a restarted node) reads the parent's first rows; both settle the same shards."""
    from flowcheck.tiers import local_refs
    from flowcheck.tiers.local import LocalTier

    monkeypatch.setattr(local_refs, "PROBE_MIN", 4096)  # the small test shards (32 KiB) count as large
    monkeypatch.setattr(local_refs, "PROBE_BYTES", 1024)  # one row
    hashed, probing = [], []
    real, real_probes = local_refs._digest, local_refs.probe_digests
    monkeypatch.setattr(local_refs, "_digest", lambda arr: (None if probing else hashed.append(arr.nbytes)) or real(arr))

    def probe_digests(snapshot):  # their hashes of one row are not the hash pass counted here
        probing.append(1)
        try:
            return real_probes(snapshot)
        finally:
            probing.clear()

    monkeypatch.setattr(local_refs, "probe_digests", probe_digests)
    parent_reads = []
    real_read = LocalTier._read_packed
    monkeypatch.setattr(LocalTier, "_read_packed", lambda self, *a: parent_reads.append(a[1]) or real_read(self, *a))
    tier = local(tmp_path)
    one = lora_state(1)
    tier.write(one, None)
    data = dict(one.data)
    head_changed = Shard(FROZEN[0], (0, 0), (32, 256))
    tail_changed = Shard(FROZEN[1], (32, 0), (32, 256))
    data[head_changed] = one.array(head_changed) + np.float32(1)  # first row differs: settled by the probe
    tail = one.array(tail_changed).copy()
    tail[-1, -1] += np.float32(1)  # first rows equal: only the hash finds the change
    data[tail_changed] = tail
    two = Snapshot("r1", 2, LAYOUT, data, Scalars(optimizer_step=2))
    hashed.clear()
    writer = tier if same_tier else local(tmp_path)
    m = writer.write(two, tier.manifest(1).parent_ref())
    written = {(n, e.offsets) for n, t in m.tensors.items() for e in t.shards if e.location[0].ref is None}
    assert (FROZEN[0], (0, 0)) in written and (FROZEN[1], (32, 0)) in written
    assert (FROZEN[2], (0, 0)) not in written  # unchanged: referenced
    assert 32 * 256 * 4 in hashed and len(hashed) == len(one.data) - 1  # every candidate but the probed one
    assert (parent_reads == []) == same_tier
    loaded = local(tmp_path).load(2)
    for shard in two.data:
        assert loaded.array(shard).tobytes() == two.array(shard).tobytes(), shard
