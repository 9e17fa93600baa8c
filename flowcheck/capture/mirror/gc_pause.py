"""Pausing Python's cyclic garbage collector while decode builds its many short-lived, acyclic objects.

A decode allocates a few objects per send (WireSend, its placer, report dicts): tens of thousands per capture.
Every 700 allocations the collector runs, and every tenth/hundredth run walks older generations too — the whole
process's tracked objects, which in a checkpoint node are many.  perf of bench_mirror (a) put 10-15% of decode CPU
in gc_collect_main/visit_decref; none of these objects form cycles, so nothing is collected late by pausing.
"""
from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class _Pause:
    """Nested and concurrent pauses (several decoder threads) count up; the last one out re-enables the collector,
    and only if it was enabled when the first came in (a caller's own gc.disable() stays as it was)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.was_enabled = False

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self.lock:
            if self.depth == 0:
                self.was_enabled = gc.isenabled()
                gc.disable()
            self.depth += 1
        try:
            yield
        finally:
            with self.lock:
                self.depth -= 1
                if self.depth == 0 and self.was_enabled:
                    gc.enable()


gc_paused = _Pause()
