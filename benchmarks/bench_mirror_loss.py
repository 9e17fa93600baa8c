"""Mirror-port packet loss: measured unrecoverable iterations vs FlowCheck's Eq. 2, and silently wrong ones (must be 0).

For every loss probability p (--loss) the simulator trains the tiny model on an N-rank ring (--dp, LL, fp32, MTU 1024)
with the outbound streams of ring positions 0, 1, 2 mirrored, each port dropping every frame independently with
probability p: `simulate(SimOptions(dp=N, iters=..., mirror="0:out,1:out,2:out", loss=p, seed=...))`, in tasks of
--chunk iterations with distinct seeds, --jobs processes at once. Each task's capture is decoded three times, with the
pcaps of the first m = 1, 2, 3 ports (ports drop independently, so the first m ports of a 3-port run are an m-port run).

An iteration fails when any of its allreduces is missing from the decoder's output or incomplete. It is silently wrong
when the decoder calls all of its allreduces complete but one's sha256 differs from truth/allreduces.json (allreduces
are matched to the truth by (iteration, bucket), the labels the decoder gives them); the allreduce count in brackets
also counts complete-but-wrong allreduces inside iterations that failed for another reason. Failed iterations with a
conflict (two copies of an element differ, which the wire never does: some stream was matched at the wrong sends) or
an allreduce the decoder never found are counted apart ("misaligned / not found"): Eq. 2 does not model them.

Prediction, Eq. 2 of the paper: P(fail) = 1 - (1 - p^(M-1))^(M*K/N) * (1 - p^M)^((N-M)*K/N). Position i's outbound
stream carries the final (allgather) sends of every chunk but chunk i+1, so with M consecutive positions mirrored,
M chunks are seen M-1 times and N-M chunks M times; an iteration is lost when every copy of one packet is.
K = packets carrying final-chunk data in one iteration, one copy of each chunk: measured on a lossless run of the same
configuration by decoding all three streams and summing, over the distinct final sends (allreduce, loop, chunk,
channel) with data, last PSN - first PSN + 1 of one copy. The "exact" column uses the same decode: for every final
send its packet count n and its number of copies c among the first m streams, P = 1 - prod (1 - p^c)^n.
Intervals are Wilson 95%. Iteration 1 (DDP's single bucket) has its own K; predictions average over the iterations.

Low loss (--resample R): p ≤ 1e-4 needs 10^4–10^6 iterations to see unrecoverable ones, too many to train. Then one
lossless R-iteration run is simulated once and every trial drops each frame of each port's pcap independently with
probability p (a seeded binomial draw of how many, then which) before decoding the same 1..3 ports; a trial in which no
frame of the first m ports was dropped is the lossless decode (verified exact), so only trials with drops are decoded.
The drop process is the simulator's (independent per frame and port); reordering and duplication are not injected.
Iterations per p: --target events (m = 2, predicted by the exact-count model) worth, between --min-iters and
--max-iters.

  python benchmarks/bench_mirror_loss.py --out /tmp/mirror-loss.json
  python benchmarks/bench_mirror_loss.py --loss 1e-6,1e-5,1e-4,1e-3,1e-2 --resample 20 --out /tmp/loss-rs.json
  python benchmarks/bench_mirror_loss.py --loss 1e-3,1e-2 --iters 40 --chunk 20   # smoke run
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

SCRIPT = "bench_mirror_loss.py"
DEFAULT_LOSS = "1e-4,3e-4,1e-3,3e-3,1e-2"
PORTS = 3  # ring positions 0..2 mirrored outbound; m = 1..PORTS of them decoded


# ---- prediction -----------------------------------------------------------------------
def eq2(p: float, m: int, n: int, k: float) -> float:
    """FlowCheck's Eq. 2: probability that one iteration cannot be recovered."""
    return 1.0 - (1.0 - p ** (m - 1)) ** (m * k / n) * (1.0 - p ** m) ** ((n - m) * k / n)


