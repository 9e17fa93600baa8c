"""Durability order: data is durable before the manifest that commits it, and the commit before it is published.

The real calls are recorded (os.open/pwrite/fsync/rename/replace/link, syncfs, file copies, S3
requests) while a tier writes; the tests then check the order a power loss needs:

    every data file written -> fsync'd (or one syncfs of the filesystem) -> manifest written -> manifest
    fsync'd -> manifest renamed into place -> its directory fsync'd -> step renamed -> parent fsync'd

A checker that never fails proves nothing, so one test breaks the order on purpose and expects it to.
"""
from __future__ import annotations

import os
import shutil

import pytest

from flowcheck import _native
from flowcheck.config import LocalConfig, ObjectConfig
from flowcheck.tiers.local import LocalTier
from flowcheck.tiers.object import ObjectTier
from tests.helpers import big_snapshot, make_snapshot


class Recorder:
    """The I/O calls of this process, in order, as (kind, path[, path])."""

    def __init__(self, monkeypatch) -> None:
        self.events: list[tuple] = []
        self._fds: dict[int, str] = {}
        real_open, real_fsync, real_pwrite, real_syncfs = os.open, os.fsync, _native.pwrite_all, _native.sync_filesystem
        real_copy = shutil.copyfile

        def open_(path, flags, *a, **kw):
            fd = real_open(path, flags, *a, **kw)
            self._fds[fd] = os.path.abspath(os.fsdecode(path))
            return fd

        def pwrite_all(fd, *a, **kw):
            self.events.append(("write", self._fds.get(fd, "?")))
            return real_pwrite(fd, *a, **kw)

        def fsync(fd):
            self.events.append(("fsync", self._fds.get(fd, "?")))
            return real_fsync(fd)

        def syncfs(fd):
            self.events.append(("syncfs", self._fds.get(fd, "?")))
            return real_syncfs(fd)

        def copyfile(src, dst, *a, **kw):
            self.events.append(("write", os.path.abspath(dst)))
            return real_copy(src, dst, *a, **kw)

        events, fds = self.events, self._fds

        class ChunkWriter(_native.ChunkWriter):  # the packed layout's native writer: its writes are writes
            def __init__(self, fd, chunk_bytes, flush_every=0, bound_dirty=False):
                super().__init__(fd, chunk_bytes, flush_every, bound_dirty)
                self.path = fds.get(fd, "?")

            def write(self, buffer, hash=True):
                events.append(("write", self.path))
                return super().write(buffer, hash)

            def finish(self):
                events.append(("write", self.path))
                return super().finish()

        monkeypatch.setattr(os, "open", open_)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(_native, "pwrite_all", pwrite_all)
        monkeypatch.setattr(_native, "ChunkWriter", ChunkWriter)
        monkeypatch.setattr(_native, "sync_filesystem", syncfs)
        monkeypatch.setattr(shutil, "copyfile", copyfile)
        for name in ("rename", "replace", "link"):
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._two_paths(name, real))

    def _two_paths(self, kind, real):
        def wrapper(src, dst, *a, **kw):
            self.events.append((kind, os.path.abspath(src), os.path.abspath(dst)))
            return real(src, dst, *a, **kw)

        return wrapper

    def index(self, kind: str, pred) -> list[int]:
        return [i for i, e in enumerate(self.events) if e[0] == kind and pred(*e[1:])]

    def first(self, kind: str, pred) -> int:
        found = self.index(kind, pred)
        assert found, f"no {kind} event matching the expectation in {self.events}"
        return found[0]


