"""P5: promote one training state from the local tier to S3 (a moto server on 127.0.0.1), side by side with boto3.

Setup (untimed): a GPT-like fp32 state (params + Adam slots) is written to a
flowcheck LocalTier (codec none); an equivalent safetensors file of the same
tensors (safetensors.torch.save_file) is written next to it.  A moto S3 server
runs as a subprocess; AWS_* are dummy values, AWS_ENDPOINT_URL points at moto.

  (a) flowcheck: ObjectTier(s3://bench/p, upload_workers=8, part_mib=64).write(local.load(step))
      timed: the whole promotion (read + verify zarr shards, stage safetensors, multipart upload, manifest commit)
  (b) boto3's TransferManager uploading the equivalent safetensors file (or files: --file-mib),
      TransferConfig(max_concurrency=8, multipart_chunksize=64 MiB) — baseline, 1.0x
  (c) diagnostic: s3fs put_file of the same file (chunksize 64 MiB, max_concurrency 8), the transport flowcheck uses

Objects are deleted between measurements (moto keeps them in memory).
ratio = boto3_time / method_time (higher is better; goal: flowcheck >= 1.0x).

  python benchmarks/bench_object_upload.py --gb 1.3 --out p5.json
"""
from __future__ import annotations

import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

GOAL = 1.0
SCRIPT = "bench_object_upload.py"
BUCKET = "bench"


def main(argv: list[str] | None = None) -> dict:
    p = c.base_parser(__doc__)
    p.add_argument("--workers", type=int, default=8, help="upload concurrency for all alternatives (default 8)")
    p.add_argument("--part-mib", type=int, default=64, help="multipart part size for all alternatives (default 64)")
    p.add_argument("--file-mib", type=int, default=0,
                   help="split the baselines' safetensors into files of <= this many MiB (tensors in order), uploaded "
                        "together through one TransferManager; 0 = one file (default). moto assembles a completed "
                        "multipart object in memory twice over, so one 12 GB object needs 24 GB of moto RSS: use "
                        "flowcheck's own object file size (max_file_mib, 2048) there")
    args = p.parse_args(argv)
    cmd = c.command(SCRIPT, argv)
    c.preimport()
    from boto3.s3.transfer import TransferConfig, create_transfer_manager
    from safetensors.torch import save_file

    from flowcheck.config import LocalConfig, ObjectConfig
    from flowcheck.tiers.local import LocalTier
    from flowcheck.tiers.object import ObjectTier, filesystem

    work = c.workdir("fc-bench-p5-", args.dir)
    moto = c.MotoServer(os.path.join(work, "moto.log"))
    try:
        state = c.build_state(args.gb)
        nbytes = state.nbytes
        c.check_disk(work, 4 * nbytes + (1 << 30))
        print(f"P5 object upload: {state.describe()}; moto at {moto.url}; work dir {work}", flush=True)
        s3 = moto.client()
        s3.create_bucket(Bucket=BUCKET)
        run, step = state.snapshot.run, state.snapshot.step
        local = LocalTier(LocalConfig(root=os.path.join(work, "local"), codec="none"), run=run)
        local.write(state.snapshot)
        equivs = []
        os.makedirs(os.path.join(work, "equiv"))
        for i, group in enumerate(c.split_tensors(dict(state.tensors), args.file_mib << 20)):
            equivs.append(os.path.join(work, "equiv", f"state-{i:05d}.safetensors"))
            save_file(group, equivs[-1])
        file_bytes = sum(os.path.getsize(f) for f in equivs)
        description = state.describe()
        del state
        gc.collect()

        ocfg = ObjectConfig(url=f"s3://{BUCKET}/p", upload_workers=args.workers, part_mib=args.part_mib)
        staging = os.path.join(work, "staging")
        os.makedirs(staging)
        mib = 1 << 20
        tcfg = TransferConfig(max_concurrency=args.workers, multipart_chunksize=args.part_mib * mib,
                              multipart_threshold=args.part_mib * mib)
        fs, _ = filesystem(ocfg)

        def flowcheck() -> None:
            tier = ObjectTier(ocfg, run, staging_dir=staging)
            tier.write(local.load(step))

        def boto3_upload() -> None:
            with create_transfer_manager(s3, tcfg) as tm:
                futures = [tm.upload(f, BUCKET, f"baseline/{os.path.basename(f)}") for f in equivs]
                for fut in futures:
                    fut.result()

        def s3fs_put() -> None:
            for f in equivs:
                fs.put_file(f, f"{BUCKET}/s3fs/{os.path.basename(f)}", chunksize=args.part_mib * mib,
                            max_concurrency=args.workers)

        peak = {"moto": 0.0}

        def cleanup() -> None:
            peak["moto"] = max(peak["moto"], moto.rss_mib())
            moto.empty_bucket(BUCKET)
            fs.invalidate_cache()

        rows = [
            c.Row("(a) flowcheck ObjectTier.write(local.load(step)) → s3", nbytes=nbytes,
                  note="read+verify zarr, stage safetensors, multipart upload, manifest"),
            c.Row("(b) boto3 TransferManager upload (TransferConfig 8 x 64 MiB)", nbytes=nbytes, baseline=True,
                  note=f"{len(equivs)} file(s), {file_bytes / 1e9:.3f} GB"),
            c.Row("(c) s3fs put_file (8 x 64 MiB), same file(s)", nbytes=nbytes,
                  note="diagnostic: flowcheck's transport alone"),
        ]
        fns = [flowcheck, boto3_upload, s3fs_put]
        cold = c.run_rounds([(r, f, None, cleanup) for r, f in zip(rows, fns)], args.repeats, cold=not args.warm)
    finally:
        moto.close()
        c.rmtree(work)
    rat = c.ratios(rows)
    fc = rat[rows[0].method]
    met = fc >= GOAL
    cache = ("page cache dropped before every measurement (local source files cold)"
             if cold and not args.warm else "page cache NOT dropped (warm)")
    text = "\n".join([
        c.header("P5 — promotion to object storage (moto S3 on 127.0.0.1)", None, args, cmd,
                 f"- state: {description}\n- {args.repeats} rounds, alternatives interleaved, median reported; {cache}; "
                 f"ratio = boto3_time / method_time; moto peak RSS {peak['moto'] / 1024:.1f} GiB"),
        "", c.table(rows, ratio_label="ratio vs boto3 (higher = faster)"), "",
        f"Goal flowcheck >= {GOAL}x boto3: **{'met' if met else 'NOT met'}** ({fc:.2f}x).",
    ])
    print("\n" + text, flush=True)
    result = {"benchmark": "P5 object upload", "command": cmd, "machine": c.machine(), "state": description,
              "bytes": nbytes, "cache": cache, "goal": GOAL, "goal_met": met, "moto_peak_rss_mib": peak["moto"],
              "rows": c.rows_json(rows), "markdown": text}
    c.save_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
