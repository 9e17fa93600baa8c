"""P3: write one training state to local disk, durably, with flowcheck and the alternatives, side by side.

The state is a GPT-like fp32 model (params + Adam exp_avg + exp_avg_sq), built
once with torch and handed to every writer as the same memory (flowcheck gets
numpy views of the torch tensors, no copies).  Every alternative makes its bytes
durable (fsync of its files and of the directory) inside the timed region.

  (f) one file:   the state's bytes written sequentially (os.write) into one file + fsync (baseline, 1.0x)
  (a) raw:        os.write loop + os.fsync, one file per tensor, then a directory fsync
  (a') diagnostic: the same files, all written first and then fsync'd one by one
  (b) flowcheck:  LocalTier(codec=none).write(snapshot)  (zarr v3 packs, CRC32C, xxh3 digests, manifest, fsync)
                  LocalTier(codec=lz4).write(snapshot)   (--lz4; per-shard zarr arrays through zarr's codecs)
  (c) torch.save  of the state dict to one file + fsync
  (d) safetensors.torch.save_file + fsync
  (e) torch.distributed.checkpoint.save (single process, no process group; FileSystemWriter fsyncs)

ratio = one_file_time / method_time (higher is faster).  Goals (issue 18): flowcheck codec=none >= 0.9x the
one-file write, and >= 1.0x the fastest of (c), (d), (e) (their time / flowcheck's).

  python benchmarks/bench_local_snapshot.py --gb 1.0 --repeats 5 --out p3.json
"""
from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

GOAL = 0.9  # vs one sequential write + fsync of the same bytes
GOAL_ALT = 1.0  # vs the fastest of torch.save, safetensors, DCP
SCRIPT = "bench_local_snapshot.py"


def _du(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(dirpath, f))
    return total


