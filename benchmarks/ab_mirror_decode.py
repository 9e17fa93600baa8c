"""Mirror decode, before vs after: the process CPU of one decode by two source trees, on the same bytes, alternated.

bench_mirror.py (a) compares decode with memcpy in one run; this compares two versions of decode with each other,
which is what a per-core change has to show on a shared box whose speed drifts by ~10% over minutes.  Each round
runs one child process per tree (the tree's own flowcheck, native modules and simulator, via PYTHONPATH); a child
builds the captures, times ``--decodes`` decodes of each (process CPU, and memcpy of the same bytes beside them),
checks every allreduce bit for bit and prints its medians.  The trees alternate, so drift hits both.

    # the tree to compare with, built where it lies
    mkdir -p /tmp/before && git archive 5cb57c8 | tar -x -C /tmp/before
    (cd /tmp/before && python setup.py build_ext --inplace)
    python benchmarks/ab_mirror_decode.py --before /tmp/before --after . --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MIB = 1 << 20
# (name, fp32 elements per allreduce): one DDP-sized bucket, and bench_mirror (a)'s input (32 MiB in two buckets)
INPUTS = (("one 32 MiB allreduce", [32 * MIB // 4]), ("two 16 MiB allreduces (bench_mirror (a))", [16 * MIB // 4] * 2))


def child(tree: str, decodes: int, workers: int = 1) -> dict:
    """In a process whose PYTHONPATH starts at ``tree``: decode CPU and memcpy CPU medians per input."""
    import numpy as np

    import flowcheck

    if not os.path.realpath(flowcheck.__file__).startswith(os.path.realpath(tree)):
        raise SystemExit(f"flowcheck imported from {flowcheck.__file__}, not from {tree}: is PYTHONPATH set?")
    sys.path.insert(0, os.path.join(tree, "benchmarks"))
    import bench_mirror as bm

    out = {}
    for name, elements in INPUTS:
        tr = bm.build_traffic(elements, 1, seed=1)
        src = np.frombuffer(tr.frames.buf, np.uint8)
        dst = np.empty_like(src)
        dst.fill(1)  # memcpy measures copying, not page faults
        cpu, copy = [], []
        for _ in range(decodes):
            c0 = time.process_time()
            np.copyto(dst, src)
            copy.append(time.process_time() - c0)
            c0 = time.process_time()
            ars = bm.decode_all(tr, workers)
            cpu.append(time.process_time() - c0)
        if why := bm.verify(tr, ars):
            raise SystemExit(f"{tree}: {name}: {why}")
        out[name] = {"decode_cpu_s": statistics.median(cpu), "memcpy_cpu_s": statistics.median(copy),
                     "wire_bytes": tr.wire_bytes}
        del tr, ars
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", help="source tree (its native modules built in place); required")
    p.add_argument("--after", default=".", help="source tree (default: this checkout)")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two trees (default 3)")
    p.add_argument("--decodes", type=int, default=9, help="decodes per input per child; medians (default 9)")
    p.add_argument("--workers", type=int, default=1,
                   help="decode workers (threads for parse, reassembly and merge; default 1): the CPU is every thread's")
    p.add_argument("--out", help="write the results as JSON to this file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.decodes, args.workers)))
        return {}
    if not args.before:
        p.error("--before TREE is required")
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for side, tree in trees.items():
            # FLOWCHECK_TREE: for a sitecustomize that maps flowcheck to a tree (a worktree beside an editable install)
            env = {**os.environ, "PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   "FLOWCHECK_TREE": tree}
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", tree, "--decodes",
                                   str(args.decodes), "--workers", str(args.workers)], env=env, capture_output=True,
                                  text=True, check=False)
            if proc.returncode:
                raise SystemExit(f"{side} ({tree}) failed:\n{proc.stderr[-3000:]}")
            runs[side].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{args.rounds} {side}: " + ", ".join(
                f"{k}: {v['decode_cpu_s']:.4f} s" for k, v in runs[side][-1].items()), flush=True)
    lines = ["| input | before: decode CPU s per round | after | after / before (medians) | ratio vs memcpy, "
             "before → after | GB of wire per core-second, before → after |", "|---|---|---|---:|---|---|"]
    summary = {}
    for name, _ in INPUTS:
        b = [x[name]["decode_cpu_s"] for x in runs["before"]]
        a = [x[name]["decode_cpu_s"] for x in runs["after"]]
        copy = statistics.median([x[name]["memcpy_cpu_s"] for side in runs.values() for x in side])
        wire = runs["after"][0][name]["wire_bytes"]
        mb, ma = statistics.median(b), statistics.median(a)
        summary[name] = {"before_s": b, "after_s": a, "ratio": ma / mb, "memcpy_s": copy, "wire_bytes": wire}
        lines.append(f"| {name} | {', '.join(f'{x:.4f}' for x in b)} | {', '.join(f'{x:.4f}' for x in a)} | "
                     f"**{ma / mb:.2f}** | {copy / mb:.3f}x → {copy / ma:.3f}x | "
                     f"{wire / 1e9 / mb:.2f} → {wire / 1e9 / ma:.2f} |")
    print("\n".join(lines))
    result = {"trees": trees, "runs": runs, "summary": summary, "markdown": "\n".join(lines)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
