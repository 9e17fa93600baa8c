"""Where does LocalTier.write spend its time?  Phase breakdown + what-if variants (diagnostic, not a benchmark table).

1. Phase breakdown of one default LocalTier.write (codec none, 4 workers, 16 MiB chunks):
   the library's functions are wrapped at run time (nothing in the library is changed) and the time
   spent inside each is summed over all threads: digests, zarr metadata, zarr encode, CRC32C,
   buffer concatenation, padding allocation, pwrite, fsync, directory fsyncs, manifest.
2. What-if variants, one write each (cold cache), against the raw baselines:
   raw per-file fsync (the P3 baseline), raw write-all-then-fsync-all, raw one file, LocalTier with
   fsync=False + one os.sync() at the end, workers 1/8, chunk_mib 64, codec lz4.

  python benchmarks/profile_local.py --gb 1.3
"""
from __future__ import annotations

import collections
import functools
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

_acc: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
_lock = threading.Lock()


def _wrap(owner, attr: str, label: str, *, is_static: bool = False) -> None:
    fn = getattr(owner, attr, None)
    if fn is None:  # the library changed: measure what exists
        return

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter() - t0
            with _lock:
                _acc[label][0] += dt
                _acc[label][1] += 1

    setattr(owner, attr, staticmethod(wrapper) if is_static else wrapper)


def _instrument() -> None:
    import google_crc32c
    import zarr
    import zarr.core.buffer.cpu as zcpu

    from flowcheck import _native
    from flowcheck.tiers import durable, local

    _wrap(local, "shard_digests", "shard xxh3 digest (before encode)")
    _wrap(zarr.Group, "create_array", "zarr create_array (metadata zarr.json, fsync'd)")
    _wrap(zarr.Array, "__setitem__", "zarr z[...] = arr (encode + store, inclusive)")
    _wrap(google_crc32c, "value", "  CRC32C per inner chunk (google_crc32c)")
    _wrap(zcpu.Buffer, "combine", "  shard assembly (np.concatenate of chunks)")
    _orig_create = zcpu.NDBuffer.create.__func__

    def create(cls, *a, **k):
        t0 = time.perf_counter()
        try:
            return _orig_create(cls, *a, **k)
        finally:
            with _lock:
                _acc["  chunk/shard buffer allocation + fill (padding path)"][0] += time.perf_counter() - t0
                _acc["  chunk/shard buffer allocation + fill (padding path)"][1] += 1

    zcpu.NDBuffer.create = classmethod(create)
    _wrap(durable.DurableStore, "_put_durable", "  DurableStore._put_durable (write + fsync + digest)")
    _wrap(_native, "pwrite_all", "    pwrite_all (page-cache copy + sync_file_range)")
    _wrap(os, "fsync", "    os.fsync (all callers: files and directories)")
    _wrap(durable, "data_digest", "    file xxh3 digest (second pass over the bytes)")
    _wrap(local, "fsync_tree_dirs", "fsync_tree_dirs (every directory, serial)")
    _wrap(local, "make_tree_durable", "make_tree_durable (syncfs or fsync per file and directory)")
    _wrap(durable.DurableStore, "put_shard", "  DurableStore.put_shard (direct shard file write, no zarr data path)")
    _wrap(_native, "sync_filesystem", "    syncfs")
    _wrap(local, "replace_file", "manifest write (replace_file)")
    _wrap(local, "make_manifest", "make_manifest")
    _wrap(local.LocalTier, "_write_tmp", "LocalTier._write_tmp (all shards, wall)")
    _wrap(local.LocalTier, "_commit", "LocalTier._commit (dir fsyncs, manifest, rename; wall)")