def check_local_order(rec: Recorder, root: str, step_name: str) -> None:
    """The local tier's commit protocol, as a power loss needs it."""
    in_tmp = lambda p: p.startswith(os.path.join(root, step_name + ".")) and ".tmp" in p
    is_manifest = lambda p: in_tmp(p) and os.path.basename(p).startswith("manifest.json")
    manifest_write = rec.first("write", is_manifest)
    data = sorted({e[1] for e in rec.events[:manifest_write] if e[0] == "write" and in_tmp(e[1])})
    assert data, "no data file was written before the manifest"
    assert not [e for e in rec.events[manifest_write:] if e[0] == "write" and in_tmp(e[1]) and not is_manifest(e[1])], \
        "a data file was written after the manifest"
    synced_all = rec.index("syncfs", lambda p: True)
    if synced_all and synced_all[0] < manifest_write:
        last_data_write = max(i for i, e in enumerate(rec.events) if e[0] == "write" and e[1] in data)
        assert last_data_write < synced_all[0], "syncfs ran before the last data write"
    else:
        for path in data:
            last = max(rec.index("write", lambda p, path=path: p == path))
            syncs = [i for i in rec.index("fsync", lambda p, path=path: p == path) if i > last]
            assert syncs and syncs[0] < manifest_write, f"{path} is not fsync'd between its last write and the manifest"
        for d in {os.path.dirname(p) for p in data}:
            assert [i for i in rec.index("fsync", lambda p, d=d: p == d) if i < manifest_write], f"directory {d} not fsync'd before the manifest"
    manifest_sync = rec.first("fsync", is_manifest)
    placed = rec.first("replace", lambda s, d: is_manifest(s) and os.path.basename(d) == "manifest.json")
    tmp_dir = os.path.dirname(rec.events[placed][2])
    dir_sync = [i for i in rec.index("fsync", lambda p: p == tmp_dir) if i > placed]
    renamed = rec.first("rename", lambda s, d: s == tmp_dir and d == os.path.join(root, step_name))
    root_sync = [i for i in rec.index("fsync", lambda p: p == root) if i > renamed]
    assert manifest_write < manifest_sync < placed, "the manifest is not fsync'd before it takes its final name"
    assert dir_sync and dir_sync[0] < renamed, "the step directory is not fsync'd (manifest entry) before the rename"
    assert root_sync, "the run directory is not fsync'd after the rename: the commit itself is not durable"
    latest = rec.index("replace", lambda s, d: d == os.path.join(root, "latest"))
    assert not latest or latest[0] > root_sync[0], "'latest' is published before the commit is durable"


@pytest.mark.parametrize("sync_mode", ["syncfs", "fsync"])
def test_local_tier_makes_data_durable_before_the_manifest_and_the_manifest_before_the_rename(tmp_path, monkeypatch, sync_mode):
    tier = LocalTier(LocalConfig(root=str(tmp_path), sync_mode=sync_mode, chunk_mib=1), "r1")
    rec = Recorder(monkeypatch)
    tier.write(big_snapshot(step=10))
    check_local_order(rec, os.path.join(str(tmp_path), "r1"), "step-000000010")


# every kind of file the packed layout writes (tiers/zarr_pack.py), by its path in the step folder
PACKED_KINDS = {
    "step group zarr.json": lambda rel: rel == "zarr.json",
    "packs group zarr.json": lambda rel: rel == "packs/zarr.json",
    "pack array zarr.json": lambda rel: rel.startswith("packs/") and rel.endswith("/zarr.json") and rel.count("/") == 2,
    "pack shard file": lambda rel: rel.startswith("packs/") and rel.endswith("/c/0"),
}


@pytest.mark.parametrize("sync_mode", ["syncfs", "fsync"])
def test_every_file_kind_of_the_packed_layout_is_durable_before_the_manifest(tmp_path, monkeypatch, sync_mode):
    from tests.reliability import crash_child as cc

    tier = LocalTier(LocalConfig(root=str(tmp_path), sync_mode=sync_mode), cc.RUN)
    rec = Recorder(monkeypatch)
    m = tier.write(cc.state(10, 1.5))  # three dtypes (float32, bf16, int64): three packs
    root = os.path.join(str(tmp_path), cc.RUN)
    check_local_order(rec, root, "step-000000010")
    written = {os.path.relpath(e[1], root).split("/", 1)[1] for e in rec.events if e[0] == "write" and ".tmp" in e[1]}
    assert m.format_version == 3
    for kind, is_kind in PACKED_KINDS.items():
        assert [r for r in written if is_kind(r)], f"no {kind} among the files written: {sorted(written)}"
    assert len([r for r in written if PACKED_KINDS["pack shard file"](r)]) == 3


