"""Issue 20: bytes and seconds per local snapshot with incremental steps vs full steps, side by side, one run.

  (a) LoRA-like: a frozen state (``--mib`` of fp32 tensors, 8 tensors) plus adapters of ``--trainable`` of its
      size and a step counter that change every step; ``--steps`` snapshots, each with the previous as parent
      (incremental: unchanged shards are references) vs without a parent (every step written in full).
  (b) full training: every tensor changes every step: with a parent (the dedup check hashes every shard first
      and finds nothing to reuse) vs without (the cost of the check).

Both write durably (fsync) into a fresh folder under ``--dir``.  Ratios: full / incremental bytes and seconds.

  python benchmarks/bench_incremental.py --mib 256 --trainable 0.01 --steps 6
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time

import numpy as np

from flowcheck.config import LocalConfig
from flowcheck.state import Scalars, Shard, Snapshot, StateLayout, TensorSpec
from flowcheck.tiers.local import LocalTier


def state(step: int, mib: float, trainable: float, all_change: bool) -> Snapshot:
    rows = max(1, int(mib * 2**20 / 4 / 8 / 4096))
    rank = max(1, int(rows * trainable))
    specs, data = [], {}
    for i in range(8):
        name = f"decoder.layers.{i}.mlp.linear_fc1.weight"
        specs.append(TensorSpec(name, "float32", (rows, 4096), "column"))
        seed = step if all_change else 0
        data[Shard(name, (0, 0), (rows, 4096))] = np.random.default_rng(seed * 100 + i).standard_normal(
            (rows, 4096), dtype=np.float32)
        a = f"decoder.layers.{i}.lora_a.weight"
        specs.append(TensorSpec(a, "float32", (rank, 4096)))
        data[Shard(a, (0, 0), (rank, 4096))] = np.random.default_rng(step * 100 + i).standard_normal(
            (rank, 4096), dtype=np.float32)
    specs.append(TensorSpec("optimizer.step_count", "int64", ()))
    data[Shard("optimizer.step_count", (), ())] = np.array(step, np.int64)
    return Snapshot("bench", step, StateLayout(tuple(specs)), data, Scalars(optimizer_step=step))


def run(root: str, args, *, chained: bool, all_change: bool) -> dict:
    tier = LocalTier(LocalConfig(root=root), "bench")
    states = [state(s, args.mib, args.trainable, all_change) for s in range(1, args.steps + 1)]
    parent, times, sizes = None, [], []
    for snap in states:
        t0 = time.perf_counter()
        m = tier.write(snap, parent if chained else None)
        times.append(time.perf_counter() - t0)
        sizes.append(m.nbytes)
        parent = m.parent_ref()
    later = slice(1, None)  # the first step is a full write either way
    return {"bytes_per_step": sum(sizes[later]) / len(sizes[later]),
            "seconds_per_step": sum(times[later]) / len(times[later]),
            "data_bytes": states[0].nbytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=256)
    ap.add_argument("--trainable", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    out = {}
    for case, all_change in (("lora", False), ("full_training", True)):
        res = {}
        for label, chained in (("incremental", True), ("full", False)):
            root = tempfile.mkdtemp(dir=args.dir, prefix=f"fc-inc-{case}-{label}-")
            try:
                res[label] = run(root, args, chained=chained, all_change=all_change)
            finally:
                shutil.rmtree(root, ignore_errors=True)
        res["bytes_ratio"] = res["full"]["bytes_per_step"] / res["incremental"]["bytes_per_step"]
        res["seconds_ratio"] = res["full"]["seconds_per_step"] / res["incremental"]["seconds_per_step"]
        out[case] = res
        print(f"{case:14s} bytes/step: incremental {res['incremental']['bytes_per_step'] / 2**20:8.2f} MiB, "
              f"full {res['full']['bytes_per_step'] / 2**20:8.2f} MiB ({res['bytes_ratio']:.1f}x); seconds/step: "
              f"incremental {res['incremental']['seconds_per_step']:.3f}, full {res['full']['seconds_per_step']:.3f} "
              f"({res['seconds_ratio']:.2f}x)")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
