"""Careless and hostile input at the store: GC never empties a tier, nothing unreadable is committed.

Each test is the attack (or the accident) of issue 21's items 3, 5 and 13, run against real tiers.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from flowcheck.branches import Located, check_branch
from flowcheck.config import SigningConfig
from flowcheck.errors import FlowcheckError, ManifestError, UnsafeNameError
from flowcheck.manifest import ParentRef
from flowcheck.state import check_name
from flowcheck.store import Store
from tests.helpers import make_snapshot
from tests.test_store import make_store


def _committed(store: Store, steps) -> Store:
    for step in steps:  # each a child of the one before (Store.write continues the current branch)
        store.write(make_snapshot(step=step, seed=step), "local")
    return store


def _flip_a_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(40)
        b = f.read(1)
        f.seek(40)
        f.write(bytes([b[0] ^ 1]))


def test_gc_never_deletes_the_newest_readable_step_for_damaged_newer_ones(tmp_path):
    store = _committed(make_store(tmp_path, local_keep=1), (1, 2, 3, 4))
    for step in (3, 4):  # the two newest manifests each lose a bit
        _flip_a_byte(os.path.join(store.local.root, f"step-00000000{step}", "manifest.json"))
    report = Store(store.config).gc(tiers=["local"])
    assert report.deleted["local"] == [Located(1)]
    assert store.local.steps() == [2, 3, 4]
    assert store.local.load(2).step == 2  # still restorable
    assert "unclassifiable" in report.kept["local"][Located(3)]
    assert Store(store.config).locate("latest")[1] == 2


def test_gc_with_signing_required_keeps_the_newest_signed_step_over_unsigned_newer_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWCHECK_HMAC_KEY", "k" * 32)
    store = _committed(make_store(tmp_path, local_keep=1), (1, 2))  # signed
    monkeypatch.delenv("FLOWCHECK_HMAC_KEY")
    _committed(Store(store.config), (3, 4))  # an unsigned writer slipped two newer steps in
    monkeypatch.setenv("FLOWCHECK_HMAC_KEY", "k" * 32)
    cfg = dataclasses.replace(store.config, signing=SigningConfig(required=True))
    report = Store(cfg).gc(tiers=["local"])
    assert report.deleted["local"] == [Located(1)]
    assert Store(cfg).local.steps() == [2, 3, 4]
    assert Store(cfg).locate("latest")[1] == 2  # "latest" is the newest state a reader will accept


def test_a_writer_that_must_sign_and_cannot_refuses_to_commit(tmp_path, monkeypatch):
    monkeypatch.delenv("FLOWCHECK_HMAC_KEY", raising=False)
    store = make_store(tmp_path)
    store = Store(dataclasses.replace(store.config, signing=SigningConfig(required=True)))
    with pytest.raises(ManifestError, match="signing is required.*no key is set.*nothing was written"):
        store.local.write(make_snapshot(step=1))
    assert not os.path.exists(store.local.root) or os.listdir(store.local.root) == []


@pytest.mark.parametrize("digest", ["sha256:xyz", "sha256:" + "A" * 64, "md5:" + "0" * 32, ""])
def test_a_malformed_parent_digest_is_refused_before_anything_is_written(tmp_path, digest):
    store = make_store(tmp_path)
    with pytest.raises(ManifestError, match="parent.manifest_digest"):
        store.write(make_snapshot(step=2), "local", ParentRef(1, digest))
    assert store.local.steps() == [] and store.local.incomplete() == []


def test_a_negative_parent_step_is_refused(tmp_path):
    store = make_store(tmp_path)
    with pytest.raises(ManifestError, match="parent.step"):
        store.write(make_snapshot(step=2), "local", ParentRef(-1, "sha256:" + "0" * 64))


def test_a_step_number_the_folder_names_cannot_hold_is_refused(tmp_path):
    store = make_store(tmp_path)
    with pytest.raises(FlowcheckError, match="from 0 to 999,999,999"):
        store.write(make_snapshot(step=1_000_000_000), "local")
    assert not os.path.exists(store.local.root) or os.listdir(store.local.root) == []
    store.write(make_snapshot(step=999_999_999), "local")
    assert store.local.steps() == [999_999_999]


@pytest.mark.parametrize("name", ["weight\n", "a.b\n", "ok\nevil"])
def test_names_with_a_newline_are_refused(name):
    with pytest.raises(UnsafeNameError):
        check_name(name)
    with pytest.raises(FlowcheckError):
        check_branch(name)


def test_export_never_follows_a_planted_partial_symlink(tmp_path):
    """Item 11: a `<out>.partial` symlink planted next to the output must not redirect the export's write."""
    from flowcheck.restore.export import export_file

    store = make_store(tmp_path)
    m = store.local.write(make_snapshot(step=10))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    os.symlink(victim, str(out) + ".partial")
    export_file(store.local, m, str(out))
    assert victim.read_text() == "precious" and out.stat().st_size > 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.safetensors", "model.safetensors.partial"]


# ---- item 6: hidden deletions -------------------------------------------------------------------------
def _audit_errors(store: Store) -> list[str]:
    from flowcheck.audit import audit

    return [str(p) for p in audit(Store(store.config), data=False).problems if p.severity == "error"]


def test_deleting_the_newest_step_by_hand_is_an_audit_error(tmp_path):
    import shutil

    store = _committed(make_store(tmp_path, local_keep=5), (1, 2, 3))
    assert _audit_errors(store) == []
    shutil.rmtree(os.path.join(store.local.root, "step-000000003"))
    errors = _audit_errors(store)
    assert any("expected step 3" in e and "'latest' record" in e for e in errors), errors


