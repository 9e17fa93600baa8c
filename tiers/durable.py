"""Durable local writes: fsync'd files and directories, and a zarr store that fsyncs.

zarr's LocalStore neither fsyncs nor tells us what it wrote; DurableStore does
both, so the local tier can list every file with its size and digest and make
the data durable before the manifest commits it.
"""
from __future__ import annotations

import asyncio
import os
import threading

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


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree_dirs(root: str) -> None:
    """fsync every directory under root (bottom-up), so new entries are durable."""
    for dirpath, _dirs, _files in os.walk(root, topdown=False):
        fsync_dir(dirpath)


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


class DurableStore(LocalStore):
    """A zarr LocalStore whose writes are fsync'd and recorded as (key -> bytes, digest)."""

    def __init__(self, root: str, *, fsync: bool = True) -> None:
        super().__init__(root)
        self.fsync = fsync
        self.written: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    def _put_durable(self, key: str, value: Buffer) -> None:
        path = os.path.join(str(self.root), key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        view = value.as_buffer_like()
        write_file(path, view, fsync=self.fsync)
        digest = data_digest(view)
        with self._lock:
            self.written[key] = (memoryview(view).nbytes, digest)

    async def set(self, key: str, value: Buffer) -> None:
        if not self._is_open:
            await self._open()
        await asyncio.to_thread(self._put_durable, key, value)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        if not await self.exists(key):
            await self.set(key, value)

    def set_sync(self, key: str, value: Buffer) -> None:
        self._put_durable(key, value)
