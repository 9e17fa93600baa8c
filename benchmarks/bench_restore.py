"""P6 restore: a stored GPT training state into Megatron layout TP=2/PP=2, side by side with a raw read and DCP.

Setup (untimed): a GPT (flowcheck.restore.arch.ModelArch, hidden 1024 (256 below 0.5 GB), 16 heads, ffn 4x hidden, vocab 50257,
LayerNorm, learned positions, tied embeddings; layers picked so params + exp_avg + exp_avg_sq in fp32 ~ --gb)
of random fp32 tensors is written once to a safetensors file (arch in __metadata__), imported into a store's
local tier (restore.importer.import_into), promoted to an s3:// object tier on each S3 server (store.promote;
--servers: moto, seaweedfs — a SeaweedFS cluster of tests/seaweedfs.py; default both when weed is installed),
and saved once more with torch.distributed.checkpoint (dcp.save(no_dist=True), the same canonical tensors).

Timed (ratio = raw_read_time / method_time = method GB/s / raw-read GB/s; GB = state bytes, 1e9):
  baseline  raw read: every file of the step's local directory read whole into memory, sequentially
  bound     raw write + fsync, one file, of as many bytes as each format's restore writes (measured by an
            untimed restore first): a restore's goal is >= 0.7x of (raw read + that raw write)
  flowcheck restore(store, step, Target(tp=2, pp=2, fmt=F), out, prefer="local", workers=4), F = megatron-dist, megatron
  DCP       load only: per target rank (4), dcp.load of a state dict of the full global tensors that rank's
            pipeline stage needs (params + both Adam slots), nothing written
  DCP       reshard + torch.save: the same loads, each tensor cut to the rank's TP box (flowcheck's megatron_common.cut:
            a copy, = torch.chunk(full, 2, dim)[tp].clone() plus the vocab padding rows), one torch.save per rank
            (mp_rank_XX_YYY/model_optim_rng.pt) - the job flowcheck's legacy writer does
  object    per server: boto3 get_object of every stored file (reference), flowcheck restore megatron-dist with
            prefer="object" (what a user does after losing the node); goal: restore >= 0.7x of (boto3 GET of every
            stored file + raw write + fsync of the bytes the megatron-dist restore writes), as a time ratio

Durability: every writer's measurement ends with os.sync() inside the timed region (flowcheck megatron-dist already
fsyncs its DCP files; the legacy writer and torch.save do not fsync). Page cache dropped before every measurement.

  python benchmarks/bench_restore.py --gb 1.3 --out restore.json
  python benchmarks/bench_restore.py --gb 0.5 --servers moto,seaweedfs
"""
from __future__ import annotations

import gc
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

SCRIPT = "bench_restore.py"
BUCKET = "bench"
STEP = 100
TP, PP = 2, 2
SLOT_NAMES = ("exp_avg", "exp_avg_sq")


def model_arch(gb: float):
    """A GPT sized so params + 2 fp32 Adam slots ~= gb * 1e9 bytes (an even number of layers, >= 2)."""
    from flowcheck.restore.arch import ModelArch
    from flowcheck.restore.megatron_map import model_params

    target = gb * 1e9 / c.BYTES_PER_PARAM
    hidden, vocab = (1024 if gb >= 0.5 else 256), 50257  # hidden 256 only for quick smoke runs
    if vocab * hidden > 0.5 * target:  # small runs: keep the embedding <= half the state
        vocab = max(256, int(0.5 * target / hidden))

    def arch(layers: int):
        return ModelArch(num_layers=layers, hidden_size=hidden, num_attention_heads=16, num_query_groups=16,
                         ffn_hidden_size=4 * hidden, vocab_size=vocab, swiglu=False, normalization="LayerNorm",
                         position_embedding_type="learned_absolute", max_position_embeddings=1024)

    def n(a) -> int:
        return sum(math.prod(p.shape) for p in model_params(a))

    two_layers = n(arch(4)) - n(arch(2))
    layers = max(2, 2 * round((target - n(arch(2))) / two_layers) + 2)
    return arch(layers), n(arch(layers))