def exact(p: float, sends: list[tuple[int, int]]) -> float:
    """1 - prod over final sends of (1 - p^copies)^packets."""
    log_ok = 0.0
    for copies, packets in sends:
        q = p ** copies
        if q >= 1.0:
            return 1.0
        log_ok += packets * math.log1p(-q)
    return 1.0 - math.exp(log_ok)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    ph = k / n
    d = 1 + z * z / n
    mid = (ph + z * z / (2 * n)) / d
    half = z * math.sqrt(ph * (1 - ph) / n + z * z / (4 * n * n)) / d
    return max(0.0, mid - half), min(1.0, mid + half)


# ---- simulate + decode ------------------------------------------------------------------
def decode_ports(result, m: int) -> list:
    from flowcheck.capture.mirror.decode import Decoded, decode, read_all
    from flowcheck.capture.mirror.job import load_job

    job = load_job(result.job_path)
    frames = read_all([result.pcaps[f"{r}:out"] for r in range(m)])
    return list(decode(job, frames, Decoded()))


def final_sends(allreduces: list) -> dict[int, list[tuple[int, dict[int, int]]]]:
    """iteration -> [(packets of one copy, {ring position: copies}) per final send with data] (lossless decode)."""
    per: dict[tuple[int, int, int, int, int], dict] = {}
    for a in allreduces:
        for s in a.sources:
            if s.get("lost") or not s.get("elements_seen"):
                continue
            key = (a.iteration, a.index, s["loop"], s["chunk"], s["channel"])
            e = per.setdefault(key, {"packets": s["psn"][1] - s["psn"][0] + 1, "positions": Counter()})
            e["positions"][s["position"]] += 1
    out: dict[int, list] = defaultdict(list)
    for (it, *_), e in per.items():
        out[it].append((e["packets"], dict(e["positions"])))
    return out


def derive_k(dp: int, seed: int, work: str) -> dict[str, Any]:
    """K and the per-send copy counts from a lossless 3-iteration run (iteration 1 and the steady plan)."""
    from flowcheck.simulate import SimOptions, simulate

    out = os.path.join(work, "lossless")
    res = simulate(SimOptions(out=out, dp=dp, iters=3, mirror=_mirror_text(), seed=seed))
    ars = decode_ports(res, PORTS)
    bad = [a.index for a in ars if not a.complete]
    if bad or len(ars) != len(res.allreduces):
        raise RuntimeError(f"lossless run did not decode completely: {len(ars)} of {len(res.allreduces)}, incomplete {bad}")
    sends = final_sends(ars)
    shutil.rmtree(out, ignore_errors=True)

    def per_m(it: int) -> dict[int, list[tuple[int, int]]]:
        return {m: [(sum(v for pos, v in copies.items() if pos < m), n) for n, copies in sends[it]] for m in range(1, PORTS + 1)}

    return {"K_first": sum(n for n, _ in sends[1]), "K_steady": sum(n for n, _ in sends[2]),
            "sends_first": per_m(1), "sends_steady": per_m(2),
            "final_sends_steady": len(sends[2]), "allreduces_per_iteration": sum(1 for a in ars if a.iteration == 2)}


def _mirror_text() -> str:
    return ",".join(f"{r}:out" for r in range(PORTS))


def run_task(task: dict) -> dict[str, Any]:
    """One simulate run (loss p, a seed) decoded with m = 1..PORTS ports: failed and silently wrong iterations."""
    from flowcheck.simulate import SimOptions, simulate

    out = tempfile.mkdtemp(prefix="fc-loss-", dir=task["dir"])
    t0 = time.perf_counter()
    try:
        res = simulate(SimOptions(out=out, dp=task["dp"], iters=task["iters"], mirror=_mirror_text(), loss=task["p"],
                                  seed=task["seed"]))
        sim_s = time.perf_counter() - t0
        truth = {(r["iteration"], r["bucket"]): r["sha256"] for r in res.allreduces}
        iterations = sorted({it for it, _ in truth})
        per_m = {}
        for m in range(1, PORTS + 1):
            try:
                per_m[m] = evaluate(decode_ports(res, m), truth, iterations)
            except Exception as e:  # noqa: BLE001 - a decoder failure counts every iteration of the task as failed
                per_m[m] = evaluate([], truth, iterations, f"{type(e).__name__}: {e}")
        dropped = {k: v["dropped"] for k, v in res.injected["pcaps"].items()}
        return {"p": task["p"], "seed": task["seed"], "iterations": len(iterations), "first_iterations": 1,
                "per_m": per_m, "dropped": dropped, "sim_s": sim_s, "s": time.perf_counter() - t0}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def evaluate(ars: list, truth: dict, iterations: list[int], error: str | None = None) -> dict[str, Any]:
    """failed / misaligned / silently wrong iterations of one decode against the truth (iteration, bucket) -> sha256."""
    got = {(a.iteration, a.bucket): a for a in ars}
    failed, misaligned, wrong, wrong_ar = [], [], [], 0
    for it in iterations:
        mine = [got.get(k) for k in truth if k[0] == it]
        ok = all(a is not None and a.complete for a in mine)
        bad = [a for a in mine if a is not None and a.complete
               and hashlib.sha256(a.data.tobytes()).hexdigest() != truth[(a.iteration, a.bucket)]]
        wrong_ar += len(bad)
        if not ok:
            failed.append(it)
            # copies of one element never differ on the wire: a conflict (or an allreduce not found at all)
            # means the decoder matched some stream at the wrong sends, which Eq. 2 does not model
            if any(a is None or a.conflicts for a in mine):
                misaligned.append(it)
        elif bad:
            wrong.append(it)
    return {"failed": failed, "misaligned": misaligned, "silently_wrong": wrong, "wrong_allreduces": wrong_ar,
            "error": error}