@pytest.mark.parametrize("sabotage", ["data files", "metadata and folders", "syncfs"])
def test_the_order_check_fails_when_data_is_not_synced_before_the_commit(tmp_path, monkeypatch, sabotage):
    """The checker above catches a tier that commits without syncing its data first."""
    from flowcheck.tiers import zarr_pack

    tier = LocalTier(LocalConfig(root=str(tmp_path), sync_mode="syncfs" if sabotage == "syncfs" else "fsync"), "r1")
    if sabotage == "data files":
        real = zarr_pack.write_pack
        monkeypatch.setattr(zarr_pack, "write_pack",
                            lambda path, pack, array, written, fsync, *rest: real(path, pack, array, written, False, *rest))
    elif sabotage == "metadata and folders":
        monkeypatch.setattr("flowcheck.tiers.local.sync_paths", lambda paths, workers=8: None)
    else:
        monkeypatch.setattr("flowcheck.tiers.local.make_tree_durable", lambda root, mode: None)
    rec = Recorder(monkeypatch)
    tier.write(make_snapshot(step=10))
    with pytest.raises(AssertionError, match="not fsync'd"):
        check_local_order(rec, os.path.join(str(tmp_path), "r1"), "step-000000010")


def test_object_tier_on_files_syncs_every_data_file_before_the_manifest_is_linked_into_place(tmp_path, monkeypatch):
    tier = ObjectTier(ObjectConfig(url=f"file://{tmp_path / 'object'}", max_file_mib=1), "r1", staging_dir=str(tmp_path / "staging"))
    rec = Recorder(monkeypatch)
    tier.write(big_snapshot(step=10))
    step = str(tmp_path / "object" / "r1" / "step-000000010")
    manifest = os.path.join(step, "manifest.json")
    committed = rec.first("link", lambda s, d: d == manifest)
    files = sorted({e[1] for e in rec.events if e[0] == "write" and e[1].startswith(step + os.sep) and e[1].endswith(".safetensors")})
    assert len(files) >= 3, files  # the 2.5 MiB shard spans several 1 MiB files
    for path in files:
        last = max(rec.index("write", lambda p, path=path: p == path))
        assert [i for i in rec.index("fsync", lambda p, path=path: p == path) if last < i < committed], f"{path} not fsync'd before the commit"
    assert [i for i in rec.index("fsync", lambda p: p == step) if i < committed], "the step folder is not fsync'd before the commit"
    partial = rec.events[committed][1]
    assert rec.first("write", lambda p: p == partial) < rec.first("fsync", lambda p: p == partial) < committed
    assert [i for i in rec.index("fsync", lambda p: p == step) if i > committed], "the manifest's directory entry is not fsync'd"


@pytest.mark.s3
def test_object_tier_on_s3_puts_the_manifest_only_after_every_data_upload_completed(tmp_path, monkeypatch, s3_bucket):
    import aiobotocore.endpoint
    import botocore.endpoint

    log: list[tuple[str, str, str]] = []
    real_send, real_async = botocore.endpoint.Endpoint._send, aiobotocore.endpoint.AioEndpoint._send

    def key(request):
        return request.url.split("?")[0].rsplit("/", 1)[-1]

    def send(self, request):
        log.append(("start", request.method, key(request)))
        try:
            return real_send(self, request)
        finally:
            log.append(("done", request.method, key(request)))

    async def send_async(self, request):
        log.append(("start", request.method, key(request)))
        try:
            return await real_async(self, request)
        finally:
            log.append(("done", request.method, key(request)))

    monkeypatch.setattr(botocore.endpoint.Endpoint, "_send", send)
    monkeypatch.setattr(aiobotocore.endpoint.AioEndpoint, "_send", send_async)
    tier = ObjectTier(ObjectConfig(url=s3_bucket, max_file_mib=1), "r1", staging_dir=str(tmp_path / "staging"))
    tier.write(big_snapshot(step=10))
    manifest_put = log.index(("start", "PUT", "manifest.json"))
    data = [i for i, e in enumerate(log) if e[2].endswith(".safetensors") and e[1] in ("PUT", "POST")]
    assert len({log[i][2] for i in data}) >= 3
    assert max(data) < manifest_put, "a data upload was still in flight when the manifest was PUT"
    starts = [i for i in data if log[i][0] == "start"]
    dones = [i for i in data if log[i][0] == "done"]
    assert len(starts) == len(dones) and max(dones) < manifest_put


def test_export_syncs_the_file_before_it_takes_its_final_name(tmp_path, monkeypatch):
    from flowcheck.restore.export import export_file

    tier = LocalTier(LocalConfig(root=str(tmp_path / "local")), "r1")
    m = tier.write(make_snapshot(step=10))
    out = str(tmp_path / "out" / "model.safetensors")
    rec = Recorder(monkeypatch)
    export_file(tier, m, out)
    placed = rec.first("replace", lambda s, d: d == out)
    partial = rec.events[placed][1]
    last_write = max(rec.index("write", lambda p: p == partial))
    assert [i for i in rec.index("fsync", lambda p: p == partial) if last_write < i < placed], "export renamed before fsync"
    assert [i for i in rec.index("fsync", lambda p: p == os.path.dirname(out)) if i > placed], "the rename is not fsync'd"