def build(arch, ref: str, dcp_dir: str, seed: int = 0) -> int:
    """Write the reference safetensors file and the DCP checkpoint of the same tensors; returns the state bytes."""
    import torch
    import torch.distributed.checkpoint as dcp

    from flowcheck.restore.megatron_map import model_params
    from flowcheck.tiers import safetensors_io as st

    g = torch.Generator().manual_seed(seed)
    state = {}
    for p in model_params(arch):
        state[p.name] = torch.randn(p.shape, generator=g).mul_(0.02)
        state[f"optimizer.exp_avg.{p.name}"] = torch.randn(p.shape, generator=g).mul_(1e-3)
        state[f"optimizer.exp_avg_sq.{p.name}"] = torch.randn(p.shape, generator=g).square_().mul_(1e-6)
    nbytes = sum(t.nbytes for t in state.values())
    meta = {k: json.dumps(v) for k, v in arch.to_json().items()}
    meta["optimizer_step"] = str(STEP)
    # tensor by tensor (a standard safetensors file): safetensors' save_file builds the whole file in memory
    # first, the state twice over, which a 12 GB state does not fit beside on this host
    st.write(ref, [st.Entry(k, "float32", tuple(t.shape), lambda t=t: t.numpy()) for k, t in state.items()], meta)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_dir), no_dist=True)
    del state
    gc.collect()
    return nbytes