def main(argv: list[str] | None = None) -> None:
    p = c.base_parser(__doc__)
    p.add_argument("--skip-variants", action="store_true")
    args = p.parse_args(argv)
    c.preimport()
    from flowcheck.config import LocalConfig
    from flowcheck.tiers.local import LocalTier

    state = c.build_state(args.gb)
    work = c.workdir("fc-prof-", args.dir)
    out = os.path.join(work, "out")
    print(f"{state.describe()}; {work}", flush=True)

    def fresh() -> None:
        c.rmtree(out)
        os.makedirs(out)
        c.drop_caches()

    def flowcheck(**cfg):
        def go():
            LocalTier(LocalConfig(root=out, **cfg), run=state.snapshot.run).write(state.snapshot)
            if cfg.get("fsync") is False:
                os.sync()
        return go

    def raw_per_file():
        for name, t in state.tensors.items():
            mv = memoryview(t.numpy()).cast("B")
            fd = os.open(os.path.join(out, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            off = 0
            while off < mv.nbytes:
                off += os.write(fd, mv[off:off + (256 << 20)])
            os.fsync(fd)
            os.close(fd)
        c.fsync_dir(out)

    def raw_batched():
        fds = []
        for name, t in state.tensors.items():
            mv = memoryview(t.numpy()).cast("B")
            fd = os.open(os.path.join(out, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            off = 0
            while off < mv.nbytes:
                off += os.write(fd, mv[off:off + (256 << 20)])
            fds.append(fd)
        for fd in fds:
            os.fsync(fd)
            os.close(fd)
        c.fsync_dir(out)

    def raw_one_file():
        fd = os.open(os.path.join(out, "all.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for t in state.tensors.values():
            mv = memoryview(t.numpy()).cast("B")
            off = 0
            while off < mv.nbytes:
                off += os.write(fd, mv[off:off + (256 << 20)])
        os.fsync(fd)
        os.close(fd)
        c.fsync_dir(out)

    try:
        if not args.skip_variants:
            variants = [
                ("raw: os.write + fsync per file (P3 baseline)", raw_per_file),
                ("raw: write all files, then fsync each", raw_batched),
                ("raw: one file, one fsync", raw_one_file),
                ("flowcheck default (none, 4 workers, 16 MiB chunks, fsync)", flowcheck()),
                ("flowcheck fsync=False + one os.sync()", flowcheck(fsync=False)),
                *([("flowcheck sync_mode=fsync (per file and directory)", flowcheck(sync_mode="fsync"))]
                  if "sync_mode" in LocalConfig.__dataclass_fields__ else []),
                ("flowcheck workers=1", flowcheck(workers=1)),
                ("flowcheck workers=8", flowcheck(workers=8)),
                ("flowcheck chunk_mib=64", flowcheck(chunk_mib=64)),
                ("flowcheck chunk_mib=256 (one inner chunk for every tensor)", flowcheck(chunk_mib=256)),
            ]
            print("\n| variant | s | GB/s |\n|---|---:|---:|")
            for label, fn in variants:
                fresh()
                dt, _ = c.timed(fn)
                print(f"| {label} | {dt:.2f} | {state.nbytes / 1e9 / dt:.3f} |", flush=True)
        # phase breakdown
        _instrument()
        fresh()
        _acc.clear()
        cpu0 = os.times()
        dt, _ = c.timed(flowcheck())
        cpu1 = os.times()
        print(f"\nPhase breakdown of one default LocalTier.write: wall {dt:.2f} s, process CPU "
              f"user {cpu1.user - cpu0.user:.2f} s + sys {cpu1.system - cpu0.system:.2f} s "
              f"(thread-summed seconds; nested phases indented)\n")
        print("| phase | calls | seconds (sum over threads) |\n|---|---:|---:|")
        for label, (secs, calls) in _acc.items():
            print(f"| {label} | {calls} | {secs:.2f} |")
        n_files = sum(len(fs) for _, _, fs in os.walk(out))
        n_dirs = sum(1 for _ in os.walk(out))
        print(f"\nfiles written: {n_files}, directories: {n_dirs}, tensors: {len(state.tensors)}")
    finally:
        c.rmtree(work)


if __name__ == "__main__":
    main()