class Resampler:
    """One lossless run's per-port frames; trials drop frames independently per port and decode the first m ports."""

    def __init__(self, dp: int, iters: int, seed: int, work: str) -> None:
        from flowcheck.capture.mirror.job import load_job
        from flowcheck.capture.mirror.pcap import read_capture
        from flowcheck.simulate import SimOptions, simulate

        res = simulate(SimOptions(out=os.path.join(work, "resample"), dp=dp, iters=iters, mirror=_mirror_text(),
                                  seed=seed))
        self.job = load_job(res.job_path)
        self.ports = [read_capture(res.pcaps[f"{r}:out"]) for r in range(PORTS)]
        self.truth = {(r["iteration"], r["bucket"]): r["sha256"] for r in res.allreduces}
        self.iterations = sorted({it for it, _ in self.truth})
        self.lossless = {m: evaluate(self._decode(m, None), self.truth, self.iterations) for m in range(1, PORTS + 1)}
        if self.lossless[PORTS]["failed"] or any(v["silently_wrong"] for v in self.lossless.values()):
            raise RuntimeError(f"the lossless resample run does not decode exactly with {PORTS} ports: {self.lossless}")

    def _decode(self, m: int, keep: list | None) -> list:
        import numpy as np

        from flowcheck.capture.mirror.decode import Decoded, decode
        from flowcheck.capture.mirror.pcap import Frames

        parts = self.ports[:m]
        masks = keep[:m] if keep is not None else [np.ones(len(f), bool) for f in parts]
        bufs = [np.asarray(f.buf) for f in parts]
        shifts = np.cumsum([0] + [b.nbytes for b in bufs[:-1]])
        frames = Frames(buf=np.concatenate(bufs),
                        offsets=np.concatenate([f.offsets[k] + s for f, k, s in zip(parts, masks, shifts)]),
                        lengths=np.concatenate([f.lengths[k] for f, k in zip(parts, masks)]),
                        ts_ns=np.concatenate([f.ts_ns[k] for f, k in zip(parts, masks)]), source="resample")
        return list(decode(self.job, frames, Decoded()))

    def trial(self, p: float, rng) -> tuple[dict[int, dict], list[int]]:
        """Per m: the evaluation of one trial; and the frames dropped per port."""
        import numpy as np

        keep, dropped = [], []
        for f in self.ports:
            n = int(rng.binomial(len(f), p))
            mask = np.ones(len(f), bool)
            if n:
                mask[rng.choice(len(f), size=n, replace=False)] = False
            keep.append(mask)
            dropped.append(n)
        out = {}
        for m in range(1, PORTS + 1):
            if not any(dropped[:m]):
                out[m] = self.lossless[m]
                continue
            try:
                out[m] = evaluate(self._decode(m, keep), self.truth, self.iterations)
            except Exception as e:  # noqa: BLE001 - a decoder failure counts every iteration of the trial as failed
                out[m] = evaluate([], self.truth, self.iterations, f"{type(e).__name__}: {e}")
        return out, dropped


