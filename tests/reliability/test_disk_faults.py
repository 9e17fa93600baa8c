"""Disk faults: a full disk mid-snapshot, a read-only directory, a file damaged after its commit.

In every case: a clear error saying what was expected and what was found, nothing committed is lost,
no half-written step is visible, and the store keeps working once the fault is gone.

Real faults where the container allows them (a 6 MiB tmpfs, a read-only bind mount: both need
CAP_SYS_ADMIN and are skipped with the reason otherwise); injected ones always: the real write path
runs and the system call fails with the errno a real disk returns (ENOSPC, EIO, EROFS).
"""
from __future__ import annotations

import dataclasses
import errno
import glob
import os
import subprocess

import numpy as np
import pytest
from click.testing import CliRunner

from flowcheck import _native
from flowcheck.audit import audit
from flowcheck.cli import main
from flowcheck.errors import FlowcheckError, TierError
from flowcheck.store import Store
from tests.reliability import crash_child as cc

MiB = 1 << 20


# ---- helpers ------------------------------------------------------------------------
def open_store(root: str, object_url: str | None = None) -> Store:
    return Store(cc.config(root, object_url or f"file://{root}/object", keep_local=10, keep_object=10))


def commit(store: Store, *steps: int, promote: bool = False) -> None:
    for step in steps:
        store.write(cc.state(step, 1.5), "local")
        if promote:
            store.promote(step)


def assert_intact(store: Store, steps: dict[str, list[int]]) -> None:
    """Exactly these steps are visible, each bit-exact; audit finds no error; nothing half-written remains."""
    report = audit(store)
    assert report.ok, [str(p) for p in report.problems]
    for name, want in steps.items():
        tier = store.tier(name)
        assert tier.steps() == want, f"{name}: {tier.steps()} visible, expected {want}"
        assert tier.incomplete() == [], f"{name}: a half-written step was left behind: {tier.incomplete()}"
        for step in want:
            snap = tier.load(step)
            expected = cc.arrays(step, 1.5)
            assert {s: snap.array(s).tobytes() for s in snap.data} == {s: a.tobytes() for s, a in expected.items()}


def _mount(args: list[str]) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount here ({' '.join(args)}: {proc.stderr.strip() or proc.returncode}); "
                    "the injected variant of this test covers the same path")