def main(argv: list[str] | None = None) -> dict:
    p = c.base_parser(__doc__)
    p.add_argument("--lz4", action="store_true", help="also measure codec=lz4 (slow on fp32 state: ~1.1x compression)")
    args = p.parse_args(argv)
    cmd = c.command(SCRIPT, argv)
    import torch
    from safetensors.torch import save_file

    from flowcheck.config import LocalConfig
    from flowcheck.tiers.local import LocalTier

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    c.preimport()  # one-time imports stay out of the timed regions
    state = c.build_state(args.gb)
    nbytes = state.nbytes
    work = c.workdir("fc-bench-p3-", args.dir)
    c.check_disk(work, 2 * nbytes + (1 << 30))
    print(f"P3 local snapshot: {state.describe()}; work dir {work}", flush=True)
    out_dir = os.path.join(work, "out")
    tensors = state.tensors
    sd = dict(tensors)

    def fresh() -> None:
        c.rmtree(out_dir)
        os.makedirs(out_dir)

    # (f) one sequential file: the disk's own speed for these bytes
    def one_file() -> None:
        path = os.path.join(out_dir, "state.bin")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in tensors.values():
                mv = memoryview(t.numpy()).cast("B")
                off, n = 0, mv.nbytes
                while off < n:
                    off += os.write(fd, mv[off:off + (256 << 20)])
            os.fsync(fd)
        finally:
            os.close(fd)
        c.fsync_dir(out_dir)

    # (a) raw
    def raw() -> None:
        for name, t in tensors.items():
            mv = memoryview(t.numpy()).cast("B")
            fd = os.open(os.path.join(out_dir, name + ".bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                off, n = 0, mv.nbytes
                while off < n:
                    off += os.write(fd, mv[off:off + (256 << 20)])
                os.fsync(fd)
            finally:
                os.close(fd)
        c.fsync_dir(out_dir)

    # (a') diagnostic: same files, all written first, then fsync'd (what the disk can do when syncs are batched)
    def raw_batched() -> None:
        fds = []
        try:
            for name, t in tensors.items():
                mv = memoryview(t.numpy()).cast("B")
                fd = os.open(os.path.join(out_dir, name + ".bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                fds.append(fd)
                off, n = 0, mv.nbytes
                while off < n:
                    off += os.write(fd, mv[off:off + (256 << 20)])
            for fd in fds:
                os.fsync(fd)
        finally:
            for fd in fds:
                os.close(fd)
        c.fsync_dir(out_dir)

    # (b) flowcheck
    sizes: dict[str, int] = {}

    def flowcheck(codec: str):
        tier = LocalTier(LocalConfig(root=out_dir, codec=codec), run=state.snapshot.run)

        def go() -> None:
            m = tier.write(state.snapshot)
            sizes[codec] = sum(f.bytes for f in m.files)
        return go

    # (c) torch.save
    def tsave() -> None:
        path = os.path.join(out_dir, "state.pt")
        torch.save(sd, path)
        c.fsync_path(path)
        c.fsync_dir(out_dir)

    # (d) safetensors
    def stsave() -> None:
        path = os.path.join(out_dir, "state.safetensors")
        save_file(sd, path)
        c.fsync_path(path)
        c.fsync_dir(out_dir)

    # (e) DCP
    def dcp_save() -> None:
        import torch.distributed.checkpoint as dcp

        path = os.path.join(out_dir, "dcp")
        dcp.save(sd, checkpoint_id=path)  # FileSystemWriter(sync_files=True): fsyncs its files
        c.fsync_dir(path)
        c.fsync_dir(out_dir)

    rows = [
        c.Row("(f) one file: sequential os.write of the state + fsync", nbytes=nbytes, baseline=True),
        c.Row("(a) raw os.write + fsync, file per tensor", nbytes=nbytes),
        c.Row("(a') raw, all files written then each fsync'd", nbytes=nbytes, note="diagnostic; "),
        c.Row("(b) flowcheck LocalTier codec=none", nbytes=nbytes),
        c.Row("(c) torch.save + fsync", nbytes=nbytes),
        c.Row("(d) safetensors.torch.save_file + fsync", nbytes=nbytes),
        c.Row("(e) torch DCP save (1 process)", nbytes=nbytes),
    ]
    fns = [one_file, raw, raw_batched, flowcheck("none"), tsave, stsave, dcp_save]
    if args.lz4:
        rows.append(c.Row("(b) flowcheck LocalTier codec=lz4", nbytes=nbytes))
        fns.append(flowcheck("lz4"))
    on_disk: dict[str, int] = {}

    def after(row):
        def go() -> None:
            if not row.error:
                on_disk[row.method] = _du(out_dir)
            c.rmtree(out_dir)
        return go

    try:
        cold = c.run_rounds([(r, f, fresh, after(r)) for r, f in zip(rows, fns)], args.repeats, cold=not args.warm,
                            rotate=True)
    finally:
        c.rmtree(work)
    for r in rows:
        if r.method in on_disk:
            r.note += f"on disk {on_disk[r.method] / 1e9:.3f} GB"
    rat = c.ratios(rows)
    fc_row = rows[3]
    fc = rat[fc_row.method]
    alts = [r for r in rows[4:7] if r.times]
    fastest = min(alts, key=lambda r: r.median) if alts else None
    vs_alt = fastest.median / fc_row.median if fastest and fc_row.times else float("nan")
    goals = [
        {"comparison": "flowcheck codec=none vs one sequential write + fsync (throughput)", "ratio": fc, "goal": f">= {GOAL}x"},
        {"comparison": f"flowcheck codec=none vs the fastest alternative ({fastest.method if fastest else '-'})",
         "ratio": vs_alt, "goal": f">= {GOAL_ALT}x"},
    ]
    met = fc >= GOAL and vs_alt >= GOAL_ALT
    cache = ("page cache dropped (sync; echo 3 > drop_caches) before every measurement" if cold and not args.warm
             else "page cache NOT dropped (warm)")
    text = "\n".join([
        c.header("P3 — local snapshot (write + fsync)", state, args, cmd,
                 f"- {args.repeats} rounds, alternatives interleaved (round r starts at alternative r), median reported; "
                 f"{cache}; ratio = one_file_time / method_time"),
        "", c.table(rows, ratio_label="ratio vs one file (higher = faster)"), "",
        "| comparison | ratio | goal |", "|---|---:|---|",
        *[f"| {g['comparison']} | {g['ratio']:.2f}x | {g['goal']} |" for g in goals], "",
        f"Goals: **{'met' if met else 'NOT met'}**.",
    ])
    print("\n" + text, flush=True)
    result = {"benchmark": "P3 local snapshot", "command": cmd, "machine": c.machine(), "state": state.describe(),
              "bytes": nbytes, "cache": cache, "goal": GOAL, "goal_met": met, "goals": goals, "rows": c.rows_json(rows),
              "markdown": text}
    c.save_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