def resample_task(task: dict) -> list[dict[str, Any]]:
    """Trials of one p on a process-local Resampler (built once per process)."""
    import numpy as np

    global _RESAMPLER
    if _RESAMPLER is None or _RESAMPLER[0] != task["key"]:
        _RESAMPLER = (task["key"], Resampler(task["dp"], task["iters"], task["seed"], task["dir"]))
    rs = _RESAMPLER[1]
    rng = np.random.default_rng([task["seed"], int(round(-math.log10(task["p"]) * 1000)), task["block"]])
    out = []
    for _ in range(task["trials"]):
        t0 = time.perf_counter()
        per_m, dropped = rs.trial(task["p"], rng)
        out.append({"p": task["p"], "seed": task["seed"], "iterations": len(rs.iterations), "first_iterations": 1,
                    "per_m": per_m, "dropped": dropped, "sim_s": 0.0, "s": time.perf_counter() - t0})
    return out


_RESAMPLER = None


# ---- report ----------------------------------------------------------------------------------
def summarise(results: list[dict], kinfo: dict, dp: int, losses: list[float]) -> list[dict]:
    rows = []
    for p in losses:
        mine = [r for r in results if r["p"] == p]
        n_it = sum(r["iterations"] for r in mine)
        n_first = sum(r["first_iterations"] for r in mine)
        for m in range(1, PORTS + 1):
            per = [r["per_m"][m] for r in mine]
            fails = sum(len(x["failed"]) for x in per)
            mis = sum(len(x["misaligned"]) for x in per)
            w = (n_first, n_it - n_first)
            pred = (w[0] * eq2(p, m, dp, kinfo["K_first"]) + w[1] * eq2(p, m, dp, kinfo["K_steady"])) / max(1, n_it)
            pex = (w[0] * exact(p, kinfo["sends_first"][m]) + w[1] * exact(p, kinfo["sends_steady"][m])) / max(1, n_it)
            lo, hi = wilson(fails, n_it)
            hlo, hhi = wilson(fails - mis, n_it - mis)
            rows.append({
                "p": p, "m": m, "iterations": n_it, "failed": fails, "measured": fails / max(1, n_it), "wilson95": [lo, hi],
                "misaligned": mis, "runs_misaligned": sum(1 for x in per if x["misaligned"]),
                "first_misaligned": [x["misaligned"][0] for x in per if x["misaligned"]],
                "holes_only": (fails - mis) / max(1, n_it - mis), "holes_wilson95": [hlo, hhi],
                "eq2": pred, "exact": pex, "eq2_in_ci": lo <= pred <= hi, "exact_in_holes_ci": hlo <= pex <= hhi,
                "silently_wrong_iterations": sum(len(x["silently_wrong"]) for x in per),
                "silently_wrong_allreduces": sum(x["wrong_allreduces"] for x in per),
                "errors": [x["error"] for x in per if x["error"]]})
    return rows


def markdown(rows: list[dict]) -> str:
    md = [("| p | m | iterations | failed | measured P(fail) [Wilson 95%] | of which misaligned / not found (runs) | "
           "P(fail) without those [Wilson 95%] | Eq. 2 | exact-count model | silently wrong iterations (allreduces) |"),
          "|---:|---:|---:|---:|---|---|---|---:|---:|---:|"]
    for r in rows:
        lo, hi = r["wilson95"]
        hlo, hhi = r["holes_wilson95"]
        err = f" ({len(r['errors'])} decode errors)" if r["errors"] else ""
        mis = f"{r['misaligned']} ({r['runs_misaligned']})" if r["misaligned"] else "0"
        md.append(f"| {r['p']:g} | {r['m']} | {r['iterations']} | {r['failed']} | {r['measured']:.3g} "
                  f"[{lo:.3g}, {hi:.3g}] | {mis} | {r['holes_only']:.3g} [{hlo:.3g}, {hhi:.3g}] | {r['eq2']:.3g} | "
                  f"{r['exact']:.3g} | {r['silently_wrong_iterations']} ({r['silently_wrong_allreduces']}){err} |")
    return "\n".join(md)


