"""Progress display for long CLI work: tqdm bars on stderr, off when stderr is not a terminal.

Off also with ``FLOWCHECK_NO_PROGRESS=1`` (what ``flowcheck --no-progress`` sets), so CI logs and
captured output stay clean.  ``bar`` counts work with a known size; ``activity`` shows what is
running and for how long where the work has no hook to count.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any

ENV = "FLOWCHECK_NO_PROGRESS"


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