def test_a_hand_written_unsigned_pruning_record_hides_no_deleted_step_when_signing_is_on(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("FLOWCHECK_HMAC_KEY", "k" * 32)
    store = _committed(make_store(tmp_path, local_keep=5), (1, 2, 3))
    Store(store.config).local.delete(1)  # a deletion by GC: sealed, so it explains the gap
    assert _audit_errors(store) == []
    shutil.rmtree(os.path.join(store.local.root, "step-000000002"))  # the middle step, by hand
    forged = {"step": 2, "manifest_digest": None, "branch": "main", "parent": None}
    store.local._put_record("pruned/step-000000002.json", json.dumps(forged).encode())
    errors = _audit_errors(store)
    assert any("step 2" in e and ("gap" in e or "missing" in e.lower()) for e in errors), errors


def test_a_forged_latest_record_is_ignored_when_signing_is_on(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWCHECK_HMAC_KEY", "k" * 32)
    store = _committed(make_store(tmp_path), (1, 2))
    store.local._put_record("latest", b'{"step":99}\n')
    assert Store(store.config).local.latest_record() is None
    store.local.write(make_snapshot(step=3, seed=3))  # the next commit writes a sealed record again
    assert Store(store.config).local.latest_record() == 3


@pytest.mark.parametrize("hide", ["previous step written into latest", "latest removed"])
def test_a_newest_step_deleted_and_hidden_through_the_latest_record_is_an_audit_error(tmp_path, monkeypatch, hide):
    """With signing on, the 'latest' record is evidence, not trust: deleting the newest step and then writing the
    previous step's number into 'latest' (no key to seal it) or removing 'latest' no longer leaves audit clean."""
    import shutil

    monkeypatch.setenv("FLOWCHECK_HMAC_KEY", "k" * 32)
    store = _committed(make_store(tmp_path, local_keep=5), (1, 2, 3))
    assert _audit_errors(store) == []
    shutil.rmtree(os.path.join(store.local.root, "step-000000003"))
    latest = os.path.join(store.local.root, "latest")
    if hide == "latest removed":
        os.remove(latest)
    else:
        with open(latest, "w") as f:
            f.write("2\n")
    errors = _audit_errors(store)
    assert any("'latest' record" in e for e in errors), errors
    assert Store(store.config).locate("latest")[1] == 2  # readers still resolve latest from what is committed


# ---- item 10: a host whose clock runs ahead ------------------------------------------------------------
def test_a_gc_on_a_host_whose_clock_runs_ahead_keeps_another_writers_fresh_tmp(tmp_path, monkeypatch):
    """The grace of a .tmp folder (local) or a manifest-less step prefix (object) is measured on the clock that
    stamped it — the disk's or the store's — not on the GC host's, which here runs three hours ahead."""
    import time as _time

    store = _committed(make_store(tmp_path), (1,))
    store.promote(1)
    fresh_local = os.path.join(store.local.root, "step-000000002.abcd.tmp")
    old_local = os.path.join(store.local.root, "step-000000003.dead.tmp")
    fresh_obj = tmp_path / "object" / "r1" / "step-000000002" / "attempt-000000000000"
    for d in (fresh_local, old_local, fresh_obj):
        os.makedirs(d)
        with open(os.path.join(d, "data"), "wb") as f:
            f.write(b"x")
    two_hours_ago = _time.time() - 7200
    os.utime(os.path.join(old_local, "data"), (two_hours_ago, two_hours_ago))
    os.utime(old_local, (two_hours_ago, two_hours_ago))
    real = _time.time
    monkeypatch.setattr(_time, "time", lambda: real() + 3 * 3600)
    gc_store = Store(dataclasses.replace(store.config, policy=dataclasses.replace(
        store.config.policy,
        local=dataclasses.replace(store.config.policy.local, tmp_grace_seconds=3600),
        object=dataclasses.replace(store.config.policy.object, tmp_grace_seconds=3600))))
    report = gc_store.gc()
    assert os.path.exists(fresh_local) and os.path.exists(fresh_obj), report.cleaned
    assert not os.path.exists(old_local)


# ---- item 7: region reads are verified ---------------------------------------------------------------
def test_a_region_read_never_returns_rows_of_a_shard_whose_bytes_were_swapped(tmp_path):
    """Two rows of an object-tier shard swapped in place (no checksum of the file format catches it): a read
    of one row must fail on the shard's digest, not return the other row's data."""
    import struct

    from flowcheck.errors import IntegrityError
    from tests.helpers import W

    store = _committed(make_store(tmp_path), (1,))
    store.promote(1)
    m = store.object.manifest(1)
    entry = next(e for e in m.tensors[W].shards if e.offsets == (0, 0))
    piece = entry.location[0]
    path = tmp_path / "object" / "r1" / piece.path
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    begin, _end = json.loads(raw[8:8 + n])[piece.key]["data_offsets"]
    row = 6 * 4
    a, b = 8 + n + begin, 8 + n + begin + row
    raw[a:a + row], raw[b:b + row] = raw[b:b + row], raw[a:a + row]
    path.write_bytes(bytes(raw))
    reader = Store(store.config).object
    with pytest.raises(IntegrityError, match="digest"):
        reader.read(1, W, (slice(0, 1),))
    # an intact shard's rows still come back (and only its first region read reads it whole)
    want = make_snapshot(step=1, seed=1)
    got = reader.read(1, W, (slice(5, 6),))
    full = np.concatenate([want.array(s) for s in sorted((s for s in want.data if s.tensor == W),
                                                         key=lambda s: s.offsets)])
    assert got.tobytes() == full[5:6].tobytes()
