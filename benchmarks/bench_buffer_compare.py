"""Issue 20, trainer side: what deciding "this buffer did not change" costs on the push's side thread, side by side
in one run (ratios to the copy every push did before).

Per round, in rotated order, on one CPU tensor of ``--mib`` (an EMA copy, a large buffer) and its slice of a host
buffer: (a) ``copy``: the copy a push makes of it (``_native.copy_into``, one thread, streaming — the Checkpointer's
own); (b) ``compare, equal``: ``checkpointer._equal_bytes`` on equal bytes (what an unchanged buffer costs instead
of the copy); (c) ``compare, first byte differs``: a changed buffer (the usual case: every element moved), then the
copy; (d) ``compare, last byte differs``: the worst case, a full compare then the copy; (e) ``xxh3-128``: hashing it
(the alternative to comparing: needs no second copy of the bytes, but is not exact). Medians over ``--rounds``.

  python benchmarks/bench_buffer_compare.py --mib 64 --rounds 15
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from flowcheck import _native
from flowcheck.torch.checkpointer import _equal_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the side thread's share of a trainer host
    n = int(args.mib * 2**20) // 8 * 8
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    host = torch.empty(n + 64, dtype=torch.uint8)
    slot = host[8:8 + n]  # a slice at an 8-aligned offset, as a push buffer's entries are when the layout allows
    slot.copy_(src)
    first, last = src.clone(), src.clone()
    first[0] ^= 1
    last[-1] ^= 1

    def copy(t: torch.Tensor) -> None:
        _native.copy_into(slot.numpy(), t.numpy(), threads=1, stream=True)

    def changed(t: torch.Tensor) -> None:
        assert not _equal_bytes(t, slot)
        copy(t)
        copy(src)  # back to the equal state (not timed below: subtracted as one copy)

    work = {
        "copy": lambda: copy(src),
        "compare, equal": lambda: _equal_bytes(src, slot) or (_ for _ in ()).throw(AssertionError("not equal")),
        "compare, first byte differs": lambda: changed(first),
        "compare, last byte differs": lambda: changed(last),
        "xxh3-128": lambda: _native.xxh3_128(src.numpy()),
    }
    times: dict[str, list[float]] = {k: [] for k in work}
    names = list(work)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            work[name]()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k in ("compare, first byte differs", "compare, last byte differs"):  # one restoring copy is not the cost
        med[k] -= med["copy"]
    out = {"mib": args.mib, "rounds": args.rounds, "seconds_median": med,
           "ratio_to_copy": {k: v / med["copy"] for k, v in med.items()},
           "gb_per_s": {k: n / v / 1e9 for k, v in med.items()}}
    for k, v in med.items():
        print(f"{k:28s} {v * 1e3:8.2f} ms  {n / v / 1e9:6.2f} GB/s  {v / med['copy']:5.2f}x the copy")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
