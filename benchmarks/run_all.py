"""Run the benchmarks, each in its own process (so one state's memory is gone before the next), and collect the tables.

  python benchmarks/run_all.py [--gb 1.3] [--repeats 3] [--out-dir bench-results] [--only p3,p5,readback]
  python benchmarks/run_all.py --quick            # small sizes, one round: ~1-2 min on 2 cores
  flowcheck bench --quick --only p3               # the same from the CLI, ratio table on stdout

Each script also runs alone (`python benchmarks/bench_local_snapshot.py --help`) and is importable
(`main(argv) -> dict`).  Results: <out-dir>/<name>.json, <out-dir>/summary.md (every script's own
tables) and the ratio table (method, seconds, ratio vs baseline, goal, met?) on stdout.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Bench:
    script: str
    what: str
    sized: bool = True  # takes the shared --gb / --repeats / --warm
    quick: tuple[str, ...] = ()  # extra arguments of the --quick preset


BENCHES = {
    "p3": Bench("bench_local_snapshot.py", "local snapshot (write + fsync)"),
    "p5": Bench("bench_object_upload.py", "promotion to object storage and read-back (moto; SeaweedFS when installed)"),
    "readback": Bench("bench_readback.py", "read-back, whole and 1/8 slices", quick=("--no-s3",)),
    "p6": Bench("bench_restore.py", "restore into Megatron TP2/PP2", quick=("--no-s3",)),
    "p4": Bench("bench_push.py", "push: blocking per save, slowdown; P7 node RSS",
                quick=("--iters", "2", "--warmup", "1", "--layers", "2", "--p7-iters", "2", "--snapshots", "1",
                       "--pairs", "3")),
    "rss": Bench("bench_node_rss.py", "node RSS at --gb of state: pushes every iteration + back-to-back snapshots",
                 quick=("--iters", "2")),
    "mirror": Bench("bench_mirror.py", "mirror capture: decode vs memcpy, replica AdamW vs torch, e2e", sized=False,
                    quick=("--only", "a,b", "--grad-mb", "2", "--channels", "1", "--update-mparams", "2",
                           "--update-threads", "1")),
    "mirror_loss": Bench("bench_mirror_loss.py", "unrecoverable iterations vs mirror loss", sized=False,
                         quick=("--loss", "0.001,0.01", "--iters", "20", "--chunk", "20")),
}
DEFAULT = ("p3", "p5", "readback", "p6", "p4")  # mirror and mirror_loss run when named (minutes each)
QUICK = ("p3", "p5", "readback", "p6")  # ~1-2 min on 2 cores; p4 (~1 min more) and the mirror ones when named
QUICK_GB = 0.05


def parse_only(text: str | None, quick: bool) -> list[str]:
    keys = [k.strip() for k in (text or "").split(",") if k.strip()] or list(QUICK if quick else DEFAULT)
    unknown = [k for k in keys if k not in BENCHES]
    if unknown:
        raise ValueError(f"--only: unknown benchmark(s) {unknown}; expected some of {list(BENCHES)}")
    return keys


def bench_argv(key: str, out: str, *, gb: float | None, repeats: int | None, quick: bool, out_dir: str) -> list[str]:
    """The script's command line: shared sizes (the quick preset's unless given), the preset's own extras."""
    b = BENCHES[key]
    argv = [sys.executable, os.path.join(HERE, b.script)]
    if repeats is None and quick:
        repeats = 1
    if b.sized:
        gb = gb if gb is not None else (QUICK_GB if quick else 1.3)
        argv += ["--gb", str(gb), "--repeats", str(repeats or 3)] + (["--warm"] if quick else [])
    elif repeats is not None and key == "mirror":
        argv += ["--repeats", str(repeats)]
    if quick:
        argv += list(b.quick)
        if key == "mirror_loss":
            argv += ["--png", os.path.join(out_dir, "mirror_loss.png")]
    return argv + ["--out", out]


