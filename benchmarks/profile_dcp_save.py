"""Where does ``dcp.save`` through ``flowcheck.dcp.Writer`` spend its time, on the coordinator and on another rank?
(diagnostic)

The state of benchmarks/bench_dcp.py (N CPU ranks, Shard(0) DTensors); each rank saves it once through
FileSystemWriter (for the wall time next to it) and ``--saves`` times through flowcheck (steps 1, 2, ...), with rank 0
(the coordinator: plans, gathers, commits) and rank 1 under cProfile.  Prints each profiled rank's top functions by
cumulative and by own time for its last flowcheck save.

  python benchmarks/profile_dcp_save.py --gb 0.5 --ranks 4
"""
from __future__ import annotations

import cProfile
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
from bench_dcp import _state, join_gloo, spawn_ranks  # noqa: E402


def _rank(rank: int, world: int, port: int, args: dict) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import flowcheck.dcp

    join_gloo(rank, world, port)
    state = _state(world, args["gb"], seed=1)
    root = args["dir"]
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=f"{root}/fs")
    dist.barrier()
    fs = time.perf_counter() - t0
    for step in range(1, args["saves"] + 1):
        dist.barrier()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        where = f"file://{root}/fc" if args["tier"] == "object" else f"{root}/fc"  # a URL: the object tier there
        dcp.save(state, storage_writer=flowcheck.dcp.Writer(where, run="bench", step=step))
        prof.disable()
        took = time.perf_counter() - t0
        dist.barrier()
        if rank == 0:
            print(f"save {step}: flowcheck {took:.3f} s (FileSystemWriter, once before: {fs:.3f} s)", flush=True)
    for who in (0, 1):
        if rank == who:
            C.print_profile(prof, args["top"], f"rank {rank}{' (coordinator)' if rank == 0 else ''}, last flowcheck "
                            f"save: {took:.3f} s")
        dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:

    p = C.base_parser(__doc__, default_gb=0.5)
    p.add_argument("--ranks", type=int, default=4, help="CPU ranks (gloo processes; default 4)")
    p.add_argument("--saves", type=int, default=2, help="flowcheck saves (steps 1..N; the last is printed; default 2)")
    p.add_argument("--top", type=int, default=30, help="functions listed per table (default 30)")
    p.add_argument("--tier", choices=("local", "object"), default="local",
                   help="flowcheck's tier: local (default) or object (a file:// URL on the same disk)")
    args = p.parse_args(argv)
    if args.ranks < 2:
        raise SystemExit(f"--ranks: expected at least 2 (rank 1 is profiled next to the coordinator), found {args.ranks}")
    spawn_ranks(_rank, args.ranks, {"gb": args.gb, "top": args.top, "saves": args.saves, "tier": args.tier}, "fc-prof-dcp-save-", args.dir)


if __name__ == "__main__":
    main()
