"""Prototype for the P3 proposal (NOT library code): write the local tier's zarr v3 shards directly.

flowcheck's LocalTier goes through zarr's write path: per array an asyncio round trip, metadata
existence checks, a group zarr.json, the CRC32C codec's np.append copy, the shard concatenation
copy, and (for row counts the inner chunk does not divide) a padded shard buffer.  This prototype
writes the same on-disk format itself:

  <tensor>/zarr.json (group), <tensor>/<i>/zarr.json (array metadata, same JSON as zarr writes),
  <tensor>/<i>/c/0[/0] (shard file: inner chunks + CRC32C each, index (offset, nbytes) u64 + CRC32C at the end)

with os.writev straight from the numpy views (no copies), inner chunk rows chosen to divide the
row count (no padding), xxh3 of the shard and of the file, all files written first (sync_file_range
starts write-back), then fsync'd in parallel, then the directories — and checks that plain zarr reads
every array back bit-exactly.  It times this against the raw P3 baseline and LocalTier.write.

  python benchmarks/proto_direct_write.py --gb 1.3
"""
from __future__ import annotations

import json
import math
import os
import struct
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

IOV_MAX = 1024
_libc = None


def _start_writeback(fd: int) -> None:
    """sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE): start write-back of the whole file, do not wait."""
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    _libc.sync_file_range(fd, 0, 0, 2)


