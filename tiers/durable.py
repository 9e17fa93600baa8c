"""Durable local writes: fsync'd files and directories, and a zarr store that fsyncs.

zarr's LocalStore neither fsyncs nor tells us what it wrote; DurableStore does
both, so the local tier can list every file with its size and digest and make
the data durable before the manifest commits it.
"""
from __future__ import annotations

import asyncio
import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from zarr.core.buffer import Buffer
from zarr.storage import LocalStore

from flowcheck import _native
from flowcheck.digest import data_digest

FLUSH_EVERY = 64 << 20  # start write-back every 64 MiB so the final fsync is short


def write_file(path: str, data, *, fsync: bool = True, exclusive: bool = False) -> None:
    """Write bytes to a file, optionally fsync'd; ``exclusive`` fails if it exists."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, 0o644)
    try:
        _native.pwrite_all(fd, memoryview(data).cast("B"), 0, FLUSH_EVERY)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def dirty_limit() -> int:
    """About how many bytes of written-back-later data the kernel holds before it throttles writers: vm.dirty_bytes,
    else vm.dirty_ratio percent of the available memory (no limit known: a very large number)."""
    try:
        with open("/proc/sys/vm/dirty_bytes") as f:
            fixed = int(f.read())
        if fixed > 0:
            return fixed
        with open("/proc/sys/vm/dirty_ratio") as f:
            ratio = int(f.read())
        with open("/proc/meminfo") as f:
            available = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
        return available * ratio // 100
    except (OSError, ValueError, StopIteration):
        return 1 << 62


def fsync_file(path: str, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fsync_file(path, os.O_RDONLY | os.O_DIRECTORY)


def make_tree_durable(root: str, mode: str, workers: int = 8) -> None:
    """Make every file and directory under root durable: one syncfs, or an fsync per file and directory."""
    if mode == "syncfs":
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _native.sync_filesystem(fd)
        finally:
            os.close(fd)
        return
    files, dirs = [], []
    for dirpath, _dirs, names in os.walk(root, topdown=False):
        files += [os.path.join(dirpath, name) for name in names]
        dirs.append(dirpath)
    sync_paths(files + dirs, workers)


def sync_paths(paths: list[str], workers: int = 8) -> None:
    """fsync every file and directory in ``paths``, several at once: the journal commits them together (one
    commit for many syncs in flight), where one after the other each waits for its own."""
    if len(paths) <= 1 or workers <= 1:
        for p in paths:
            fsync_file(p, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(p) else 0))
        return
    with ThreadPoolExecutor(min(workers, len(paths)), thread_name_prefix="flowcheck-fsync") as pool:
        list(pool.map(lambda p: fsync_file(p, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(p) else 0)), paths))


def commit_file_exclusive(path: str, data: bytes, *, fsync: bool = True) -> None:
    """Create ``path`` with ``data`` atomically and exclusively (FileExistsError if present).

    Written to a temporary name and hard-linked into place, so a reader never
    sees a half-written file and two committers cannot both win.
    """
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.partial"
    write_file(tmp, data, fsync=fsync)
    try:
        os.link(tmp, path)
    finally:
        os.unlink(tmp)
    if fsync:
        fsync_dir(os.path.dirname(path) or ".")


def replace_file(path: str, data: bytes, *, fsync: bool = True) -> None:
    """Atomically replace ``path`` with ``data`` (tmp + rename)."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.partial"
    write_file(tmp, data, fsync=fsync)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(os.path.dirname(path) or ".")


class StepFiles:
    """The files of a step being written under ``root``: small ones written here (not yet synced), data files
    added by their writers; every file recorded as rel -> (bytes, digest), every folder made remembered."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.written: dict[str, tuple[int, str]] = {}
        self._small: list[str] = []
        self._dirs: list[str] = []

    def makedirs(self, rel: str) -> None:
        """Make ``root/rel`` and any missing folder above it (down to ``root``)."""
        path = os.path.join(self.root, rel) if rel else self.root
        if os.path.isdir(path):
            return
        parent = os.path.dirname(rel)
        if rel:
            self.makedirs(parent)
        os.mkdir(path)
        self._dirs.append(path)

    def put(self, rel: str, data: bytes) -> None:
        self.makedirs(os.path.dirname(rel))
        write_file(os.path.join(self.root, rel), data, fsync=False)
        self._small.append(os.path.join(self.root, rel))
        self.add(rel, len(data), data_digest(data))

    def add(self, rel: str, size: int, digest: str) -> None:
        self.written[rel] = (size, digest)

    def unsynced(self) -> list[str]:
        """What ``put`` wrote and every folder made: the paths still to fsync (data files sync themselves)."""
        return self._small + self._dirs[::-1]


class DurableStore(LocalStore):
    """A zarr LocalStore that records what it wrote as (key -> bytes, digest) and starts write-back early.

    Files are not fsync'd one by one: the tier makes the whole step durable
    with ``make_tree_durable`` before its manifest exists.
    """

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.written: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = 0
        self._abandoned = False

    @contextmanager
    def _writing(self, key: str):
        with self._lock:
            if self._abandoned:
                raise OSError(errno.ECANCELED, "the step write was abandoned", key)
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                self._idle.notify_all()

    def abandon(self, timeout: float = 60.0) -> None:
        """Refuse new writes and wait for those in flight: zarr runs writes concurrently and keeps them
        going after one fails, so without this a folder removed after a failure comes back."""
        with self._lock:
            self._abandoned = True
            self._idle.wait_for(lambda: self._busy == 0, timeout)

    def _put_durable(self, key: str, value: Buffer) -> None:
        path = os.path.join(str(self.root), key)
        with self._writing(key):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            view = value.as_buffer_like()
            write_file(path, view, fsync=False)
            digest = data_digest(view)
        with self._lock:
            self.written[key] = (memoryview(view).nbytes, digest)

    def put_shard(self, key: str, arr, chunk_rows: int) -> None:
        """Write a whole uncompressed shard file straight from ``arr`` (see zarr_shard)."""
        from flowcheck.tiers.zarr_shard import write_shard

        with self._writing(key):
            size, digest = write_shard(os.path.join(str(self.root), key), arr, chunk_rows)
        with self._lock:
            self.written[key] = (size, digest)

    async def set(self, key: str, value: Buffer) -> None:
        if not self._is_open:
            await self._open()
        await asyncio.to_thread(self._put_durable, key, value)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        if not await self.exists(key):
            await self.set(key, value)

    def set_sync(self, key: str, value: Buffer) -> None:
        self._put_durable(key, value)