def run(keys: list[str], out_dir: str, *, gb: float | None = None, repeats: int | None = None, quick: bool = False,
        log_to_files: bool = False, on_start: Callable[[str, list[str]], None] | None = None,
        on_done: Callable[[str, int, float], None] | None = None) -> dict[str, dict | None]:
    """Run each benchmark in its own process; their JSON results by key (None: the script failed)."""
    os.makedirs(out_dir, exist_ok=True)
    results: dict[str, dict | None] = {}
    for key in keys:
        out = os.path.join(out_dir, f"{key}.json")
        if os.path.exists(out):
            os.remove(out)  # never report a previous run's numbers as this one's
        cmd = bench_argv(key, out, gb=gb, repeats=repeats, quick=quick, out_dir=out_dir)
        if on_start:
            on_start(key, cmd)
        t0 = time.perf_counter()
        if log_to_files:
            with open(os.path.join(out_dir, f"{key}.log"), "wb") as log:
                rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        else:
            rc = subprocess.call(cmd)
        if on_done:
            on_done(key, rc, time.perf_counter() - t0)
        results[key] = None
        if rc == 0 and os.path.exists(out):
            with open(out) as f:
                results[key] = json.load(f)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write("\n\n".join(r["markdown"] for r in results.values() if r and r.get("markdown")) + "\n")
    return results


# ---- the ratio table ---------------------------------------------------------------------
def _num(v) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def goal_met(goal: str | None, value: float | None) -> bool | None:
    """'>= 0.8x', '<= 3%', '<= 0.05x', '= 0' against a value (a fraction for '%'); None when there is no goal."""
    m = re.fullmatch(r"\s*(>=|<=|=|≥|≤)\s*([0-9.eE+-]+)\s*(x|%)?\s*", goal or "")
    if not m or value is None:
        return None
    op, bound, unit = m.group(1), float(m.group(2)), m.group(3)
    v = value * 100 if unit == "%" else value
    return {">=": v >= bound, "≥": v >= bound, "<=": v <= bound, "≤": v <= bound, "=": v == bound}[op]


def _row(bench: str, method: str, seconds=None, ratio=None, goal: str | None = None, baseline: bool = False,
         value=None, error: str | None = None) -> dict:
    ratio, seconds = _num(ratio), _num(seconds)
    goal = None if goal in (None, "-") else goal
    value = _num(value) if value is not None else ratio
    return {"bench": bench, "method": method, "seconds": seconds, "ratio": ratio, "value": value, "baseline": baseline,
            "goal": goal, "met": goal_met(goal, value), "error": error}


def _std_rows(bench: str, rows: list[dict], goal: str | None = None, goal_on: Callable[[dict], bool] | None = None):
    return [_row(bench, r["method"], r.get("median_s"), r.get("ratio"), goal if goal_on and goal_on(r) else None,
                 bool(r.get("baseline")), error=r.get("error")) for r in rows]


