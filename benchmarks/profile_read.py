"""Where does LocalTier.read spend its time?  (diagnostic; run it under py-spy for stacks)

Writes the state once to a LocalTier, then reads every tensor back (cold cache), with the library's
functions wrapped at run time: zarr.open_array (metadata), the array read (shard index + chunks +
CRC32C + decode), the copy into the output.  Then the same bytes through plain zarr, without
flowcheck, and through a raw file read of each shard file, to separate flowcheck from zarr from the disk.

  python benchmarks/profile_read.py --gb 1.3
  py-spy record --idle --threads --format raw -o read.raw -- python benchmarks/profile_read.py --gb 1.3
"""
from __future__ import annotations

import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402
from profile_local import _acc, _wrap  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = c.base_parser(__doc__)
    args = p.parse_args(argv)
    c.preimport()
    import numpy as np
    import zarr

    from flowcheck.config import LocalConfig
    from flowcheck.tiers import local as local_mod
    from flowcheck.tiers.local import LocalTier

    work = c.workdir("fc-profr-", args.dir)
    try:
        state = c.build_state(args.gb)
        nbytes = state.nbytes
        run, step = state.snapshot.run, state.snapshot.step
        tier = LocalTier(LocalConfig(root=os.path.join(work, "local")), run=run)
        m = tier.write(state.snapshot)
        names = list(state.tensors)
        del state
        gc.collect()
        print(f"{len(names)} tensors, {nbytes / 1e9:.3f} GB", flush=True)

        # 1. plain reads of the shard files (the disk + page cache, no zarr)
        paths = []
        for f in m.files:
            paths.append(os.path.join(tier.root, f.path))
        c.drop_caches()

        def raw():
            n = 0
            for path in paths:
                with open(path, "rb", buffering=0) as fh:
                    n += len(fh.read())
            return n
        dt, n = c.timed(raw)
        print(f"raw read of all {len(paths)} files the step consists of: {dt:.2f} s ({n / 1e9 / dt:.3f} GB/s)")

        # 2. plain zarr, no flowcheck
        arrays = {name: os.path.join(tier.root, t.shards[0].location[0].path) for name, t in m.tensors.items()}
        c.drop_caches()

        def plain_zarr():
            return sum(np.asarray(zarr.open_array(path, mode="r")[...]).nbytes for path in arrays.values())
        dt, _ = c.timed(plain_zarr)
        print(f"plain zarr open_array(path)[...] per tensor: {dt:.2f} s ({nbytes / 1e9 / dt:.3f} GB/s)")

        c.drop_caches()

        def plain_zarr_open_only():
            return [zarr.open_array(path, mode="r") for path in arrays.values()]
        dt, _ = c.timed(plain_zarr_open_only)
        print(f"plain zarr open_array only (metadata): {dt:.2f} s")

        # 3. flowcheck, instrumented
        _wrap(zarr, "open_array", "zarr.open_array (reads zarr.json)")
        _wrap(zarr.Array, "__getitem__", "zarr Array[region] (shard index, chunks, CRC32C, decode)")
        _wrap(local_mod.LocalTier, "_read_shard", "LocalTier._read_shard, inclusive")
        _wrap(local_mod.LocalTier, "manifest", "LocalTier.manifest (parse manifest.json)")
        c.drop_caches()
        _acc.clear()
        dt, _ = c.timed(lambda: sum(tier.read(step, name).nbytes for name in names))
        print(f"\nflowcheck LocalTier.read(step, name) per tensor (manifest re-read every call): {dt:.2f} s "
              f"({nbytes / 1e9 / dt:.3f} GB/s)\n")
        print("| phase | calls | seconds |\n|---|---:|---:|")
        for label, (secs, calls) in _acc.items():
            print(f"| {label} | {calls} | {secs:.2f} |")
        _acc.clear()
        c.drop_caches()
        man = tier.manifest(step)
        dt, _ = c.timed(lambda: sum(tier.read(step, name, manifest=man).nbytes for name in names))
        print(f"\nsame, manifest passed in: {dt:.2f} s ({nbytes / 1e9 / dt:.3f} GB/s)\n")
        print("| phase | calls | seconds |\n|---|---:|---:|")
        for label, (secs, calls) in _acc.items():
            print(f"| {label} | {calls} | {secs:.2f} |")
    finally:
        c.rmtree(work)


if __name__ == "__main__":
    main()
