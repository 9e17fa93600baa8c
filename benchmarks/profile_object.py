"""Where does the promotion LocalTier -> ObjectTier(s3) spend its time?  (diagnostic, not a benchmark table)

Phase breakdown of one ObjectTier.write(local.load(step)) against a moto S3 server: the library's
functions are wrapped at run time (nothing in the library changes) and the time inside each is summed.
Then the transports alone on the staged-equivalent file: s3fs put_file vs boto3 upload_file, with
botocore's default request checksums and with checksums only "when_required".

  python benchmarks/profile_object.py --gb 1.3
  py-spy record --idle --threads --format raw -o p5.raw -- python benchmarks/profile_object.py --gb 1.3 --only s3fs
"""
from __future__ import annotations

import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402
from profile_local import _acc, _wrap  # noqa: E402

BUCKET = "bench"


def main(argv: list[str] | None = None) -> None:
    p = c.base_parser(__doc__)
    p.add_argument("--only", choices=["promote", "s3fs", "boto3"], help="run just one of the measurements (for py-spy)")
    args = p.parse_args(argv)
    c.preimport()
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config as BotoConfig
    from safetensors.torch import save_file

    from flowcheck import _native
    from flowcheck.config import LocalConfig, ObjectConfig
    from flowcheck.digest import DataHasher
    from flowcheck.tiers import base, local as local_mod, object as obj_mod, safetensors_io
    from flowcheck.tiers.local import LocalTier
    from flowcheck.tiers.object import ObjectTier, filesystem

    work = c.workdir("fc-prof5-", args.dir)
    moto = c.MotoServer(os.path.join(work, "moto.log"))
    try:
        state = c.build_state(args.gb)
        nbytes = state.nbytes
        print(f"{state.describe()}; moto {moto.url}", flush=True)
        s3 = moto.client()
        s3.create_bucket(Bucket=BUCKET)
        run, step = state.snapshot.run, state.snapshot.step
        loc = LocalTier(LocalConfig(root=os.path.join(work, "local")), run=run)
        loc.write(state.snapshot)
        equiv = os.path.join(work, "state.safetensors")
        save_file(dict(state.tensors), equiv)
        del state
        gc.collect()
        staging = os.path.join(work, "staging")
        os.makedirs(staging)
        ocfg = ObjectConfig(url=f"s3://{BUCKET}/p", upload_workers=8, part_mib=64)
        fs, _ = filesystem(ocfg)

        def report(title: str, wall: float) -> None:
            print(f"\n{title}: wall {wall:.2f} s ({nbytes / 1e9 / wall:.3f} GB/s)\n")
            print("| phase | calls | seconds (sum over threads) |\n|---|---:|---:|")
            for label, (secs, calls) in _acc.items():
                print(f"| {label} | {calls} | {secs:.2f} |")
            _acc.clear()

        if args.only in (None, "promote"):
            _wrap(local_mod.LocalTier, "_read_shard", "  LocalTier._read_shard (zarr open + read + CRC32C + decode)")
            _wrap(base, "data_digest", "  xxh3 verify of each shard read (base.data_digest)")
            _wrap(base.Tier, "read_shard", "Tier.read_shard: read + verify, inclusive")
            _wrap(safetensors_io, "write", "stage: safetensors_io.write (inclusive of the shard reads)")
            _wrap(_native, "pwrite_all", "  pwrite_all to the staging file")
            _wrap(DataHasher, "update", "  xxh3 of the staged file (DataHasher.update)")
            _wrap(obj_mod.ObjectTier, "_upload", "upload: s3fs put_file (multipart)")
            _wrap(obj_mod.ObjectTier, "_commit_manifest", "manifest commit (If-None-Match)")
            _wrap(obj_mod.ObjectTier, "_exists", "existence checks")
            _wrap(obj_mod.ObjectTier, "publish_latest", "publish latest")
            c.drop_caches()
            dt, _ = c.timed(lambda: ObjectTier(ocfg, run, staging_dir=staging).write(loc.load(step)))
            report("flowcheck promotion ObjectTier.write(local.load(step))", dt)
            moto.empty_bucket(BUCKET)

        mib = 1 << 20
        if args.only in (None, "s3fs"):
            c.drop_caches()
            dt, _ = c.timed(lambda: fs.put_file(equiv, f"{BUCKET}/a/x", chunksize=64 * mib, max_concurrency=8))
            print(f"\ns3fs put_file 8 x 64 MiB: {dt:.2f} s ({nbytes / 1e9 / dt:.3f} GB/s)", flush=True)
            moto.empty_bucket(BUCKET)
        if args.only in (None, "boto3"):
            tcfg = TransferConfig(max_concurrency=8, multipart_chunksize=64 * mib, multipart_threshold=64 * mib)
            for label, cfg in (("default checksums", None),
                               ("request_checksum_calculation=when_required",
                                BotoConfig(request_checksum_calculation="when_required"))):
                if args.only and cfg is not None:
                    continue
                client = boto3.client("s3", endpoint_url=moto.url, config=cfg) if cfg else s3
                c.drop_caches()
                dt, _ = c.timed(lambda: client.upload_file(equiv, BUCKET, "b/x", Config=tcfg))
                print(f"boto3 upload_file 8 x 64 MiB, {label}: {dt:.2f} s ({nbytes / 1e9 / dt:.3f} GB/s)", flush=True)
                moto.empty_bucket(BUCKET)
    finally:
        moto.close()
        c.rmtree(work)


if __name__ == "__main__":
    main()
