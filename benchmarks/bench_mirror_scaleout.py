"""Mirror capture scaled out: decode work of one part of K next to the whole decode, on the same capture, one run.

The simulator (`flowcheck simulate`, not timed) trains --model on an N=--dp ring for --iters iterations and writes
the mirror ports' captures (3 mirrored ranks, LL, fp32). Each round decodes the same in-memory frames once as one
node (the whole state) and once as every part i of K for each K in --parts (flowcheck.capture.mirror.partition),
consuming every allreduce; rows are interleaved, medians reported. "placed" is the data bytes merged into allreduce
vectors (what a part skips), counted by the assembler. The share of decode work every node repeats whatever K
(reading, parsing, ICRC, reassembly, schedule) is s = (K·t_part/t_whole − 1)/(K − 1) from the mean part's median
process CPU time (the decode is single-threaded; CPU time is steadier than wall time on a shared machine); it is
the --shared-decode-fraction of `flowcheck plan --cores-per-node`. Ratios are printed, never asserted.

  python benchmarks/bench_mirror_scaleout.py --model small --dp 8 --iters 4 --parts 2,4 --repeats 5
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402


def _decode_s(job, frames, partition) -> tuple[float, float, int]:
    from flowcheck.capture.mirror.decode import Decoded, decode

    info = Decoded()
    t0, c0 = time.perf_counter(), time.process_time()
    n = sum(1 for _ in decode(job, frames, info, partition=partition))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if not n:
        raise SystemExit("no allreduce decoded: the capture is empty?")
    return wall, cpu, info.placed_bytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=["tiny", "small"])
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--parts", default="2,4", help="K values, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    from flowcheck.capture.mirror.decode import read_all
    from flowcheck.capture.mirror.job import load_job
    from flowcheck.capture.mirror.partition import Partition
    from flowcheck.simulate import SimOptions, simulate

    ks = [int(k) for k in args.parts.split(",")]
    with tempfile.TemporaryDirectory(prefix="fc-scaleout-") as tmp:
        sim = simulate(SimOptions(out=tmp, dp=args.dp, iters=args.iters, model=args.model, seed=0))
        job = load_job(os.path.join(tmp, "job.yaml"))
        frames = read_all(sorted(glob.glob(os.path.join(tmp, "mirror-*.pcap"))))
        wire = int(frames.lengths.sum())
        rows = {"whole": None, **{f"part {i} of {k}": Partition(i, k) for k in ks for i in range(k)}}
        times: dict[str, list[float]] = {name: [] for name in rows}
        cpus: dict[str, list[float]] = {name: [] for name in rows}
        placed: dict[str, int] = {}
        for _ in range(args.repeats):
            for name, part in rows.items():
                wall, cpu, placed[name] = _decode_s(job, frames, part)
                times[name].append(wall)
                cpus[name].append(cpu)
        del sim
    med = {n: statistics.median(v) for n, v in times.items()}
    cpu = {n: statistics.median(v) for n, v in cpus.items()}
    whole = cpu["whole"]
    print(f"machine: {json.dumps(c.machine())}")
    print(f"capture: {args.model} model, N={args.dp}, {args.iters} iterations, {wire / 1e6:.1f} MB of wire, "
          f"medians of {args.repeats} interleaved rounds")
    print("| decode | wall s | cpu s | placed MB | cpu vs whole | placed vs whole |\n|---|---:|---:|---:|---:|---:|")
    for n in rows:
        print(f"| {n} | {med[n]:.3f} | {cpu[n]:.3f} | {placed[n] / 1e6:.2f} | "
              f"{cpu[n] / whole:.2f} | {placed[n] / placed['whole']:.2f} |")
    shared = {}
    for k in ks:
        mean_part = statistics.mean(cpu[f"part {i} of {k}"] for i in range(k))
        shared[k] = (k * mean_part / whole - 1) / (k - 1)
        print(f"K={k}: mean part time {mean_part / whole:.2f} of the whole decode; shared fraction s = {shared[k]:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"wire_bytes": wire, "median_s": med, "median_cpu_s": cpu, "placed_bytes": placed, "shared_fraction": shared}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
