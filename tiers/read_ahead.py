"""Read-ahead for a reader that walks a step shard by shard in storage order (load, promotion, audit).

Like the kernel's readahead: once a reader asks for the shard after the one it asked for last, the next
shards are read on a few threads, up to a byte budget ahead of it; a reader in any other order reads what it
asks for and nothing more.  Each read is what the tier does for a whole shard (native, GIL released).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class ReadAhead(Generic[T]):
    """Results of ``read(walk_id, key)`` for the keys of a walk, fetched ahead of a sequential reader."""

    def __init__(self, read: Callable[[object, Hashable], T], workers: int, budget: int) -> None:
        self._read, self._workers, self._budget = read, workers, budget
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._walk_id: object = None
        self._walk: list[tuple[Hashable, int]] = []  # (key, bytes) in walk order
        self._position: dict[Hashable, int] = {}
        self._pending: dict[Hashable, Future] = {}
        self._next = 0  # the walk index submitted next
        self._expected: Hashable | None = None

    def get(self, walk_id: object, walk: Callable[[], list[tuple[Hashable, int]]], key: Hashable) -> T:
        """``read(walk_id, key)``; ``walk()`` is the order a sequential reader asks in (once per ``walk_id``)."""
        with self._lock:
            if walk_id is not self._walk_id:
                self._drop()
                self._walk_id, self._walk = walk_id, walk()
                self._position = {k: i for i, (k, _) in enumerate(self._walk)}
                self._expected = None
            fut = self._pending.pop(key, None)
            pos = self._position.get(key, len(self._walk) - 1)
            if fut is not None or key == self._expected:
                self._next = max(self._next, pos + 1)
                self._fill()
            else:  # not a walk (yet): read only this, but expect the next one
                self._drop()
                self._next = pos + 1
            self._expected = self._walk[pos + 1][0] if pos + 1 < len(self._walk) else None
        return fut.result() if fut is not None else self._read(walk_id, key)

    def _fill(self) -> None:
        """Submit the walk's next keys while the bytes in flight stay within the budget."""
        in_flight = sum(self._walk[self._position[k]][1] for k in self._pending)
        while self._next < len(self._walk) and (not self._pending or in_flight + self._walk[self._next][1] <= self._budget):
            key, size = self._walk[self._next]
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="flowcheck-read-ahead")
            self._pending[key] = self._pool.submit(self._read, self._walk_id, key)
            in_flight += size
            self._next += 1

    def _drop(self) -> None:
        for fut in self._pending.values():
            fut.cancel()  # one already running finishes; its result is dropped
        self._pending.clear()
