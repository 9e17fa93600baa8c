"""`flowcheck serve` keeps glibc from hoarding freed buffers (the soak's memory bound depends on it)."""
from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# A child that frees many multi-MiB buffers from several threads, as the node does with push parts and
# zarr chunks; after the frees its RSS must come back near where it started.
CHILD = textwrap.dedent("""
    import sys, threading, psutil
    from flowcheck.node.service import tune_allocator
    if sys.argv[1] == "tuned":
        assert tune_allocator()
    proc = psutil.Process()
    big = [bytearray(40 << 20)]  # freeing an mmapped 40 MiB block raises glibc's dynamic mmap threshold
    del big
    start = proc.memory_info().rss
    def churn():
        keep = []
        for i in range(32):
            keep.append(bytearray((2 << 20) + 4096 * i))
            held.append(bytearray(512))  # small live objects between the big ones block trimming
            if len(keep) > 8:
                keep.pop(0)
    held = []
    threads = [threading.Thread(target=churn) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    del threads
    print((proc.memory_info().rss - start) >> 20)
""")


def _retained_mib(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    return int(out.stdout.strip())


def test_tuned_allocator_returns_freed_buffers_to_the_kernel():
    untuned, tuned = _retained_mib("default"), _retained_mib("tuned")
    assert untuned >= 32, f"control: glibc's defaults kept only {untuned} MiB; the churn no longer shows the problem"
    assert tuned < 16, f"{tuned} MiB still held after every buffer was freed (defaults: {untuned} MiB)"


def test_operator_environment_takes_precedence(monkeypatch):
    from flowcheck.node.service import tune_allocator

    for name in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.setenv(name, "1")
    assert tune_allocator()  # nothing left to set: the operator's values stand