def main(argv: list[str] | None = None) -> dict:
    p = c.base_parser(__doc__)
    p.add_argument("--no-s3", action="store_true", help="skip the S3 object tiers")
    p.add_argument("--servers", default=None,
                   help="comma-separated S3 servers: moto, seaweedfs (default: both when weed is installed, else moto)")
    p.add_argument("--s3-file-mib", type=int, default=64,
                   help="max_file_mib of the S3 object tiers (default 64): moto reads the WHOLE object for every "
                        "range GET, so with flowcheck's default 2048 MiB files every shard read costs a full-file read")
    p.add_argument("--workers", type=int, default=4, help="restore(workers=...) (default 4)")
    p.add_argument("--object-only", action="store_true",
                   help="measure only what the object-tier goal needs: the raw read, the local torch_dist restore, the "
                        "raw write of its output, and per S3 server the boto3 GETs and the object-tier restore")
    args = p.parse_args(argv)
    cmd = c.command(SCRIPT, argv)
    c.preimport()
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from flowcheck.config import from_dict
    from flowcheck.restore.importer import import_into
    from flowcheck.restore.megatron_common import Target, cut
    from flowcheck.restore.megatron_map import rank_tensors
    from flowcheck.restore.service import restore
    from flowcheck.store import open_store
    from flowcheck.tiers.base import step_dir

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # dcp no_dist: expected
    arch, n_params = model_arch(args.gb)
    work = c.workdir("fc-bench-restore-", args.dir)
    servers: dict = {}
    rows: list[tuple] = []
    try:
        # at the peak: the store's local copy, DCP's copy and one restore's output (~1x each); per S3 server, its
        # objects and the promotion's staging (~1x more) and the source file while it is imported
        names = [] if args.no_s3 else c.s3_servers(args.servers)
        c.check_disk(work, int((3 + 2 * len(names)) * n_params * c.BYTES_PER_PARAM) + (1 << 30))
        ref, dcp_dir = os.path.join(work, "ref.safetensors"), os.path.join(work, "dcp")
        nbytes = build(arch, ref, dcp_dir)
        description = (f"GPT (ModelArch) {arch.num_layers} layers, hidden {arch.hidden_size}, {arch.num_attention_heads} heads, "
                       f"ffn {arch.ffn}, vocab {arch.vocab_size} (padded {arch.padded_vocab(TP)} at TP={TP}), tied, LayerNorm, "
                       f"learned positions: {n_params / 1e6:.1f}M params x 3 fp32 slots (param, exp_avg, exp_avg_sq) "
                       f"= {nbytes / 1e9:.3f} GB")
        print(f"restore: {description}; work dir {work}", flush=True)
        def store_cfg(endpoint: str | None):  # the local tier, and the object tier on one server
            obj = {"url": f"s3://{BUCKET}/p", "endpoint_url": endpoint, "max_file_mib": args.s3_file_mib,
                   "staging_dir": os.path.join(work, "staging")} if endpoint else {"enabled": False}
            return from_dict({"run": "bench", "tiers": {"local": {"root": os.path.join(work, "local")}, "object": obj}})

        cfgs = {}
        for name in names:
            servers[name] = c.s3_server(name, work)
            servers[name].client().create_bucket(Bucket=BUCKET)
            cfgs[name] = store_cfg(servers[name].url)
        # one config for the local rows and the import: the run is bound to its object tier URL (s3://bench/p on
        # every server: a store of another server's config is the same experiment)
        cfg = cfgs[names[0]] if names else store_cfg(None)
        store = open_store(cfg)
        import_into(store, ref, STEP)
        os.remove(ref)
        for name in names:
            open_store(cfgs[name]).promote(STEP)
        step_path = os.path.join(store.local.root, step_dir(STEP))
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(step_path) for f in fs)
        stored = sum(os.path.getsize(f) for f in files)
        del store
        gc.collect()
        out = os.path.join(work, "out")
        ranks = [(t, pp) for pp in range(PP) for t in range(TP)]
        rank_rts = {r: list(rank_tensors(arch, TP, PP, 1, r[0], r[1])) for r in ranks}
        sink = {"n": 0, "store": None}

        def raw_read() -> None:
            n = 0
            for f in files:
                with open(f, "rb", buffering=0) as fh:
                    n += len(fh.readall())
            sink["n"] = n

        def fresh_store(on=None):  # a new store per measurement: no manifest / header cache carried over
            def go() -> None:
                sink["store"] = None
                gc.collect()
                sink["store"] = open_store(cfgs[on] if on else cfg)
            return go

        def fc_restore(fmt: str, prefer: str):
            def go() -> None:
                rep = restore(sink["store"], STEP, Target(tp=TP, pp=PP, vpp=1, fmt=fmt), out, prefer=prefer,
                              workers=args.workers)
                os.sync()
                sink["n"] = rep.bytes
            return go

        def fc_read_only() -> None:
            """flowcheck's read path alone: every tensor read, verified and cut for its ranks; nothing written."""
            from flowcheck.restore.service import _tensors
            from flowcheck.restore.source import StepReader

            reader = StepReader.open(sink["store"], STEP, "local")
            params = reader.params()
            slots = [x for x in reader.slots() if x not in ("step", "fp32_param")]
            by_name: dict = {}
            for rts in rank_rts.values():
                for rt in rts:
                    by_name.setdefault(rt.param.name, []).append(rt)
            def cuts(p, _slot, t) -> int:  # on the reading threads, as the legacy writer's prepare
                return sum(cut(t, rt).nbytes for rt in by_name[p.name])

            sink["n"] = sum(n for _p, _slot, n in _tensors(reader, Target(tp=TP, pp=PP), params, slots, args.workers,
                                                            False, cuts))

        def clean() -> None:
            sink["store"] = None
            c.rmtree(out)

        def raw_write(size: int):
            def go() -> None:
                """The write bound: ``size`` bytes written sequentially to one file, then fsync."""
                os.makedirs(out, exist_ok=True)
                block = os.urandom(64 << 20)
                with open(os.path.join(out, "raw.bin"), "wb", buffering=0) as fh:
                    left = size
                    while left > 0:
                        left -= fh.write(memoryview(block)[:min(left, len(block))])
                    os.fsync(fh.fileno())
                sink["n"] = size
            return go

        written = {}  # bytes each format's restore writes, from one untimed restore
        for fmt in ("megatron-dist", "megatron"):
            fresh_store()()
            written[fmt] = restore(sink["store"], STEP, Target(tp=TP, pp=PP, vpp=1, fmt=fmt), out, prefer="local",
                                   workers=args.workers).bytes
            clean()

        def dcp_rank(rank) -> dict:
            names = {rt.param.name for rt in rank_rts[rank]}
            keys = sorted(names | {f"optimizer.{s}.{n}" for s in SLOT_NAMES for n in names})
            shapes = {rt.param.name: rt.param.shape for rt in rank_rts[rank]}
            sd = {k: torch.empty(shapes[k.split(".", 2)[2] if k.startswith("optimizer.") else k]) for k in keys}
            dcp.load(sd, storage_reader=dcp.FileSystemReader(dcp_dir), no_dist=True)
            return sd

        def dcp_load_only() -> None:
            n = 0
            for r in ranks:
                sd = dcp_rank(r)
                n += sum(t.nbytes for t in sd.values())
                del sd
            sink["n"] = n

        def dcp_reshard() -> None:
            for r in ranks:
                sd = dcp_rank(r)
                obj = {"model": {}, "optimizer": {s: {} for s in SLOT_NAMES}}
                for rt in rank_rts[r]:
                    obj["model"][rt.key] = cut(sd[rt.param.name], rt)
                    for s in SLOT_NAMES:
                        obj["optimizer"][s][rt.key] = cut(sd[f"optimizer.{s}.{rt.param.name}"], rt)
                del sd
                path = os.path.join(out, f"iter_{STEP:07d}", f"mp_rank_{r[0]:02d}_{r[1]:03d}", "model_optim_rng.pt")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save(obj, path)
                del obj
            os.sync()

        def s3_get_files(name: str):
            def go() -> None:
                s3 = servers[name].client()
                keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"p/bench/{step_dir(STEP)}/")["Contents"]]
                sink["n"] = sum(len(s3.get_object(Bucket=BUCKET, Key=k)["Body"].read()) for k in keys)
            return go

        w = args.workers
        rows = [
            (c.Row("raw read: every file of the local step dir, whole, sequential", nbytes=nbytes, baseline=True,
                   note=f"{len(files)} files, {stored / 1e9:.3f} GB on disk"), raw_read, None, None),
            (c.Row(f"flowcheck restore local -> megatron-dist (torch_dist) TP{TP}/PP{PP}", nbytes=nbytes,
                   note=f"workers={w}; DCP files fsync'd (sync_files=True) + os.sync"), fc_restore("megatron-dist", "local"),
             fresh_store(), clean),
            (c.Row(f"flowcheck restore local -> megatron (legacy) TP{TP}/PP{PP}", nbytes=nbytes,
                   note=f"workers={w}; torch.save per rank, each file fsync'd as soon as its rank is complete; + os.sync"),
             fc_restore("megatron", "local"), fresh_store(), clean),
            (c.Row(f"flowcheck read + verify + cut for TP{TP}/PP{PP}, nothing written", nbytes=nbytes,
                   note=f"workers={w}; the read half of a restore"), fc_read_only, fresh_store(), None),
            (c.Row("raw write + fsync, one file, of the bytes the torch_dist restore writes", nbytes=nbytes,
                   note=f"{written['megatron-dist'] / 1e9:.3f} GB written; the write half's bound"),
             raw_write(written["megatron-dist"]), None, clean),
            (c.Row("raw write + fsync, one file, of the bytes the legacy restore writes", nbytes=nbytes,
                   note=f"{written['megatron'] / 1e9:.3f} GB written; the write half's bound"),
             raw_write(written["megatron"]), None, clean),
            (c.Row("DCP load only: 4 ranks x dcp.load(full tensors of the rank's stage)", nbytes=nbytes,
                   note="nothing written; TP peers re-read the same stage (2nd read warm)"), dcp_load_only, None, None),
            (c.Row(f"DCP load + reshard (cut) + torch.save per rank, TP{TP}/PP{PP}", nbytes=nbytes,
                   note="same job as the legacy writer; os.sync in timed region"), dcp_reshard, None, clean),
        ]
        for name in names:
            rows += [
                (c.Row(f"boto3 get_object of every stored file ({name}, {args.s3_file_mib} MiB files)", nbytes=nbytes,
                       note="object reference: one GET per file, no parsing"), s3_get_files(name), None, None),
                (c.Row(f"flowcheck restore object ({name}) -> megatron-dist TP{TP}/PP{PP}", nbytes=nbytes,
                       note=f"workers={w}; {args.s3_file_mib} MiB files; + os.sync"),
                 fc_restore("megatron-dist", "object"), fresh_store(name), clean),
            ]
        c.rmtree(out)
        measured = [rows[i] for i in (0, 1, 4)] + rows[8:] if args.object_only else rows
        cold = c.run_rounds(measured, args.repeats, cold=not args.warm, rotate=True)
    finally:
        for server in servers.values():
            server.close()
        c.rmtree(work)

    table_rows = [r for r, *_ in rows]
    raw = table_rows[0]
    fc_dist, fc_leg, fc_read, raw_w_dist, raw_w_leg, dcp_only, dcp_rs = table_rows[1:8]

    def ratio(a, b) -> float | None:  # b_time / a_time: > 1 means a is faster
        return b.median / a.median if a.times and b.times else None

    def vs_bound(fc, raw_w) -> float | None:  # (raw read + raw write of the bytes it writes) / restore time
        return (raw.median + raw_w.median) / fc.median if fc.times and raw.times and raw_w.times else None

    goals = [
        ("flowcheck local megatron-dist vs raw read + raw write of its output (time ratio)",
         vs_bound(fc_dist, raw_w_dist), ">= 0.7x"),
        ("flowcheck local megatron (legacy) vs raw read + raw write of its output (time ratio)",
         vs_bound(fc_leg, raw_w_leg), ">= 0.7x"),
        ("flowcheck local megatron-dist vs raw read alone (throughput)", ratio(fc_dist, raw), "-"),
        ("flowcheck local megatron (legacy) vs raw read alone (throughput)", ratio(fc_leg, raw), "-"),
        ("flowcheck local megatron (legacy) vs DCP reshard + torch.save (speed-up)", ratio(fc_leg, dcp_rs), ">= 1.5x"),
        ("flowcheck local megatron-dist vs DCP reshard + torch.save (speed-up)", ratio(fc_dist, dcp_rs), ">= 1.5x"),
        ("flowcheck local megatron-dist vs DCP load only (speed-up)", ratio(fc_dist, dcp_only), "-"),
        ("flowcheck read + verify + cut vs raw read (throughput)", ratio(fc_read, raw), "-"),
    ]
    for i, name in enumerate(servers):
        s3_ref, fc_obj = table_rows[8 + 2 * i:10 + 2 * i]
        goals += [(f"flowcheck object ({name}) megatron-dist vs boto3 GET of every file + raw write of its output "
                   "(time ratio)", (s3_ref.median + raw_w_dist.median) / fc_obj.median
                   if fc_obj.times and s3_ref.times and raw_w_dist.times else None, ">= 0.7x"),
                  (f"flowcheck object ({name}) megatron-dist vs local megatron-dist (throughput)", ratio(fc_obj, fc_dist), "-"),
                  (f"flowcheck object ({name}) megatron-dist vs boto3 get of every file (throughput)",
                   ratio(fc_obj, s3_ref), "-")]
    if args.object_only:
        goals = [g for g in goals if g[1] is not None]
    goal_md = ["| comparison | ratio | goal |", "|---|---:|---|"]
    goal_md += [f"| {n} | {'–' if v is None else f'{v:.2f}x'} | {g} |" for n, v, g in goals]
    cache = ("page cache dropped before every measurement (cold local reads and DCP file, the S3 servers' files too)"
             if cold and not args.warm else "page cache NOT dropped (warm)")
    notes = ("- fsync: flowcheck's writers fsync every file (DCP FileSystemWriter(sync_files=True); legacy: per rank file); the DCP "
             "alternative uses torch.save without fsync. For equal durability every writing measurement calls os.sync() "
             "inside its timed region.\n"
             "- flowcheck megatron-dist writes the model tensors twice (model + optimizer.state.param, fully_reshardable), "
             "so its output is ~4/3 of the state; legacy output = state + vocab padding. GB/s are of state bytes.\n"
             "- DCP alternative: no process group; each rank loads *full* global tensors of its pipeline stage "
             "(a single-chunk DCP save cannot be range-read per TP box with plain tensors), then cuts its TP box.")
    text = "\n".join([
        c.header(f"P6 restore — TP{TP}/PP{PP} from the local and object tiers vs raw read and DCP", None, args, cmd,
                 f"- state: {description}\n- {args.repeats} rounds, alternatives interleaved (round r starts at alternative r), "
                 f"median reported; {cache}\n"
                 + notes),
        "", "ratio = raw_read_time / method_time (= method GB/s ÷ raw-read GB/s):", "",
        c.table([r for r in table_rows if r.times or r.error], ratio_label="ratio vs raw read"), "", "\n".join(goal_md),
    ])
    print("\n" + text, flush=True)
    result = {"benchmark": "restore", "command": cmd, "machine": c.machine(), "state": description, "bytes": nbytes,
              "arch": arch.to_json(), "cache": cache, "rows": c.rows_json(table_rows),
              "ratios": [{"comparison": n, "ratio": v, "goal": g} for n, v, g in goals], "markdown": text}
    c.save_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