# every kind of file a DCP save through flowcheck.dcp.Writer leaves in its local step folder (flowcheck/dcp/parts.py),
# by its path in the step folder: each rank's part is the packed layout under nodes/<node>/, written straight there
DCP_KINDS = {
    "step group zarr.json": lambda rel: rel == "zarr.json",
    "nodes group zarr.json": lambda rel: rel == "nodes/zarr.json",
    **{f"part's {kind}": (lambda rel, is_kind=is_kind: rel.startswith("nodes/") and rel.count("/") >= 2
                          and is_kind(rel.split("/", 2)[2])) for kind, is_kind in PACKED_KINDS.items()},
}


def check_folders_synced(rec: Recorder, tmp: str, manifest_write: int) -> None:
    """Every folder from a written file up to the step folder is fsync'd after its last entry appeared (a file's
    first write follows its creation; a subfolder's creation precedes the first write beneath it) and before the
    manifest: a power loss keeps every name the manifest lists."""
    born = {}
    for i, e in enumerate(rec.events[:manifest_write]):
        if e[0] == "write" and e[1].startswith(tmp + os.sep):
            born.setdefault(e[1], i)
    assert born, "no file was written into the step folder before the manifest"
    last_entry: dict[str, int] = {}
    for path, i in born.items():
        d = os.path.dirname(path)
        while len(d) >= len(tmp):
            last_entry[d] = max(last_entry.get(d, -1), i)
            d = os.path.dirname(d)
    for d, i in sorted(last_entry.items()):
        assert [j for j in rec.index("fsync", lambda p, d=d: p == d) if i < j < manifest_write], \
            f"folder {d} is not fsync'd between its last new entry and the manifest"


def _dcp_save_recorded(tmp_path, monkeypatch) -> tuple[Recorder, str, object]:
    import torch
    import torch.distributed.checkpoint as dcp

    import flowcheck.dcp

    state = {"model": {"w": torch.randn(64, 32), "b": torch.randn(32).to(torch.bfloat16), "n": torch.arange(9)},
             "sched": {"last_epoch": 3}, "step": 3}
    writer = flowcheck.dcp.Writer(str(tmp_path / "local"), run="gpt", step=3)
    rec = Recorder(monkeypatch)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return rec, os.path.join(str(tmp_path / "local"), "gpt"), writer.committed


def test_a_dcp_save_makes_every_file_and_folder_of_every_part_durable_before_the_step_manifest(tmp_path, monkeypatch):
    rec, root, m = _dcp_save_recorded(tmp_path, monkeypatch)
    check_local_order(rec, root, "step-000000003")
    placed = rec.first("replace", lambda s, d: os.path.basename(d) == "manifest.json" and ".dcp-" in d)
    tmp = os.path.dirname(rec.events[placed][2])
    check_folders_synced(rec, tmp, rec.first("write", lambda p: p.startswith(tmp + os.sep + "manifest.json")))
    listed = {f.path.split("/", 1)[1] for f in m.files}
    for kind, is_kind in DCP_KINDS.items():
        assert [r for r in listed if is_kind(r)], f"no {kind} among the step's files: {sorted(listed)}"
    assert {r.split("/")[1] for r in listed if r.startswith("nodes/") and r.count("/") >= 2} == {"objects", "rank-00000"}


def test_the_folder_check_fails_when_a_dcp_part_skips_its_folder_syncs(tmp_path, monkeypatch):
    """The checker above catches a part whose small files and folders are not synced before the commit."""
    monkeypatch.setattr("flowcheck.tiers.local.sync_paths", lambda paths, workers=8: None)
    rec, root, _ = _dcp_save_recorded(tmp_path, monkeypatch)
    placed = rec.first("replace", lambda s, d: os.path.basename(d) == "manifest.json" and ".dcp-" in d)
    tmp = os.path.dirname(rec.events[placed][2])
    with pytest.raises(AssertionError, match="not fsync'd"):
        check_folders_synced(rec, tmp, rec.first("write", lambda p: p.startswith(tmp + os.sep + "manifest.json")))
