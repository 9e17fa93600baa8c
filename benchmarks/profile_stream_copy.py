"""Diagnostic: the P4 trainer's iteration slowdown while another thread copies 0.73 GB in 4 MiB pieces (the push's
copy), plain memcpy vs streaming stores (`_native.copy_into(stream=True)`). Iterations are interleaved in triplets
(quiet, memcpy, stream; the order rotates); slowdown = sum ÷ sum of quiet − 1, with a 95% bootstrap CI over triplets.

  python benchmarks/profile_stream_copy.py 36     # 36 triplets, ~4.5 min
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import threading
import time

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_push as bp  # noqa: E402

from flowcheck import _native  # noqa: E402

STATE, PIECE = 732 << 20, 4 << 20  # the P4 trainer's state, the node's shared-memory piece


def main(triplets: int) -> None:
    torch.set_num_threads(1)
    model = bp.gpt(14, 128)
    opt, gen = torch.optim.AdamW(model.parameters(), lr=1e-4), torch.Generator().manual_seed(1)

    def train_step() -> None:
        x = torch.randint(0, bp.VOCAB, (2, 129), generator=gen)
        nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, bp.VOCAB), x[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    src, dst = np.ones(STATE, np.uint8), np.ones(STATE, np.uint8)

    def copy(stream: bool) -> None:
        for i in range(0, STATE, PIECE):
            _native.copy_into(dst[i:i + PIECE], src[i:i + PIECE], threads=1, stream=stream)

    train_step()
    times: dict[str, list[float]] = {"quiet": [], "memcpy": [], "stream": []}
    kinds = list(times)
    for r in range(triplets):
        for kind in kinds[r % 3:] + kinds[:r % 3]:
            side = None if kind == "quiet" else threading.Thread(target=copy, args=(kind == "stream",))
            t0 = time.perf_counter()
            if side is not None:
                side.start()
            train_step()
            if side is not None:
                side.join()
            times[kind].append(time.perf_counter() - t0)
    quiet, rng = times["quiet"], random.Random(0)
    for kind in ("memcpy", "stream"):
        loaded = times[kind]
        boot = sorted(sum(loaded[i] for i in pick) / sum(quiet[i] for i in pick) - 1
                      for pick in ([rng.randrange(triplets) for _ in range(triplets)] for _ in range(2000)))
        print(f"{kind}: slowdown {100 * (sum(loaded) / sum(quiet) - 1):+.2f}% (95% CI {100 * boot[49]:+.2f} … "
              f"{100 * boot[-50]:+.2f}%); median iteration quiet {statistics.median(quiet):.3f} s, "
              f"{kind} {statistics.median(loaded):.3f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 36)
