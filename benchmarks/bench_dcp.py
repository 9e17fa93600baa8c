"""DCP through flowcheck vs DCP's FileSystemWriter/Reader, on the same disk: N CPU ranks (gloo), each holding its
FSDP-style shard (``Shard(0)`` DTensors) of a GPT-like fp32 state (params + 2 Adam moments, benchmarks/_common.py),
plus a few non-tensor items (a scheduler's and a train loop's state).

Measured per round, alternatives interleaved (rotated each round), times on rank 0 between barriers:

* ``dcp.save`` — FileSystemWriter (one file per rank, fsync'd) vs ``flowcheck.dcp.Writer`` (local tier: one part
  per rank, durable, the step manifest committed by the coordinator);
* ``dcp.async_save`` on its own gloo group — the blocking time (the call returns after staging the state to
  CPU memory) and the time until the future is done;
* ``dcp.load`` into preallocated DTensors of the same mesh, page cache dropped first — FileSystemReader vs
  ``flowcheck.dcp.Reader`` (each stored shard read once, digest-checked, straight into the destination tensors) vs
  ``flowcheck.dcp.Reader(prefetch=False)`` (no read started before DCP's ``read_data``: what the prefetch while
  the ranks plan gains); the loaded state is checked bit for bit.

Ratio = FileSystemWriter's (or Reader's) median / flowcheck's: >= 1.0 means flowcheck is as fast or faster.

    python benchmarks/bench_dcp.py --gb 1.0 --ranks 4 --repeats 3

``--load-only``: save once with each writer, then measure only ``dcp.load`` for ``--repeats`` paired rounds (more
load pairs for the same time; the save and async_save rows are left out).  ``--tier object``: flowcheck saves to
and loads from the object tier (safetensors files through fsspec) at a ``file://`` URL on the same disk instead.
``--pool A.json B.json ...``: measure nothing; pool the rounds of earlier runs' ``--out`` files (per comparison: the
median per-round ratio, the rounds flowcheck was at least as fast, the quartiles).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

METHODS = ("fs_save", "fc_save", "fs_async", "fc_async", "fs_load", "fc_load", "fc_load_nopf")


def _state(world: int, gb: float, seed: int):
    """This rank's DTensors (even Shard(0) pieces of every tensor) and a few Python values."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed + torch.distributed.get_rank())
    tensors = {}
    for name, shape, _role in C.gpt_param_shapes(gb):
        if shape[0] % world:
            raise SystemExit(f"{name}: dim 0 of {list(shape)} does not split over {world} ranks")
        for slot in C.SLOTS:
            local = torch.randn((shape[0] // world, *shape[1:]), generator=g)
            tensors[f"{slot}.{name}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return {"model": tensors, "sched": {"last_epoch": 7, "base_lrs": [3e-4], "_last_lr": [2.9e-4]},
            "train": {"step": 7, "tokens": 123456789}}


def _empty_like(state):
    import torch
    from torch.distributed.tensor import DTensor

    def empty(v):
        if isinstance(v, DTensor):
            return DTensor.from_local(torch.empty_like(v.to_local()), v.device_mesh, v.placements, run_check=False)
        return {k: empty(x) for k, x in v.items()} if isinstance(v, dict) else None
    return {k: empty(v) for k, v in state.items()}


def join_gloo(rank: int, world: int, port: int) -> None:
    """This process as ``rank`` of a CPU (gloo) group of ``world`` ranks on 127.0.0.1:``port``, one torch thread each
    (the ranks share this host's cores)."""
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def spawn_ranks(fn, ranks: int, args: dict, prefix: str, base_dir: str | None) -> None:
    """``fn(rank, world, port, args)`` in ``ranks`` spawned processes, ``args["dir"]`` a fresh work folder removed after."""
    import torch.multiprocessing as mp

    work = C.workdir(prefix, base_dir)
    try:
        mp.start_processes(fn, args=(ranks, C.free_port(), {**args, "dir": work}), nprocs=ranks, join=True,
                           start_method="spawn")
    finally:
        C.rmtree(work)


def _rank(rank: int, world: int, port: int, args: dict) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import flowcheck.dcp

    join_gloo(rank, world, port)
    async_group = dist.new_group(backend="gloo")
    state = _state(world, args["gb"], seed=1)
    target = _empty_like(state)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    times["fs_block"], times["fc_block"] = [], []
    root, dropped = args["dir"], True
    store = f"file://{root}/fc" if args.get("tier") == "object" else f"{root}/fc"  # a URL: the object tier there

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        dist.barrier()
        return time.perf_counter() - t0, out

    def async_timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fut = fn()
        block = time.perf_counter() - t0
        fut.result()
        dist.barrier()
        return block, time.perf_counter() - t0

    load_only = args.get("load_only", False)
    for r in range(args["repeats"]):
        fs, fs_async, step = f"{root}/fs-{r}", f"{root}/fs-async-{r}", 10 * r + 1
        if load_only:  # one saved copy of each, loaded every round
            fs, step = f"{root}/fs-0", 1
        runs = {
            "fs_save": lambda fs=fs: timed(lambda: dcp.save(state, checkpoint_id=fs))[0],
            "fc_save": lambda step=step: timed(lambda: dcp.save(state, storage_writer=flowcheck.dcp.Writer(
                store, run="bench", step=step)))[0],
            "fs_async": lambda fs_async=fs_async: async_timed(lambda: dcp.async_save(
                state, checkpoint_id=fs_async, process_group=async_group)),
            "fc_async": lambda step=step: async_timed(lambda: dcp.async_save(
                state, process_group=async_group, storage_writer=flowcheck.dcp.Writer(store, run="bench",
                                                                                     step=step + 1))),
        }
        order = list(runs)[r % 4:] + list(runs)[:r % 4]
        if load_only:
            order = ["fs_save", "fc_save"] if r == 0 else []
        for m in order:
            got = runs[m]()
            if isinstance(got, tuple):
                times[m.replace("async", "block")].append(got[0])
                times[m].append(got[1])
            else:
                times[m].append(got)
        loads = ["fs_load", "fc_load", "fc_load_nopf"]
        for m in loads[r % 3:] + loads[:r % 3]:
            if rank == 0 and not args["warm"]:
                dropped = C.drop_caches() and dropped
            reader = dcp.FileSystemReader(fs) if m == "fs_load" else flowcheck.dcp.Reader(
                store, run="bench", step=step, prefetch=m == "fc_load")
            for t in target["model"].values():
                t.to_local().zero_()  # what the previous load left must not pass the check
            times[m].append(timed(lambda reader=reader: dcp.load(target, storage_reader=reader))[0])
            _check_equal(state, target, m)
        dist.barrier()
        if rank == 0 and (not load_only or r == args["repeats"] - 1):
            for path in (fs, fs_async, f"{root}/fc"):
                C.rmtree(path)
        dist.barrier()
    if rank == 0:
        with open(args["result"], "w") as f:
            json.dump({"times": times, "dropped": dropped}, f)
    dist.destroy_process_group()


def _check_equal(state, target, method: str) -> None:
    import torch

    for name, t in state["model"].items():
        if not torch.equal(t.to_local(), target["model"][name].to_local()):
            raise SystemExit(f"{method}: {name} loaded back differs from what was saved")
    if target["sched"] != state["sched"] or target["train"] != state["train"]:
        raise SystemExit(f"{method}: the non-tensor items loaded back differ")


def main(argv: list[str] | None = None) -> dict:
    import torch.multiprocessing as mp

    p = C.base_parser(__doc__, default_gb=1.0)
    p.add_argument("--ranks", type=int, default=4, help="CPU ranks (gloo processes; default 4)")
    p.add_argument("--load-only", action="store_true",
                   help="save once with each writer, then time only dcp.load for --repeats paired rounds")
    p.add_argument("--pool", nargs="+", metavar="JSON",
                   help="measure nothing: pool the per-round ratios of earlier runs' --out files and print them")
    p.add_argument("--tier", choices=("local", "object"), default="local",
                   help="flowcheck's tier: local (zarr packs; default) or object (safetensors through fsspec, a "
                        "file:// URL on the same disk)")
    args = p.parse_args(argv)
    if args.pool:
        return _pooled(args.pool)
    nbytes = int(sum(4 * len(C.SLOTS) * __import__("math").prod(s) for _, s, _ in C.gpt_param_shapes(args.gb)))
    work = C.workdir("fc-bench-dcp-", args.dir)
    C.check_disk(work, 4 * nbytes)
    result_path = os.path.join(work, "result.json")
    try:
        mp.start_processes(_rank, args=(args.ranks, C.free_port(), {
            "gb": args.gb, "repeats": args.repeats, "dir": work, "warm": args.warm, "result": result_path,
            "load_only": args.load_only, "tier": args.tier}),
            nprocs=args.ranks, join=True, start_method="spawn")
        with open(result_path) as f:
            raw = json.load(f)
    finally:
        C.rmtree(work)
    report = _report(raw, nbytes, args)
    print(report["text"])
    C.save_json(args.out, report)
    return report


PAIRS = {"save": ("fs_save", "fc_save"), "async_total": ("fs_async", "fc_async"),
         "async_blocking": ("fs_block", "fc_block"), "load": ("fs_load", "fc_load"),
         "load_nopf": ("fs_load", "fc_load_nopf"), "prefetch_gain": ("fc_load_nopf", "fc_load")}


def _pooled(paths: list[str]) -> dict:
    """Every round of several runs (their --out files), per comparison: the median per-round ratio, how many rounds
    had flowcheck at least as fast, and the quartiles; more rounds than one run gives, on a machine this noisy."""
    ratios: dict[str, list[float]] = {}
    for path in paths:
        with open(path) as f:
            t = json.load(f)["times_s"]
        for k, (a, b) in PAIRS.items():
            ratios.setdefault(k, []).extend(x / y for x, y in zip(t.get(a, []), t.get(b, [])))
    lines = [f"Pooled over {len(paths)} runs ({', '.join(os.path.basename(p) for p in paths)}):", "",
             "| comparison | rounds | median per-round ratio | rounds >= 1.0 | quartiles |", "|---|---|---|---|---|"]
    out = {}
    for k, v in ratios.items():
        if not v:
            continue
        v = sorted(v)
        q1, q3 = v[len(v) // 4], v[3 * len(v) // 4]
        out[k] = {"rounds": len(v), "median": statistics.median(v), "at_least_1": sum(x >= 1.0 for x in v)}
        lines.append(f"| {k} | {len(v)} | **{out[k]['median']:.2f}x** | {out[k]['at_least_1']} | {q1:.2f}–{q3:.2f}x |")
    print("\n".join(lines))
    return out


def _report(raw: dict, nbytes: int, args) -> dict:
    t = raw["times"]
    med = {k: statistics.median(v) for k, v in t.items() if v}

    def row(label: str, key: str, base: str | None) -> str:
        v = t[key]
        if key not in med or (base and base not in med):
            return f"| {label} | not measured | | |"
        ratio = f"**{med[base] / med[key]:.2f}x**" if base else "baseline"
        return (f"| {label} | {med[key]:.3f} ({min(v):.3f}–{max(v):.3f}) | {nbytes / med[key] / 1e9:.2f} | {ratio} |")

    cmd = C.command("bench_dcp.py", None)
    lines = [C.header("DCP through flowcheck vs FileSystemWriter", None, args, cmd,
                      f"- state: {nbytes / 1e9:.3f} GB fp32 over {args.ranks} ranks (FSDP-style Shard(0) DTensors) + "
                      f"5 non-tensor items; page cache {'dropped before loads' if raw['dropped'] else 'warm (drop failed)'}"),
             "", "| method | seconds, median (min–max) | GB/s | ratio (FileSystem / flowcheck) |", "|---|---|---|---|",
             row("dcp.save, FileSystemWriter", "fs_save", None),
             row(f"dcp.save, flowcheck.dcp.Writer ({args.tier} tier)", "fc_save", "fs_save"),
             row("dcp.async_save until done, FileSystemWriter", "fs_async", None),
             row("dcp.async_save until done, flowcheck", "fc_async", "fs_async"),
             row("dcp.async_save blocking, FileSystemWriter", "fs_block", None),
             row("dcp.async_save blocking, flowcheck", "fc_block", "fs_block"),
             row("dcp.load, FileSystemReader", "fs_load", None),
             row("dcp.load, flowcheck.dcp.Reader", "fc_load", "fs_load"),
             row("dcp.load, flowcheck.dcp.Reader(prefetch=False) (reads start at read_data)", "fc_load_nopf",
                 "fs_load")]
    pairs = {k: (a, b) for k, (a, b) in PAIRS.items() if a in med and b in med}
    ratios = {k: med[a] / med[b] for k, (a, b) in pairs.items()}
    # the same round's two runs side by side: what drifted during the run (other work on the machine) cancels
    paired = {k: statistics.median(x / y for x, y in zip(t[a], t[b])) for k, (a, b) in pairs.items()}
    lines += ["", "Per-round ratios (FileSystem / flowcheck in the same round), median: " +
              ", ".join(f"{k} **{v:.2f}x**" for k, v in paired.items())]
    if "load" in pairs:
        lines.append("Load, each round (FileSystem / flowcheck): " +
                     ", ".join(f"{x / y:.2f}x" for x, y in zip(t["fs_load"], t["fc_load"])))
    if "load_nopf" in pairs:
        lines.append("Load, each round (FileSystem / flowcheck prefetch=False): " +
                     ", ".join(f"{x / y:.2f}x" for x, y in zip(t["fs_load"], t["fc_load_nopf"])))
    return {"text": "\n".join(lines), "median_s": med, "times_s": t, "ratios": ratios, "paired_ratios": paired,
            "bytes": nbytes}


if __name__ == "__main__":
    main()
