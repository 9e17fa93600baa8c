"""Read-back: read a whole training state from each flowcheck tier, side by side with safetensors.load_file.

Setup (untimed): a GPT-like fp32 state (params + Adam slots) is written once to
  - a LocalTier (zarr, codec none),
  - an ObjectTier on file:// (a local directory),
  - an ObjectTier on s3:// (a moto server on 127.0.0.1),
  - one safetensors file of the same tensors (safetensors.torch.save_file).

Whole state (ratio = safetensors_time / method_time, higher is faster):
  baseline   safetensors.torch.load_file(file)  (default mmap backend: returns before most bytes are read)
  safetensors  load_file + one byte of every 4 KiB page touched; load_file(backend="pread") (every byte in memory)
  local      LocalTier.read(step, name) for every tensor
  local      LocalTier.load(step): every shard read and its xxh3 digest verified (goal >= 1.0x)
  object     ObjectTier(file://).load(step): every shard read and verified (goal >= 0.9x)
  object     ObjectTier(file://).read(step, name) for every tensor
  object     ObjectTier(s3://moto).read(step, name) for every tensor

Row slices (the first 1/8 of the rows of every tensor; 1-D tensors: the first 1/8 of their elements),
each against the same tier's whole read (ratio = whole_time / slice_time):
  safetensors safe_open(...).get_slice(name)[:rows // 8]
  local, object file://, object s3:// .read(step, name, (slice(0, rows // 8),))

  python benchmarks/bench_readback.py --gb 1.3 --out readback.json
"""
from __future__ import annotations

import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

SCRIPT = "bench_readback.py"
BUCKET = "bench"