def plot(rows: list[dict], kinfo: dict, dp: int, path: str) -> str:
    """A PNG of measured vs predicted (log-x); '' when matplotlib is not importable."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return ""
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=110)
    ps = sorted({r["p"] for r in rows})
    grid = np.logspace(math.log10(ps[0]) - 0.3, math.log10(ps[-1]) + 0.3, 100)
    floor = 1e-5
    for m, color in zip(range(1, PORTS + 1), ("tab:red", "tab:blue", "tab:green")):
        ax.plot(grid, [max(floor, eq2(p, m, dp, kinfo["K_steady"])) for p in grid], color=color, lw=1,
                label=f"Eq. 2, M={m} (K={kinfo['K_steady']})")
        mine = [r for r in rows if r["m"] == m]
        x = [r["p"] for r in mine]
        y = [max(floor, r["measured"]) for r in mine]
        lo = [max(floor, r["wilson95"][0]) for r in mine]
        hi = [max(floor, r["wilson95"][1]) for r in mine]
        yerr = np.maximum(0.0, [np.subtract(y, lo), np.subtract(hi, y)])  # Wilson's bounds can miss p-hat by an ulp
        ax.errorbar(x, y, yerr=yerr, fmt="o", color=color, ms=4, capsize=3,
                    label=f"measured, M={m} (Wilson 95%)")
        ax.plot([r["p"] * 1.08 for r in mine], [max(floor, r["holes_only"]) for r in mine], "D", mfc="none", color=color,
                ms=4, label=f"measured without misaligned iterations, M={m}")
        ax.plot(grid, [max(floor, exact(p, kinfo["sends_steady"][m])) for p in grid], color=color, lw=1, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(floor * 0.8, 1.5)
    ax.set_xlabel("per-frame loss probability p at each mirror port")
    ax.set_ylabel(f"P(iteration unrecoverable); 0 drawn at {floor:g}")
    ax.set_title(f"Mirror loss: measured vs Eq. 2 (N={dp}, tiny model, LL)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, loc="lower right", title="dotted: exact-count model", title_fontsize=6)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loss", default=DEFAULT_LOSS, help=f"loss probabilities, comma-separated (default {DEFAULT_LOSS})")
    p.add_argument("--dp", type=int, default=8, help="ranks in the ring, N (default 8)")
    p.add_argument("--iters", type=int, default=500, help="iterations per loss probability (default 500: ~10 min on 2 cores)")
    p.add_argument("--chunk", type=int, default=100, help="iterations per simulator run (default 100)")
    p.add_argument("--jobs", type=int, default=2, help="simulator runs at once, one process each (default 2)")
    p.add_argument("--seed", type=int, default=1, help="first seed (default 1)")
    p.add_argument("--png", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "mirror_loss.png"),
                   help="plot path, written when matplotlib is importable (default benchmarks/results/mirror_loss.png)")
    p.add_argument("--dir", help="work directory base (default $FLOWCHECK_BENCH_DIR or /tmp)")
    p.add_argument("--out", help="write the results as JSON to this file")
    p.add_argument("--resample", type=int, default=0, metavar="R",
                   help="resample drops on one lossless R-iteration run instead of simulating each run (see above)")
    p.add_argument("--target", type=float, default=20, help="--resample: predicted m=2 failures to aim for per p (default 20)")
    p.add_argument("--min-iters", type=int, default=500, help="--resample: fewest iterations per p (default 500)")
    p.add_argument("--max-iters", type=int, default=100000, help="--resample: most iterations per p (default 100000)")
    args = p.parse_args(argv)
    cmd = c.command(SCRIPT, argv)
    losses = [float(x) for x in args.loss.split(",") if x.strip()]
    started = time.perf_counter()
    work = c.workdir("fc-bench-loss-", args.dir)
    try:
        kinfo = derive_k(args.dp, args.seed, work)
        print(f"K = {kinfo['K_steady']} packets of final-chunk data per steady iteration ({kinfo['final_sends_steady']} "
              f"final sends in {kinfo['allreduces_per_iteration']} allreduces), {kinfo['K_first']} in iteration 1", flush=True)
        results = []
        if args.resample:
            tasks = []
            for p_ in losses:
                rate = (exact(p_, kinfo["sends_steady"][2]) or 1e-12)
                iters = int(min(args.max_iters, max(args.min_iters, args.target / rate)))
                trials = math.ceil(iters / args.resample)
                blocks = max(args.jobs, math.ceil(trials / 200))
                for b in range(blocks):
                    n = trials // blocks + (b < trials % blocks)
                    if n:
                        tasks.append({"p": p_, "dp": args.dp, "iters": args.resample, "seed": args.seed + 1, "dir": work,
                                      "key": (args.dp, args.resample, args.seed + 1), "trials": n, "block": b})
            with ProcessPoolExecutor(max_workers=args.jobs) as pool:
                for rs in pool.map(resample_task, tasks):
                    results += rs
                    f = {m: sum(len(r["per_m"][m]["failed"]) for r in rs) for m in (1, 2, 3)}
                    print(f"  p={rs[0]['p']:g}: {len(rs)} trials x {args.resample} iterations, failed m=1/2/3: "
                          f"{f[1]}/{f[2]}/{f[3]}, decoded {sum(1 for r in rs if any(r['dropped']))}, "
                          f"{sum(r['s'] for r in rs):.0f} s", flush=True)
        else:
            tasks = []
            for i in range(math.ceil(args.iters / args.chunk)):  # every p's tasks interleaved: drift hits all alike
                for p_ in losses:
                    n = min(args.chunk, args.iters - i * args.chunk)
                    tasks.append({"p": p_, "dp": args.dp, "iters": n, "seed": args.seed + 1 + i, "dir": work})
            with ProcessPoolExecutor(max_workers=args.jobs) as pool:
                for r in pool.map(run_task, tasks):
                    results.append(r)
                    f = {m: len(r["per_m"][m]["failed"]) for m in r["per_m"]}
                    print(f"  p={r['p']:g} seed {r['seed']}: {r['iterations']} iterations, failed m=1/2/3: "
                          f"{f[1]}/{f[2]}/{f[3]}, silently wrong {sum(len(v['silently_wrong']) for v in r['per_m'].values())}, "
                          f"{r['s']:.0f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = summarise(results, kinfo, args.dp, losses)
    wall = time.perf_counter() - started
    wrong = sum(r["silently_wrong_iterations"] for r in rows)
    m = c.machine()
    result = {"benchmark": "mirror_loss", "command": cmd, "machine": m, "dp": args.dp, "k": {
        k: v for k, v in kinfo.items() if not k.startswith("sends_")}, "rows": rows, "silently_wrong": wrong,
        "tasks": results, "wall_s": wall,
        "sim_s_per_iteration": statistics.median(r["sim_s"] / r["iterations"] for r in results),
        "resample": args.resample}
    c.save_json(args.out, result)  # before plotting: a plotting problem must not cost the run
    png = plot(rows, kinfo, args.dp, args.png)
    mis = [(r["p"], r["m"], r["first_misaligned"]) for r in rows if r["first_misaligned"]]
    text = "\n".join([
        "## Mirror loss: measured unrecoverable iterations vs Eq. 2", "",
        f"- command: `{cmd}`",
        f"- machine: {m['cpu']}, {m['cores']} cores; date {m['date']}; flowcheck commit {m['commit']}",
        (f"- N={args.dp}, tiny model, LL, fp32, MTU 1024; ports 0:out,1:out,2:out, m = the first m decoded; "
         + (f"drops resampled on one lossless {args.resample}-iteration run (iterations per p in the table)"
            if args.resample else f"{args.iters} iterations per p in runs of {args.chunk}") + f"; wall {wall:.0f} s"),
        (f"- K = {kinfo['K_steady']} (steady iterations, {kinfo['allreduces_per_iteration']} buckets), "
         f"{kinfo['K_first']} (iteration 1, one bucket)"),
        "- misaligned / not found = failed with a conflict (copies of one element differ: the decoder matched some "
        "stream at the wrong sends) or with an allreduce the decoder never found; first such iteration per affected "
        "run (p, m, [iterations]): " + (str(mis) if mis else "none"),
        f"- silently wrong iterations (complete per the decoder, sha256 ≠ truth), all p and m: **{wrong}**"
        + (f"; plot: {png}" if png else "; plot: matplotlib not importable, none written"), "",
        markdown(rows)])
    print("\n" + text, flush=True)
    result.update(png=png, markdown=text)
    c.save_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
