"""Where does one rank's ``dcp.load`` through ``flowcheck.dcp.Reader`` spend its time?  (diagnostic)

The state of benchmarks/bench_dcp.py (N CPU ranks, Shard(0) DTensors), saved once through flowcheck and once through
FileSystemWriter; then, page cache dropped before each, every rank loads it through each reader with rank 0 under
cProfile.  Prints rank 0's top functions by cumulative and by own time for each reader (``--direct both``: also the
Reader with ``direct=False``, reading into buffers and copying).

  python benchmarks/profile_dcp_load.py --gb 0.5 --ranks 4
"""
from __future__ import annotations

import cProfile
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
from bench_dcp import _empty_like, _state, join_gloo, spawn_ranks  # noqa: E402


def _rank(rank: int, world: int, port: int, args: dict) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import flowcheck.dcp

    join_gloo(rank, world, port)
    state = _state(world, args["gb"], seed=1)
    target = _empty_like(state)
    root = args["dir"]
    dcp.save(state, checkpoint_id=f"{root}/fs")
    dcp.save(state, storage_writer=flowcheck.dcp.Writer(f"{root}/fc", run="bench", step=1))
    readers = {"FileSystemReader": lambda: dcp.FileSystemReader(f"{root}/fs"),
               "flowcheck Reader": lambda: flowcheck.dcp.Reader(f"{root}/fc", run="bench", step=1)}
    if args["direct"] == "both":
        readers["flowcheck Reader(direct=False)"] = lambda: flowcheck.dcp.Reader(f"{root}/fc", run="bench", step=1,
                                                                                direct=False)
    for label, make in readers.items():
        if rank == 0:
            C.drop_caches()
        dist.barrier()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        dcp.load(target, storage_reader=make())
        prof.disable()
        took = time.perf_counter() - t0
        dist.barrier()
        if rank == 0:
            C.print_profile(prof, args["top"], f"rank 0, {label}: {took:.3f} s")
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:

    p = C.base_parser(__doc__, default_gb=0.5)
    p.add_argument("--ranks", type=int, default=4, help="CPU ranks (gloo processes; default 4)")
    p.add_argument("--top", type=int, default=25, help="functions listed per table (default 25)")
    p.add_argument("--direct", choices=["on", "both"], default="both",
                   help="profile the Reader as shipped, or also with direct=False (default both)")
    args = p.parse_args(argv)
    spawn_ranks(_rank, args.ranks, {"gb": args.gb, "top": args.top, "direct": args.direct}, "fc-prof-dcp-", args.dir)


if __name__ == "__main__":
    main()