def main(argv: list[str] | None = None) -> dict:
    p = c.base_parser(__doc__)
    p.add_argument("--no-s3", action="store_true", help="skip the moto S3 object tier")
    p.add_argument("--s3-file-mib", type=int, default=64,
                   help="max_file_mib of the moto object tier (default 64): moto reads the WHOLE object for every "
                        "range GET, so with flowcheck's default 2048 MiB files each tensor read costs ~1.4 s on moto")
    args = p.parse_args(argv)
    cmd = c.command(SCRIPT, argv)
    c.preimport()
    from safetensors import safe_open
    import torch
    from safetensors.torch import load_file, save_file

    from flowcheck.config import LocalConfig, ObjectConfig
    from flowcheck.tiers.local import LocalTier
    from flowcheck.tiers.object import ObjectTier

    work = c.workdir("fc-bench-rb-", args.dir)
    moto = None if args.no_s3 else c.MotoServer(os.path.join(work, "moto.log"))
    try:
        state = c.build_state(args.gb)
        nbytes = state.nbytes
        c.check_disk(work, 4 * nbytes + (1 << 30))
        description = state.describe()
        print(f"read-back: {description}; work dir {work}", flush=True)
        run, step = state.snapshot.run, state.snapshot.step
        staging = os.path.join(work, "staging")
        os.makedirs(staging)
        local = LocalTier(LocalConfig(root=os.path.join(work, "local"), codec="none"), run=run)
        local.write(state.snapshot)
        obj_file = ObjectTier(ObjectConfig(url="file://" + os.path.join(work, "object")), run, staging_dir=staging)
        obj_file.write(state.snapshot)
        obj_s3 = None
        if moto is not None:
            moto.client().create_bucket(Bucket=BUCKET)
            obj_s3 = ObjectTier(ObjectConfig(url=f"s3://{BUCKET}/p", max_file_mib=args.s3_file_mib), run,
                                staging_dir=staging)
            obj_s3.write(state.snapshot)
        stfile = os.path.join(work, "state.safetensors")
        save_file(dict(state.tensors), stfile)
        shapes = {n: tuple(t.shape) for n, t in state.tensors.items()}
        del state
        gc.collect()

        def eighth(shape: tuple[int, ...]) -> int:
            return max(1, shape[0] // 8)

        slice_bytes = sum(eighth(s) * (nb // s[0]) for s, nb in
                          ((s, 4 * int(__import__("math").prod(s))) for s in shapes.values()))

        sink = {"n": 0}

        def st_whole() -> None:
            d = load_file(stfile)
            sink["n"] = sum(t.nbytes for t in d.values())

        def st_touched() -> None:  # load_file maps the file: its tensors read their bytes only when touched
            d = load_file(stfile)
            sink["n"] = sum(int(t.reshape(-1).view(torch.uint8)[::4096].sum()) for t in d.values())

        def st_pread() -> None:  # safetensors' other backend: every byte read into memory by load_file itself
            d = load_file(stfile, backend="pread")
            sink["n"] = sum(t.nbytes for t in d.values())

        def st_slice() -> None:
            n = 0
            with safe_open(stfile, framework="pt") as f:
                for name in f.keys():
                    t = f.get_slice(name)[: eighth(shapes[name])]
                    n += t.nbytes
            sink["n"] = n

        def tier_whole(tier):
            def go() -> None:
                m = tier.manifest(step)
                sink["n"] = sum(tier.read(step, name, manifest=m).nbytes for name in shapes)
            return go

        def s3_get_files() -> None:
            s3 = moto.client()
            m = obj_s3.manifest(step)
            sink["n"] = sum(len(s3.get_object(Bucket=BUCKET, Key=f"p/{run}/{f.path}")["Body"].read()) for f in m.files)

        def tier_load(tier):
            def go() -> None:
                snap = tier.load(step)  # verify=True: every shard's digest is checked
                sink["n"] = sum(snap.array(s).nbytes for s in snap.shards())
            return go

        def tier_slice(tier):
            def go() -> None:
                m = tier.manifest(step)
                sink["n"] = sum(tier.read(step, name, (slice(0, eighth(shapes[name])),), manifest=m).nbytes
                                for name in shapes)
            return go

        def fresh(tier):
            def go() -> None:
                if hasattr(tier, "_headers"):
                    tier._headers.clear()  # no header cache carried between measurements
                    tier.fs.invalidate_cache()
            return go

        whole = [
            (c.Row("safetensors.torch.load_file", nbytes=nbytes, baseline=True), st_whole, None),
            (c.Row("flowcheck LocalTier.read per tensor", nbytes=nbytes), tier_whole(local), None),
            (c.Row("flowcheck LocalTier.load(step), all shards, digests verified", nbytes=nbytes), tier_load(local), None),
            (c.Row("flowcheck ObjectTier file:// load(step), all shards, digests verified", nbytes=nbytes),
             tier_load(obj_file), fresh(obj_file)),
            (c.Row("flowcheck ObjectTier file:// read per tensor", nbytes=nbytes), tier_whole(obj_file), fresh(obj_file)),
        ]
        whole += [(c.Row("safetensors.torch.load_file + one byte of every 4 KiB page touched", nbytes=nbytes,
                         note="every byte in memory, as a restore that copies the tensors sees it"), st_touched, None),
                   (c.Row('safetensors.torch.load_file(backend="pread")', nbytes=nbytes,
                          note="every byte read into memory by load_file"), st_pread, None)]
        if obj_s3 is not None:
            whole.append((c.Row(f"boto3 get_object of every stored file, whole ({args.s3_file_mib} MiB files, moto)",
                                nbytes=nbytes, note="s3 reference: one GET per file, no parsing"), s3_get_files, None))
            whole.append((c.Row(f"flowcheck ObjectTier s3 (moto, {args.s3_file_mib} MiB files) read per tensor",
                                nbytes=nbytes), tier_whole(obj_s3), fresh(obj_s3)))
        sliced = [
            (c.Row("safetensors safe_open get_slice[:rows/8]", nbytes=slice_bytes, baseline=True), st_slice, None),
            (c.Row("flowcheck LocalTier.read rows/8", nbytes=slice_bytes), tier_slice(local), None),
            (c.Row("flowcheck ObjectTier file:// read rows/8", nbytes=slice_bytes), tier_slice(obj_file), fresh(obj_file)),
        ]
        if obj_s3 is not None:
            sliced.append((c.Row(f"flowcheck ObjectTier s3 (moto, {args.s3_file_mib} MiB files) read rows/8",
                                 nbytes=slice_bytes), tier_slice(obj_s3),
                           fresh(obj_s3)))
        entries = [(r, f, s, None) for r, f, s in whole + sliced]
        cold = c.run_rounds(entries, args.repeats, cold=not args.warm, rotate=True)
    finally:
        if moto is not None:
            moto.close()
        c.rmtree(work)

    whole_rows = [r for r, *_ in whole]
    slice_rows = [r for r, *_ in sliced]
    # slice table: each slice read against the same tier's whole read
    pairs = [(whole_rows[0], slice_rows[0]), (whole_rows[1], slice_rows[1]), (whole_rows[4], slice_rows[2])]
    if len(slice_rows) > 3:
        pairs.append((whole_rows[-1], slice_rows[3]))
    slice_md = ["| tier | whole state s | 1/8 rows s | bytes read (slice) | slice GB/s | speed-up whole/slice |",
                "|---|---:|---:|---:|---:|---:|"]
    slice_json = []
    for w, s in pairs:
        if w.times and s.times:
            sp = w.median / s.median
            slice_md.append(f"| {s.method} | {w.median:.3f} | {s.median:.3f} | {s.nbytes / 1e9:.3f} GB | {s.gbps:.3f} | {sp:.1f}x |")
        else:
            sp = None
            slice_md.append(f"| {s.method} | – | – | – | – | FAILED: {s.error or w.error} |")
        slice_json.append({"whole": w.method, "slice": s.method, "whole_s": w.median if w.times else None,
                           "slice_s": s.median if s.times else None, "speedup": sp})
    rat = c.ratios(whole_rows)
    goals = [{"comparison": "flowcheck LocalTier.load (digests verified) vs safetensors.load_file",
              "ratio": rat[whole_rows[2].method], "goal": ">= 1.0x"},
             {"comparison": "flowcheck ObjectTier file:// load (digests verified) vs safetensors.load_file",
              "ratio": rat[whole_rows[3].method], "goal": ">= 0.9x"}]
    # load_file's default backend maps the file and returns before most bytes are read (a cold load leaves about a
    # quarter of them in the page cache): against a load that has every byte in memory, as flowcheck's does
    for i, label in ((5, "load_file + every page touched"), (6, 'load_file(backend="pread")')):
        fair, ours = whole_rows[i], whole_rows[2]
        if fair.times and ours.times:
            goals.append({"comparison": f"flowcheck LocalTier.load (digests verified) vs safetensors {label}",
                          "ratio": fair.median / ours.median, "goal": "(every byte in memory on both sides)"})
    goal_md = ["| comparison | ratio | goal |", "|---|---:|---|"] + [
        f"| {g['comparison']} | {g['ratio']:.2f}x | {g['goal']} |" for g in goals]
    cache = ("page cache dropped before every measurement (cold local reads, moto's spooled object files too)"
             if cold and not args.warm else "page cache NOT dropped (warm)")
    text = "\n".join([
        c.header("Read-back — whole state and 1/8 row slices", None, args, cmd,
                 f"- state: {description}\n- {args.repeats} rounds, alternatives interleaved (round r starts at alternative r), median reported; {cache}"),
        "", "Whole state (ratio = safetensors_time / method_time):", "",
        c.table(whole_rows, ratio_label="ratio vs safetensors (higher = faster)"), "", "\n".join(goal_md), "",
        f"First 1/8 of the rows of every tensor ({slice_bytes / 1e9:.3f} GB of {nbytes / 1e9:.3f} GB), vs the same reader's whole read:",
        "", "\n".join(slice_md),
    ])
    print("\n" + text, flush=True)
    result = {"benchmark": "read-back", "command": cmd, "machine": c.machine(), "state": description, "bytes": nbytes,
              "cache": cache, "goals": goals, "rows": c.rows_json(whole_rows), "slice_rows": c.rows_json(slice_rows),
              "slices": slice_json, "markdown": text}
    c.save_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
