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
    # the control: with glibc's defaults the churn keeps memory in most runs, not all (0-81 MiB across runs, less
    # while other processes load the box), so up to five tries; if none shows it, the test says so and skips
    untuned = []
    while len(untuned) < 5 and max(untuned, default=0) < 32:
        untuned.append(_retained_mib("default"))
    if max(untuned) < 32:  # the tuned figure below would prove nothing
        pytest.skip(f"control: glibc's defaults kept only {untuned} MiB on this run; the churn showed no problem")
    tuned = [_retained_mib("tuned") for _ in range(3)]
    assert max(tuned) < 16, f"{tuned} MiB still held after every buffer was freed (defaults: {untuned} MiB)"


def test_operator_environment_takes_precedence(monkeypatch):
    from flowcheck.node.service import tune_allocator

    for name in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.setenv(name, "1")
    assert tune_allocator()  # nothing left to set: the operator's values stand