def _rows_per_chunk(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> int:
    """The largest divisor of shape[0] whose chunk fits in chunk_bytes (so no chunk is padded)."""
    row = itemsize * math.prod(shape[1:])
    limit = max(1, min(shape[0], chunk_bytes // max(row, 1)))
    for rows in range(limit, 0, -1):
        if shape[0] % rows == 0:
            return rows
    return 1


def _array_meta(shape, rows, attributes) -> bytes:
    codec = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    meta = {
        "shape": list(shape), "data_type": "float32",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0.0,
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": [rows, *shape[1:]], "codecs": codec, "index_codecs": codec, "index_location": "end"}}],
        "attributes": attributes, "zarr_format": 3, "node_type": "array", "storage_transformers": [],
    }
    return json.dumps(meta, indent=2).encode()


GROUP = json.dumps({"attributes": {}, "zarr_format": 3, "node_type": "group"}, indent=2).encode()


def _write_all(fd: int, bufs: list) -> int:
    """os.writev of every buffer, IOV_MAX at a time, short writes continued."""
    pending = [memoryview(b).cast("B") for b in bufs]
    total = 0
    while pending:
        n = os.writev(fd, pending[:IOV_MAX])
        total += n
        while n and pending:
            if n >= pending[0].nbytes:
                n -= pending[0].nbytes
                pending.pop(0)
            else:
                pending[0] = pending[0][n:]
                n = 0
    return total


def write_step(root: str, snapshot, *, chunk_mib: int = 16, workers: int = 4, fsync: bool = True) -> dict:
    import google_crc32c
    import numpy as np

    from flowcheck.digest import DataHasher, data_digest

    os.makedirs(root)
    with open(os.path.join(root, "zarr.json"), "wb") as f:
        f.write(json.dumps({"attributes": {"flowcheck": {"run": snapshot.run, "step": snapshot.step}},
                            "zarr_format": 3, "node_type": "group"}, indent=2).encode())
    files: dict[str, tuple[int, str]] = {}
    fds: list[int] = []
    dirs: set[str] = {root}

    def one(shard):
        arr = snapshot.array(shard)
        digest = data_digest(arr)
        shape = shard.shape
        rows = _rows_per_chunk(shape, arr.itemsize, chunk_mib << 20)
        tdir = os.path.join(root, shard.tensor)
        adir = os.path.join(tdir, "0")
        key = "/".join(["c"] + ["0"] * len(shape))
        cdir = os.path.dirname(os.path.join(adir, key))
        os.makedirs(cdir, exist_ok=True)
        out = {}
        for path, data in ((os.path.join(tdir, "zarr.json"), GROUP),
                           (os.path.join(adir, "zarr.json"),
                            _array_meta(shape, rows, {"tensor": shard.tensor, "dtype": "float32",
                                                      "offsets": list(shard.offsets), "digest": digest}))):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, data)
            out[path] = (fd, len(data), data_digest(data))
        flat = arr.reshape(-1).view(np.uint8)
        step = rows * (flat.nbytes // shape[0])
        bufs, index, off = [], [], 0
        hasher = DataHasher()
        for s in range(0, flat.nbytes, step):
            view = flat[s:s + step]
            crc = struct.pack("<I", google_crc32c.value(view))
            bufs += [view, crc]
            hasher.update(view)
            hasher.update(crc)
            index.append((off, view.nbytes + 4))
            off += view.nbytes + 4
        idx = np.array(index, dtype="<u8").reshape(len(index), *([1] * (len(shape) - 1)), 2).tobytes()
        idx += struct.pack("<I", google_crc32c.value(idx))
        bufs.append(idx)
        hasher.update(idx)
        path = os.path.join(adir, key)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        n = _write_all(fd, bufs)
        if fsync:
            _start_writeback(fd)  # start write-back now; fsync later
        out[path] = (fd, n, hasher.hexdigest())
        made, d = set(), cdir
        while d != root:
            made.add(d)
            d = os.path.dirname(d)
        return shard, digest, out, made

    digests = {}
    with ThreadPoolExecutor(workers) as pool:
        for shard, digest, out, ds in pool.map(one, list(snapshot.data)):
            digests[shard] = digest
            for path, (fd, n, d) in out.items():
                files[os.path.relpath(path, root)] = (n, d)
                fds.append(fd)
            dirs |= ds
        if fsync:
            list(pool.map(os.fsync, fds))
        for fd in fds:
            os.close(fd)
        if fsync:
            def fsync_dir(p):
                c.fsync_dir(p)
            list(pool.map(fsync_dir, sorted(dirs, key=len, reverse=True)))
    return {"files": files, "digests": digests}


def main(argv: list[str] | None = None) -> None:
    p = c.base_parser(__doc__)
    args = p.parse_args(argv)
    c.preimport()
    import numpy as np
    import zarr

    from flowcheck.config import LocalConfig
    from flowcheck.tiers.local import LocalTier

    state = c.build_state(args.gb)
    work = c.workdir("fc-proto-", args.dir)
    out = os.path.join(work, "out")
    print(f"{state.describe()}", flush=True)

    def fresh():
        c.rmtree(out)
        c.drop_caches()

    def raw():
        os.makedirs(out)
        for name, t in state.tensors.items():
            mv = memoryview(t.numpy()).cast("B")
            fd = os.open(os.path.join(out, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            off = 0
            while off < mv.nbytes:
                off += os.write(fd, mv[off:off + (256 << 20)])
            os.fsync(fd)
            os.close(fd)
        c.fsync_dir(out)

    def flowcheck():
        LocalTier(LocalConfig(root=out), run=state.snapshot.run).write(state.snapshot)

    def proto():
        write_step(os.path.join(out, "step"), state.snapshot)

    try:
        rows = [c.Row("raw os.write + fsync per file (P3 baseline)", nbytes=state.nbytes, baseline=True),
                c.Row("flowcheck LocalTier.write (today)", nbytes=state.nbytes),
                c.Row("prototype: direct zarr v3 shard writes, deferred parallel fsync", nbytes=state.nbytes)]
        c.run_rounds([(rows[0], raw, fresh, None), (rows[1], flowcheck, fresh, None), (rows[2], proto, fresh, None)],
                     args.repeats, cold=True)
        print("\n" + c.table(rows, ratio_label="ratio vs raw"))
        # the prototype's files must be what zarr reads
        fresh()
        proto()
        bad = 0
        for name, t in state.tensors.items():
            got = zarr.open_array(os.path.join(out, "step", name, "0"), mode="r")[...]
            bad += not np.array_equal(got, t.numpy())
        print(f"\nzarr read-back of the prototype's arrays: {len(state.tensors) - bad}/{len(state.tensors)} bit-exact")
    finally:
        c.rmtree(work)


if __name__ == "__main__":
    main()