def ratio_rows(key: str, result: dict | None) -> list[dict]:
    """One benchmark's JSON result as rows of the ratio table."""
    if result is None:
        return [_row(key, "FAILED (see its log)", error="failed")]
    if key == "p3" and "goals" in result:  # flowcheck against the one-file write and the fastest alternative
        return _std_rows(key, result["rows"]) + [_row(key, g["comparison"], None, g["ratio"], g["goal"])
                                                 for g in result["goals"]]
    if key == "p5" and "goals" in result:  # per server: promotion and read-back, each against boto3
        rows = [r for srv in result["servers"].values() for r in srv["upload"] + srv["read"]]
        return _std_rows(key, rows) + [_row(key, g["comparison"], None, g["ratio"], g["goal"]) for g in result["goals"]]
    if key in ("p3", "p5"):  # the goal applies to flowcheck's first (uncompressed) row
        first = next((r["method"] for r in result["rows"] if "flowcheck" in r["method"]), None)
        return _std_rows(key, result["rows"], f">= {result['goal']}x", lambda r: r["method"] == first)
    if key == "readback":
        return _std_rows(key, result["rows"]) + [_row(key, g["comparison"], None, g["ratio"], g["goal"])
                                                 for g in result.get("goals", [])]
    if key == "p6":
        return _std_rows(key, result["rows"]) + [
            _row(key, g["comparison"], None, g["ratio"], g["goal"]) for g in result.get("ratios", [])]
    if key == "p4":
        base = result["rows"][0]["iter_s_median"] if result["rows"] else None
        rows = [_row(key, f"{r['method']} (s/iteration)", r["iter_s_median"],
                     base / r["iter_s_median"] if base and r.get("iter_s_median") else None, baseline=i == 0)
                for i, r in enumerate(result["rows"])]
        return rows + [_row(key, g["comparison"], None, None if "slowdown" in g["comparison"] else g["value"],
                            g["goal"], value=g["value"]) for g in result.get("goals", [])]
    if key == "mirror":
        out = []
        for r in result.get("decode", {}).get("rows", []):
            fc = r["method"].startswith("flowcheck decode")
            out.append(_row("mirror (a)", r["method"], r["median_s"], r["ratio_vs_memcpy"], ">= 0.5x" if fc else None,
                            r["baseline"]))
        for table in result.get("update", {}).get("tables", {}).values():
            out += [_row("mirror (b)", r["method"], r["median_s"], r["ratio"],
                         ">= 1.0x" if r["method"].startswith("flowcheck") else None, r["baseline"]) for r in table["rows"]]
        if "e2e" in result:
            e = result["e2e"]
            s = max(e["median"]["decode_s"], e["median"]["update_s"]) * e["scale_to_1_3b"]
            out.append(_row("mirror (c)", "s/iteration at GPT-3 1.3B, 2 cores (ratio: paper's 6 s ÷ this)", s, 6.0 / s))
        return out
    if key == "rss":
        return [_row(key, f"node peak RSS ÷ state ({result['state_bytes'] / 1e9:.1f} GB; pushes + snapshots)",
                     value=result.get("ratio"), goal=f"<= {result['goal']}x"),
                _row(key, "node state read back from the local tier bit for bit", value=int(bool(result.get("verified"))),
                     goal="= 1")]
    if key == "mirror_loss":
        return [_row(key, "silently wrong iterations (all p, m)", value=result["silently_wrong"], goal="= 0")]
    return []


def format_table(rows: list[dict]) -> str:
    def fmt(v, spec: str) -> str:
        return "–" if v is None else format(v, spec)

    out = ["| bench | method | seconds | ratio vs baseline | goal | met? |", "|---|---|---:|---:|---|---|"]
    for r in rows:
        met = {True: "yes", False: "**no**", None: ""}[r["met"]]
        if r["baseline"]:
            ratio = "baseline"
        elif r["ratio"] is not None:
            ratio = f"{r['ratio']:.2f}x"
        elif r["value"] is not None:  # a goal on something else than a ratio: a slowdown, a count
            ratio = f"{100 * r['value']:+.1f}%" if (r["goal"] or "").endswith("%") else f"{r['value']:g}"
        else:
            ratio = "–"
        method = r["method"] + (f" — FAILED: {r['error']}" if r["error"] and r["error"] != "failed" else "")
        out.append(f"| {r['bench']} | {method} | {fmt(r['seconds'], '.3f')} | {ratio} | {r['goal'] or ''} | {met} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=None, help=f"state size in GB (default 1.3; --quick: {QUICK_GB})")
    p.add_argument("--repeats", type=int, default=None, help="rounds per alternative (default 3; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="small sizes, one round, warm cache (~1-2 min on 2 cores)")
    p.add_argument("--out-dir", default="bench-results")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {list(BENCHES)} "
                   f"(default {','.join(DEFAULT)}; --quick: {','.join(QUICK)})")
    args = p.parse_args(argv)
    keys = parse_only(args.only, args.quick)
    results = run(keys, args.out_dir, gb=args.gb, repeats=args.repeats, quick=args.quick,
                  on_start=lambda k, cmd: print(f"==> {' '.join(cmd)}", flush=True),
                  on_done=lambda k, rc, s: print(f"==> {k}: exit {rc} after {s:.0f} s", flush=True))
    rows = [r for k in keys for r in ratio_rows(k, results[k])]
    print("\n" + format_table(rows))
    failed = [k for k, r in results.items() if r is None]
    print(f"tables: {os.path.join(args.out_dir, 'summary.md')}" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
