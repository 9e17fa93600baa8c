"""P3: write one training state to local disk, durably, with flowcheck and the alternatives, side by side.

The state is a GPT-like fp32 model (params + Adam exp_avg + exp_avg_sq), built
once with torch and handed to every writer as the same memory (flowcheck gets
numpy views of the torch tensors, no copies).  Every alternative makes its bytes
durable (fsync of its files and of the directory) inside the timed region.

  (a) raw:        os.write loop + os.fsync, one file per tensor, then a directory fsync (baseline, 1.0x)
  (a') diagnostic: the same files, all written first and then fsync'd one by one
  (b) flowcheck:  LocalTier(codec=none).write(snapshot)  (zarr v3 shards, CRC32C, xxh3 digests, manifest, fsync)
                  LocalTier(codec=lz4).write(snapshot)
  (c) torch.save  of the state dict to one file + fsync
  (d) safetensors.torch.save_file + fsync
  (e) torch.distributed.checkpoint.save (single process, no process group; FileSystemWriter fsyncs)

ratio = raw_time / method_time (higher is better; goal: flowcheck >= 0.8x).

  python benchmarks/bench_local_snapshot.py --gb 1.3 --out p3.json
"""
from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

GOAL = 0.8
SCRIPT = "bench_local_snapshot.py"


def _du(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(dirpath, f))
    return total


def main(argv: list[str] | None = None) -> dict:
    args = c.base_parser(__doc__).parse_args(argv)
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
        c.Row("(a) raw os.write + fsync, file per tensor", nbytes=nbytes, baseline=True),
        c.Row("(a') raw, all files written then each fsync'd", nbytes=nbytes, note="diagnostic; "),
        c.Row("(b) flowcheck LocalTier codec=none", nbytes=nbytes),
        c.Row("(b) flowcheck LocalTier codec=lz4", nbytes=nbytes),
        c.Row("(c) torch.save + fsync", nbytes=nbytes),
        c.Row("(d) safetensors.torch.save_file + fsync", nbytes=nbytes),
        c.Row("(e) torch DCP save (1 process)", nbytes=nbytes),
    ]
    fns = [raw, raw_batched, flowcheck("none"), flowcheck("lz4"), tsave, stsave, dcp_save]
    on_disk: dict[str, int] = {}

    def after(row):
        def go() -> None:
            if not row.error:
                on_disk[row.method] = _du(out_dir)
            c.rmtree(out_dir)
        return go

    try:
        cold = c.run_rounds([(r, f, fresh, after(r)) for r, f in zip(rows, fns)], args.repeats, cold=not args.warm)
    finally:
        c.rmtree(work)
    for r in rows:
        if r.method in on_disk:
            r.note += f"on disk {on_disk[r.method] / 1e9:.3f} GB"
    rat = c.ratios(rows)
    fc = rat[rows[2].method]
    met = fc >= GOAL
    cache = ("page cache dropped (sync; echo 3 > drop_caches) before every measurement" if cold and not args.warm
             else "page cache NOT dropped (warm)")
    text = "\n".join([
        c.header("P3 — local snapshot (write + fsync)", state, args, cmd,
                 f"- {args.repeats} rounds, alternatives interleaved, median reported; {cache}; ratio = raw_time / method_time"),
        "", c.table(rows, ratio_label="ratio vs raw (higher = faster)"), "",
        f"Goal flowcheck (codec=none) >= {GOAL}x raw: **{'met' if met else 'NOT met'}** ({fc:.2f}x).",
    ])
    print("\n" + text, flush=True)
    result = {"benchmark": "P3 local snapshot", "command": cmd, "machine": c.machine(), "state": state.describe(),
              "bytes": nbytes, "cache": cache, "goal": GOAL, "goal_met": met, "rows": c.rows_json(rows), "markdown": text}
    c.save_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