def _umount(path: str) -> None:
    subprocess.run(["umount", path], check=False, capture_output=True)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 6 MiB tmpfs (needs CAP_SYS_ADMIN; skipped otherwise)."""
    path = tmp_path / "small"
    path.mkdir()
    _mount(["-t", "tmpfs", "-o", "size=6m", "tmpfs", str(path)])
    yield str(path)
    _umount(str(path))


class FailingWrites:
    """Makes the real write path fail the way a disk does, from a chosen point on."""

    def __init__(self, monkeypatch, *, after_bytes: int | None = None, path_part: str | None = None,
                 err: int = errno.ENOSPC, fail_sync: bool = False, fail_fsync: bool = False) -> None:
        self.after_bytes, self.path_part, self.err = after_bytes, path_part, err
        self.written = 0
        self.armed = True
        self._fds: dict[int, str] = {}
        real_open, real_pwrite, real_sync, real_fsync = os.open, _native.pwrite_all, _native.sync_filesystem, os.fsync

        def open_(path, flags, *a, **kw):
            fd = real_open(path, flags, *a, **kw)
            self._fds[fd] = os.fsdecode(path)
            return fd

        def pwrite_all(fd, buffer, offset=0, flush_every=0):
            view = memoryview(buffer).cast("B")
            path = self._fds.get(fd, "")
            if self.armed and self.path_part is not None and self.path_part in path:
                raise OSError(self.err, os.strerror(self.err), path)
            if self.armed and self.after_bytes is not None and self.written + view.nbytes > self.after_bytes:
                done = real_pwrite(fd, view[:max(0, self.after_bytes - self.written)], offset)  # the part that fit
                self.written += done
                raise OSError(self.err, os.strerror(self.err), path)
            self.written += view.nbytes
            return real_pwrite(fd, buffer, offset, flush_every)

        def sync_filesystem(fd):
            if self.armed and fail_sync:
                raise OSError(self.err, os.strerror(self.err))
            return real_sync(fd)

        faults = self

        class ChunkWriter(_native.ChunkWriter):  # the packed layout's native writer fails the same way
            def __init__(self, fd, chunk_bytes, flush_every=0, bound_dirty=False):
                super().__init__(fd, chunk_bytes, flush_every, bound_dirty)
                self.path = faults._fds.get(fd, "")

            def write(self, buffer, hash=True):
                view = memoryview(buffer).cast("B")
                if faults.armed and faults.path_part is not None and faults.path_part in self.path:
                    raise OSError(faults.err, os.strerror(faults.err), self.path)
                if faults.armed and faults.after_bytes is not None and faults.written + view.nbytes > faults.after_bytes:
                    fit = max(0, faults.after_bytes - faults.written)
                    super().write(view[:fit], hash)  # the part that fit
                    faults.written += fit
                    raise OSError(faults.err, os.strerror(faults.err), self.path)
                faults.written += view.nbytes
                return super().write(buffer, hash)

        def fsync(fd):  # a file of the step being written (its .tmp folder) fails to reach the disk
            if self.armed and fail_fsync and ".tmp" in self._fds.get(fd, ""):
                raise OSError(self.err, os.strerror(self.err), self._fds.get(fd))
            return real_fsync(fd)

        monkeypatch.setattr(os, "open", open_)
        monkeypatch.setattr(_native, "pwrite_all", pwrite_all)
        monkeypatch.setattr(_native, "ChunkWriter", ChunkWriter)
        monkeypatch.setattr(_native, "sync_filesystem", sync_filesystem)
        monkeypatch.setattr(os, "fsync", fsync)


# ---- a full disk ----------------------------------------------------------------------
def test_a_full_tmpfs_mid_snapshot_fails_clearly_keeps_older_steps_and_recovers(small_tmpfs, tmp_path):
    store = open_store(small_tmpfs, f"file://{tmp_path}/object")
    commit(store, 10)  # 2 MiB on disk (the 1.5 MiB tensor is stored as two full 1 MiB chunks)
    filler = os.path.join(small_tmpfs, "filler")
    with open(filler, "wb") as f:
        f.write(b"\0" * (3 * MiB))  # about 1 MiB left: step 11 runs out of space half way
    with pytest.raises(TierError) as err:
        store.write(cc.state(11, 1.5), "local")
    assert err.value.errno == errno.ENOSPC
    assert "step 11" in str(err.value) and "No space left on device" in str(err.value) and "MiB free" in str(err.value)
    assert_intact(open_store(small_tmpfs, f"file://{tmp_path}/object"), {"local": [10]})
    os.unlink(filler)  # space is back: the same snapshot now succeeds
    store.write(cc.state(11, 1.5), "local")
    assert_intact(open_store(small_tmpfs, f"file://{tmp_path}/object"), {"local": [10, 11]})


@pytest.mark.parametrize("where", ["first-write", "mid-shard", "manifest", "fsync-EIO", "syncfs-EIO"])
def test_a_write_failing_anywhere_in_a_snapshot_commits_nothing_and_loses_nothing(tmp_path, monkeypatch, where):
    store = open_store(str(tmp_path))
    if where == "syncfs-EIO":  # tiers.local.sync_mode: syncfs (the default, fsync, syncs file by file)
        store = Store(dataclasses.replace(store.config, tiers=dataclasses.replace(
            store.config.tiers, local=dataclasses.replace(store.config.tiers.local, sync_mode="syncfs"))))
    commit(store, 10, 11)
    kw = {"first-write": dict(after_bytes=0), "mid-shard": dict(after_bytes=MiB + 4096),
          "manifest": dict(path_part="manifest.json"), "fsync-EIO": dict(fail_fsync=True, err=errno.EIO),
          "syncfs-EIO": dict(fail_sync=True, err=errno.EIO)}[where]
    faults = FailingWrites(monkeypatch, **kw)
    with pytest.raises(TierError) as err:
        store.write(cc.state(12, 1.5), "local")
    assert err.value.errno == faults.err and "step 12" in str(err.value) and os.strerror(faults.err) in str(err.value)
    assert "nothing was committed and older steps are intact" in str(err.value)
    assert_intact(open_store(str(tmp_path)), {"local": [10, 11]})
    faults.armed = False  # the disk is healthy again
    store.write(cc.state(12, 1.5), "local")
    assert_intact(open_store(str(tmp_path)), {"local": [10, 11, 12]})


def test_a_full_staging_disk_fails_a_promotion_without_touching_either_tier(tmp_path, monkeypatch):
    store = open_store(str(tmp_path))
    commit(store, 10, 11, promote=True)
    commit(store, 12)
    faults = FailingWrites(monkeypatch, path_part=os.path.join(str(tmp_path), "staging"))
    with pytest.raises(TierError) as err:  # a FlowcheckError that keeps the errno
        store.promote(12)
    assert f"errno {errno.ENOSPC}" in str(err.value) and "staging" in str(err.value) and "step 12" in str(err.value)
    assert_intact(open_store(str(tmp_path)), {"local": [10, 11, 12], "object": [10, 11]})
    faults.armed = False
    store.promote(12)
    store.gc()  # GC removes the staging folder the failed upload left
    assert os.listdir(os.path.join(str(tmp_path), "staging")) == []
    assert_intact(open_store(str(tmp_path)), {"local": [10, 11, 12], "object": [10, 11, 12]})


# ---- a read-only directory ---------------------------------------------------------------
@pytest.fixture(params=["chmod", "ro-bind-mount", "injected-EROFS"])
def read_only(request, tmp_path, monkeypatch):
    """Make a folder read-only three ways; yields (make_read_only, make_writable, expected errnos).

    Root bypasses permission bits, so ``chmod`` only runs as a normal user; the read-only bind mount
    needs CAP_SYS_ADMIN; the injected variant makes every writing call under the folder fail with EROFS.
    """
    kind = request.param
    if kind == "chmod":
        if os.geteuid() == 0:
            pytest.skip("running as root: permission bits do not stop root (the bind mount / injected variants run)")

        def ro(path):
            for d, _dirs, _files in os.walk(path):
                os.chmod(d, 0o555)

        def rw(path):
            for d, _dirs, _files in os.walk(path):
                os.chmod(d, 0o755)

        yield ro, rw, (errno.EACCES, errno.EPERM)
    elif kind == "ro-bind-mount":
        mounted = []

        def ro(path):
            _mount(["--bind", path, path])
            mounted.append(path)
            _mount(["-o", "remount,ro,bind", path, path])

        def rw(path):
            _umount(mounted.pop())

        yield ro, rw, (errno.EROFS,)
        for path in mounted:
            _umount(path)
    else:
        state = {"root": None}

        def guard(real, *, paths=1, write_flags=False):
            def wrapper(*a, **kw):
                root = state["root"]
                hit = root and any(os.path.abspath(os.fsdecode(p)).startswith(root) for p in a[:paths])
                if hit and (not write_flags or a[1] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)):
                    raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(a[0]))
                return real(*a, **kw)

            return wrapper

        monkeypatch.setattr(os, "open", guard(os.open, write_flags=True))
        for name, paths in (("mkdir", 1), ("rename", 2), ("replace", 2), ("link", 2), ("unlink", 1), ("rmdir", 1)):
            monkeypatch.setattr(os, name, guard(getattr(os, name), paths=paths))

        def ro(path):
            state["root"] = os.path.abspath(path)

        def rw(path):
            state["root"] = None

        yield ro, rw, (errno.EROFS,)


def test_a_read_only_tier_directory_fails_a_snapshot_clearly_and_still_serves_reads(tmp_path, read_only):
    make_ro, make_rw, errnos = read_only
    root = str(tmp_path / "ro")
    store = open_store(root)
    commit(store, 10, 11)
    run_dir = store.local.root
    make_ro(run_dir)
    try:
        with pytest.raises(TierError) as err:
            store.write(cc.state(12, 1.5), "local")
        assert err.value.errno in errnos and "step 12" in str(err.value) and run_dir in str(err.value)
        assert "nothing was committed" in str(err.value)
        ro_store = open_store(root)
        assert ro_store.local.steps() == [10, 11]  # reads keep working on the read-only copy
        np.testing.assert_array_equal(ro_store.read(11, cc.QKV), cc.arrays(11, 1.5)[next(s for s in cc.arrays(11, 1.5) if s.tensor == cc.QKV)])
    finally:
        make_rw(run_dir)
    assert_intact(open_store(root), {"local": [10, 11]})
    store.write(cc.state(12, 1.5), "local")  # writable again: the node goes on
    assert_intact(open_store(root), {"local": [10, 11, 12]})


# ---- a file damaged after its commit --------------------------------------------------------
def _biggest_data_file(step_dir: str) -> str:
    files = [p for p in glob.glob(os.path.join(step_dir, "**"), recursive=True)
             if os.path.isfile(p) and not p.endswith(("manifest.json", "zarr.json"))]
    return max(files, key=os.path.getsize)


def _damage(path: str, how: str) -> None:
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    if how == "truncated":
        raw = raw[: len(raw) // 2]
    else:
        raw[len(raw) // 2] ^= 0x01  # one bit of tensor data, mid-file
    with open(path, "wb") as f:
        f.write(raw)


@pytest.mark.parametrize("how", ["truncated", "flipped-byte"])
@pytest.mark.parametrize("tier_name", ["local", "object"])
def test_a_file_damaged_after_commit_is_named_by_audit_and_reads_and_older_steps_stay_intact(tmp_path, tier_name, how):
    root = str(tmp_path)
    store = open_store(root)
    commit(store, 10, 11, promote=True)
    tier = store.tier(tier_name)
    damaged = _biggest_data_file(os.path.join(tier.root.removeprefix("file://"), "step-000000011"))
    rel = os.path.relpath(damaged, tier.root)
    _damage(damaged, how)

    cfg = tmp_path / "flowcheck.yaml"
    cfg.write_text(f"run: {cc.RUN}\ntiers:\n  local: {{root: {root}/local, chunk_mib: 1}}\n  object: {{url: 'file://{root}/object'}}\n")
    result = CliRunner().invoke(main, ["audit", "--config", str(cfg)])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("[error]")]
    assert errors and all(f"{tier_name} step 11" in line and rel in line for line in errors), result.output

    fresh = open_store(root).tier(tier_name)
    qkv = next(s for s in cc.arrays(11, 1.5) if s.tensor == cc.QKV)
    for read in (lambda: fresh.load(11).array(qkv), lambda: fresh.read(11, cc.QKV)):
        with pytest.raises(FlowcheckError) as err:
            read()
        assert rel in str(err.value) or damaged in str(err.value), str(err.value)
    # everything else is intact: the older step in this tier, and step 11 in the other tier
    other = "object" if tier_name == "local" else "local"
    np.testing.assert_array_equal(open_store(root).read(11, cc.QKV, prefer=other), cc.arrays(11, 1.5)[qkv])
    report = audit(open_store(root))
    assert {(p.tier, p.step) for p in report.problems if p.severity == "error"} == {(tier_name, 11)}
    snap = fresh.load(10)
    assert {s: snap.array(s).tobytes() for s in snap.data} == {s: a.tobytes() for s, a in cc.arrays(10, 1.5).items()}
