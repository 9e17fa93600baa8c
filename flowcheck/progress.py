"""Progress display for long CLI work: tqdm bars on stderr, off when stderr is not a terminal.

Off also with ``FLOWCHECK_NO_PROGRESS=1`` (what ``flowcheck --no-progress`` sets), so CI logs and
captured output stay clean.  ``bar`` counts work with a known size; ``activity`` shows what is
running and for how long where the work has no hook to count.  Library code that does long work
takes an optional ``progress`` (a ``Progress``: a tqdm bar fits) and reports through ``counter``.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

ENV = "FLOWCHECK_NO_PROGRESS"


class Progress(Protocol):
    """Where long library work reports: the worker sets ``total`` once it knows the size, then ``update(n)``."""

    total: float | None

    def update(self, n: float = 1) -> object: ...


def _ignore(n: float) -> None:
    pass


def counter(progress: Progress | None, total: float) -> Callable[[float], None]:
    """Set ``progress.total`` and return an ``add(n)`` safe to call from worker threads (a no-op without progress).

    Called per file, shard or step, never per byte: reporting costs nothing next to the I/O it counts.
    """
    if progress is None:
        return _ignore
    progress.total = total
    lock = threading.Lock()  # tqdm's update is a read-modify-write: concurrent shard writers would lose counts

    def add(n: float) -> None:
        with lock:
            progress.update(n)

    return add


def enabled(stream: Any = None) -> bool:
    if os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no"):
        return False
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def bar(iterable: Iterable | None = None, *, total: float | None = None, desc: str = "", unit: str = "it", **kw):
    """A tqdm bar on stderr (disabled off-TTY); bytes: ``unit="B", unit_scale=True``."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled(),
                leave=False, dynamic_ncols=True, **kw)


@contextlib.contextmanager
def activity(desc: str) -> Iterator[Any]:
    """``desc`` and the elapsed time, refreshed twice a second, while the block runs."""
    with bar(total=None, desc=desc, bar_format="{desc}: {elapsed}{postfix}") as b:
        if b.disable:
            yield b
            return
        done = threading.Event()

        def tick() -> None:
            while not done.wait(0.5):
                b.refresh()

        t = threading.Thread(target=tick, name="fc-progress", daemon=True)
        t.start()
        try:
            yield b
        finally:
            done.set()
            t.join()


def human_bytes(n: float) -> str:
    """``646.4 KiB``: a byte count as the CLI and error messages print it."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
