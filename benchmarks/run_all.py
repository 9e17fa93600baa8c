"""Run every benchmark, each in its own process (so one state's memory is gone before the next), and collect the tables.

  python benchmarks/run_all.py [--gb 1.3] [--repeats 3] [--out-dir bench-results] [--only p3,p5,readback]

Each script also runs alone (`python benchmarks/bench_local_snapshot.py --help`) and is importable
(`main(argv) -> dict`).  Results: <out-dir>/<name>.json and <out-dir>/summary.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHES = {
    "p3": "bench_local_snapshot.py",
    "p5": "bench_object_upload.py",
    "readback": "bench_readback.py",
    "p6": "bench_restore.py",
    "p4": "bench_push.py",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out-dir", default="bench-results")
    p.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated subset of {sorted(BENCHES)}")
    args = p.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    failed = []
    sections = []
    for key in [k.strip() for k in args.only.split(",") if k.strip()]:
        script = BENCHES[key]
        out = os.path.join(args.out_dir, f"{key}.json")
        cmd = [sys.executable, os.path.join(HERE, script), "--gb", str(args.gb), "--repeats", str(args.repeats), "--out", out]
        print(f"==> {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd)
        print(f"==> {key}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc != 0 or not os.path.exists(out):
            failed.append(key)
            continue
        with open(out) as f:
            sections.append(json.load(f)["markdown"])
    summary = os.path.join(args.out_dir, "summary.md")
    with open(summary, "w") as f:
        f.write("\n\n".join(sections) + "\n")
    print(f"tables: {summary}" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
