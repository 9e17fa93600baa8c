"""P4 push + P7 node RSS: a 61M-parameter GPT-like CPU trainer (AdamW) checkpointing every iteration.

Model: vocab 16384, width 512, 8 heads, ffn 2048, --layers 14 pre-LN torch TransformerEncoderLayers, learned positions,
untied head; --batch x --seq random tokens; torch.set_num_threads(--threads), default 1: the other core is left to the
checkpoint side threads and the node, as a GPU trainer leaves host cores free. --repeats rounds, alternatives interleaved
(ABBA: reversed every other round, so a drifting machine favours none); per round --warmup untimed iterations (the first
two saves drained: each fills host buffers touched for the first time), then --iters timed ones; the hypervisor's steal time is recorded per round. Alternatives: no checkpoint
(baseline); flowcheck Checkpointer(transport="shm" / "tcp") -> a `flowcheck serve` node process on this host; torch.save
of model + optimizer state dicts to one file (overwritten, no fsync); DCP async_save(no_dist=True, default writer: fsync).
Blocking per save = training-thread time in checkpoint calls / timed iterations: flowcheck ck.save() + the optimizer
hook's wait() (stats.blocked_s); torch.save the whole call; DCP the previous future's .result() + the async_save() call.
Interleaved pass (--pairs, per transport in --pairs-alts): iteration pairs, quiet (nothing in flight) then loaded (save(),
then the iteration the side thread's copy and the node's receive overlap, plus any wait for the push to end), 2 s apart:
the box drifts by ±10% between rounds of seconds (neighbours on the host), far more than the 3% to measure, and a pair
shares its drift. Slowdown = sum of loaded ÷ sum of quiet − 1 (95% bootstrap CI over pairs; also the median pair):
each save's whole cost, i.e. the per-iteration slowdown of saving every iteration as long as a push ends within one
iteration (counted: "pushes outlived").
P7: one more shm pass (--p7-iters) with --snapshots POST /snapshot in the background; the node's RSS (psutil; RssAnon /
RssShmem from /proc) is sampled every 0.1 s throughout. Then the node's state is snapshotted and every tensor read back
from the local tier must equal the trainer's bit for bit. --gb / --warm: accepted (run_all.py) but ignored.

  python benchmarks/bench_push.py --out push.json
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import warnings

import psutil
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

from flowcheck.capture.push.auth import read_token  # noqa: E402
from flowcheck.node.client import control_request  # noqa: E402

SCRIPT = "bench_push.py"
VOCAB, WIDTH, HEADS, FFN = 16384, 512, 8, 2048


def steal_s() -> float:
    """CPU seconds the hypervisor gave to other guests, all cores (/proc/stat's steal column; 0 off Linux)."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def gpt(layers: int, seq: int):
    import torch
    from torch import nn

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(seq, WIDTH)
            self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(WIDTH, HEADS, FFN, dropout=0.0, activation="gelu",
                                                                   batch_first=True, norm_first=True) for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

        def forward(self, x):
            h = self.tok(x) + self.pos.weight[: x.shape[1]]
            for b in self.blocks:
                h = b(h, src_mask=self.mask, is_causal=True)
            return self.head(self.ln(h))

    torch.manual_seed(0)
    return GPT()


class NodeProc:
    """`flowcheck serve` in a child process, its control API, and an RSS sampler (every 0.1 s, tagged by phase)."""

    def __init__(self, work: str, keep_last: int | None = None) -> None:
        self.http, self.push = f"http://127.0.0.1:{c.free_port()}", f"tcp://127.0.0.1:{c.free_port()}"
        self.cfg = os.path.join(work, "node.yaml")
        raw = {"run": "bench", "tiers": {"local": {"root": os.path.join(work, "local")},
                                         "object": {"url": "file://" + os.path.join(work, "object")}},
               "policy": {"local": {"every_steps": 1000000, **({"keep_last": keep_last} if keep_last else {})},
                          "object": {"every_seconds": None, "every_steps": None}},
               "serve": {"push": self.push[6:], "http": self.http[7:], "part_timeout_s": 60}}
        with open(self.cfg, "w") as f:
            yaml.safe_dump(raw, f)
        self._log = open(os.path.join(work, "node.log"), "wb")  # noqa: SIM115 - open while the node runs
        self.proc = subprocess.Popen([sys.executable, "-m", "flowcheck", "serve", "--config", self.cfg],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while True:
            with contextlib.suppress(OSError):
                self.get("/status")
                break
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"node did not start; see {self._log.name}")
            time.sleep(0.2)
        self.ps, self.phase, self.samples, self._stop = psutil.Process(self.proc.pid), "idle", [], threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                rss = self.ps.memory_info().rss
                with open(f"/proc/{self.proc.pid}/status") as f:
                    kb = {k: int(v.split()[0]) * 1024 for k, v in (x.split(":", 1) for x in f) if k.startswith("Rss")}
                self.samples.append((time.time(), self.phase, rss, kb.get("RssAnon", 0), kb.get("RssShmem", 0)))
            except Exception:  # noqa: BLE001 - the node exited
                return
            self._stop.wait(0.1)

    def get(self, path: str, method: str = "GET"):
        req = control_request(self.http + path, method, token=read_token())  # the node inherits this environment
        with urllib.request.urlopen(req, timeout=600) as r:
            body = r.read().decode()
        return json.loads(body) if r.headers.get_content_type() == "application/json" else body

    def peak(self, phase: str) -> tuple | None:
        return max((s for s in self.samples if s[1] == phase), key=lambda s: s[2], default=None)

    def stop(self) -> None:
        self._stop.set()
        self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(60)
        self.proc.kill()
        self.proc.wait()
        self._log.close()


def main(argv: list[str] | None = None) -> dict:
    p = c.base_parser(__doc__)
    for name, default, what in (
            ("--iters", 6, "timed iterations per alternative per round"), ("--threads", 1, "torch.set_num_threads"),
            ("--warmup", 2, "untimed iterations per alternative per round"), ("--batch", 2, "sequences per batch"),
            ("--seq", 128, "tokens per sequence"), ("--layers", 14, "transformer blocks"),
            ("--p7-iters", 8, "iterations of the P7 pass"), ("--snapshots", 3, "POST /snapshot during the P7 pass"),
            ("--pairs", 40, "iteration pairs of the interleaved pass per flowcheck transport (0: skip it)")):
        p.add_argument(name, type=int, default=default, help=f"{what} (default {default})")
    p.add_argument("--pairs-alts", default="shm", help="flowcheck transports given an interleaved pass (default shm)")
    p.add_argument("--alts", default="shm,tcp,torch.save,dcp",
                   help="alternatives besides the no-checkpoint baseline, of shm,tcp,torch.save,dcp (default all; "
                        "blocking ÷ DCP needs dcp)")
    p.add_argument("--on-busy", default="wait", choices=("wait", "coalesce"), help="Checkpointer(on_busy=) (default wait)")
    p.add_argument("--p7-on-busy", default="coalesce", choices=("wait", "coalesce"),
                   help="Checkpointer(on_busy=) in the P7 pass (default coalesce: while a snapshot holds the node's "
                        "copy-on-write budget, pushes are back-pressured and a trainer that waits would stall)")
    args = p.parse_args(argv)
    cmd = c.command(SCRIPT, argv)
    c.preimport()
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp
    from torch import nn

    from flowcheck.store import open_store
    from flowcheck.torch.checkpointer import Checkpointer

    warnings.filterwarnings("ignore", message="(torch.distributed is disabled|Detected an existing checkpoint)")
    torch.set_num_threads(args.threads)
    model = gpt(args.layers, args.seq)
    opt, gen = torch.optim.AdamW(model.parameters(), lr=1e-4), torch.Generator().manual_seed(1)
    n_params = sum(t.numel() for t in model.parameters())
    state_bytes = 3 * 4 * n_params  # fp32 params + exp_avg + exp_avg_sq
    description = (f"GPT-like: vocab {VOCAB}, width {WIDTH}, {HEADS} heads, ffn {FFN}, {args.layers} pre-LN blocks, "
                   f"untied head = {n_params / 1e6:.1f}M params; AdamW; state (params + 2 moments, fp32) "
                   f"{state_bytes / 1e9:.3f} GB; batch {args.batch} x seq {args.seq}, torch.set_num_threads({args.threads})")
    print(f"push: {description}", flush=True)

    def train_step() -> None:
        x = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=gen)
        nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1)).backward()
        opt.step()  # flowcheck's hook runs ck.wait() first
        opt.zero_grad(set_to_none=True)

    c.check_disk(work := c.workdir("fc-bench-push-", args.dir), 6 * state_bytes)
    node = NodeProc(work)
    time.sleep(1.0)
    rss_start, me, step = node.ps.memory_info().rss, psutil.Process(), [0]

    class Alt:  # one alternative: its checkpoint call, how to drain it, its results
        def __init__(self, name: str, note: str, kind: str = "none") -> None:
            self.name, self.note, self.kind, self.fc = name, note, kind, kind in ("shm", "tcp")
            self.rounds, self.extra, self.stats, self.row, self.ck, self.fut, self.timed = [], {}, [], {}, None, None, False

        def save(self, s: int) -> None:
            if self.ck is not None:
                self.ck.save(s)
            elif self.kind == "torch.save":
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, os.path.join(work, "ts.pt"))
            elif self.kind == "dcp":
                t0 = time.perf_counter()
                self.drain()
                t1 = time.perf_counter()
                self.fut = dcp.async_save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                                          storage_writer=dcp.FileSystemWriter(os.path.join(work, "dcp")), no_dist=True)
                if self.timed:
                    self.extra.setdefault("wait_prev_s", []).append(t1 - t0)
                    self.extra.setdefault("async_save_call_s", []).append(time.perf_counter() - t1)

        def drain(self) -> None:
            if self.ck is not None and not self.ck.flush(120):
                print(f"  {self.name}: flush failed: {self.ck.stats.last_error}", flush=True)
            if self.fut is not None:
                self.fut.result()
                self.fut = None

    def run(alt: Alt, iters: int, on_iter=None, on_busy: str | None = None) -> dict:
        if alt.fc:
            alt.ck = Checkpointer(model, opt, node=node.push, run="bench", transport=alt.kind, on_busy=on_busy or args.on_busy,
                                  timeout_s=30)
        blocked = (lambda: alt.ck.stats.blocked_s) if alt.fc else (lambda: 0.0)
        rec = []  # per timed iteration: iteration s, checkpoint call s, flowcheck copy s, send s
        for k in range(-args.warmup, iters):
            if k <= 0 and 1 - args.warmup <= k <= 2 - args.warmup:
                # the round's first two saves are not steady state: each fills a new host buffer (two shared-memory
                # segments, or the node's two receive buffers over TCP) whose pages are touched for the first time
                alt.drain()
            if k == 0:  # timed from here
                b0, cpu0, ncpu0, steal0 = blocked(), sum(me.cpu_times()[:4]), sum(node.ps.cpu_times()[:4]), steal_s()
            if on_iter and k >= 0:
                on_iter(k)
            alt.timed, t0 = k >= 0, time.perf_counter()
            train_step()
            step[0] += 1
            t1 = time.perf_counter()
            alt.save(step[0])
            if k >= 0:
                t2, st = time.perf_counter(), alt.ck.stats if alt.fc else None
                rec.append((t2 - t0, t2 - t1) + ((st.last_copy_s, st.last_send_s) if st else (None, None)))
        cpu, ncpu = (sum(me.cpu_times()[:4]) - cpu0) / iters, (sum(node.ps.cpu_times()[:4]) - ncpu0) / iters
        steal = (steal_s() - steal0) / iters
        hook = blocked() - b0
        alt.drain()
        if alt.fc:
            alt.ck.close()
            alt.stats.append(dict(vars(alt.ck.stats)))
        alt.ck = None
        gc.collect()
        times, calls, copy, send = zip(*rec)
        r = {"iter_s": statistics.mean(times), "block_s": (sum(calls) + hook) / iters, "save_call_s": sum(calls) / iters,
             "hook_wait_s": hook / iters, "iter_times_s": times, "last_step": step[0], "cpu_s": cpu, "node_cpu_s": ncpu,
             "steal_s": steal,
             **({"copy_s": statistics.median(copy), "send_s": statistics.median(send)} if alt.fc else {})}
        print(f"  {alt.name}: iteration {r['iter_s']:.3f} s, blocking {1e3 * r['block_s']:.1f} ms/save (save call "
              f"{1e3 * r['save_call_s']:.1f}, hook wait {1e3 * r['hook_wait_s']:.1f}); CPU/iteration trainer {cpu:.2f} s, "
              f"node {ncpu:.2f} s, stolen by the hypervisor {steal:.2f} s" + (f"; copy {r['copy_s']:.3f} s, send {r['send_s']:.3f} s" if alt.fc else ""),
              flush=True)
        return r

    def pairs_pass(kind: str, pairs: int) -> dict:
        """The interleaved pass: iteration pairs (quiet, loaded), 2 s apart, so the box's drift hits both alike.
        Quiet: train with nothing in flight. Loaded: save() (blocking part timed), then train while the side thread
        copies and the node receives — every bit of one save's work lands in that iteration (it ends before the next
        pair: a push still in flight is waited for, and the wait counted as the loaded iteration's)."""
        ck = Checkpointer(model, opt, node=node.push, run="bench", transport=kind, on_busy=args.on_busy, timeout_s=30)
        quiet, loaded, spill = [], [], 0
        try:
            train_step()
            step[0] += 1
            ck.save(step[0])
            ck.flush(120)
            for _ in range(pairs):
                t0 = time.perf_counter()
                train_step()
                step[0] += 1
                t1 = time.perf_counter()
                ck.save(step[0])
                train_step()
                step[0] += 1
                t2 = time.perf_counter()
                if not ck.flush(120):
                    print(f"  interleaved {kind}: flush failed: {ck.stats.last_error}", flush=True)
                t3 = time.perf_counter()
                spill += t3 - t2 > 1e-3
                quiet.append(t1 - t0)
                loaded.append(t3 - t1)
        finally:
            ck.close()
        ratios = [b / a - 1 for a, b in zip(quiet, loaded)]
        rng = random.Random(0)  # 95% bootstrap interval of the ratio of sums, resampling pairs
        boot = sorted(sum(loaded[i] for i in pick) / sum(quiet[i] for i in pick) - 1
                      for pick in ([rng.randrange(pairs) for _ in range(pairs)] for _ in range(2000)))
        r = {"quiet_s": quiet, "loaded_s": loaded, "spilled": spill, "median_pair_slowdown": statistics.median(ratios),
             "mean_slowdown": sum(loaded) / sum(quiet) - 1, "mean_slowdown_ci95": (boot[49], boot[-50]),
             "saves": ck.stats.sent}
        print(f"  interleaved {kind}: {pairs} pairs, quiet {statistics.median(quiet):.3f} s, loaded "
              f"{statistics.median(loaded):.3f} s (medians); slowdown: ratio of sums {100 * r['mean_slowdown']:+.1f}% "
              f"(95% CI {100 * boot[49]:+.1f} … {100 * boot[-50]:+.1f}%), median of pairs "
              f"{100 * r['median_pair_slowdown']:+.1f}%; {spill} pushes outlived their iteration", flush=True)
        return r

    interleaved: dict[str, dict] = {}
    fc_note = f"on_busy={args.on_busy}; node process on this host"
    alts = [Alt("no checkpoint", "baseline"), Alt("flowcheck Checkpointer (shm)", fc_note, "shm"), Alt(
            "flowcheck Checkpointer (tcp)", fc_note, "tcp"), Alt("torch.save every iteration", "no fsync", "torch.save"),
            Alt("DCP async_save every iteration", "no_dist=True; FileSystemWriter defaults (fsync)", "dcp")]
    wanted = set(args.alts.split(","))
    alts = [a for a in alts if a.kind == "none" or a.kind in wanted]
    t_start = time.perf_counter()
    verified, snaps, status, metrics_rss = None, [], {}, None
    try:
        for rnd in range(args.repeats):
            print(f"round {rnd + 1}/{args.repeats}", flush=True)
            for alt in (alts if rnd % 2 == 0 else alts[::-1]):  # ABBA: a drifting machine favours no alternative
                node.phase = "p4-push" if alt.fc else "p4-other"
                try:
                    alt.rounds.append(run(alt, args.iters))
                except Exception as e:  # noqa: BLE001 - a failing alternative is reported, the others still run
                    alt.extra["error"] = f"{type(e).__name__}: {e}"
                    print(f"  {alt.name}: FAILED {alt.extra['error']}", flush=True)
                    with contextlib.suppress(Exception):
                        alt.ck = alt.ck and alt.ck.close()  # removes its optimizer hook

        def snapshots() -> None:  # P7: one after the other, 1 s apart, while the trainer pushes
            for _ in range(args.snapshots):
                t0, out = time.perf_counter(), {}
                try:
                    out["step"] = node.get("/snapshot", "POST").get("step")
                except Exception as e:  # noqa: BLE001
                    out["error"] = f"{type(e).__name__}: {e}"
                snaps.append({**out, "s": time.perf_counter() - t0})
                time.sleep(1.0)

        for kind in [a.kind for a in alts if a.fc and a.kind in args.pairs_alts.split(",")] if args.pairs else []:
            node.phase = "p4-push"
            interleaved[kind] = pairs_pass(kind, args.pairs)

        node.phase, snapper = "p7", threading.Thread(target=snapshots, daemon=True)
        alts.append(Alt(f"flowcheck Checkpointer (shm) + {args.snapshots} node snapshots (P7 pass)",
                        fc_note.replace(f"on_busy={args.on_busy}", f"on_busy={args.p7_on_busy}"), "shm"))
        alts[-1].rounds.append(run(alts[-1], args.p7_iters, lambda k: k == min(1, args.p7_iters - 1) and snapper.start(),
                                   on_busy=args.p7_on_busy))
        snapper.join()
        node.phase = "verify"
        # the P7 pass coalesces (skips) saves while the node is busy, so its last save may have been one of them:
        # push the trainer's current state once more, waiting for it, so the node must hold exactly that
        final = Checkpointer(model, opt, node=node.push, run="bench", transport="shm", on_busy="wait", timeout_s=60)
        try:
            final.save(step[0])
            if not final.flush(120):
                print(f"  final push failed: {final.stats.last_error}", flush=True)
        finally:
            final.close()
        st, last = node.get("/status"), step[0]
        snap, store = node.get("/snapshot", "POST"), open_store(node.cfg)
        want = {**model.state_dict(), **{f"optimizer.{slot}.{name}": opt.state[prm][slot]
                                         for name, prm in model.named_parameters() for slot in opt.state[prm]}}
        ok = all(np.array_equal(store.read(snap["step"], n, prefer="local").reshape(-1).view(np.uint8),
                                t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()) for n, t in want.items())
        verified = bool(ok and st["memory"]["step"] == last and snap["step"] == last)
        print(("verified" if verified else "NOT VERIFIED") + f": step {snap['step']} (trainer's last {last}, node RAM "
              f"{st['memory']['step']}), {len(want)} tensors read back from the local tier, bit for bit", flush=True)
        status = node.get("/status")
        metrics_rss = next((float(x.split()[1]) for x in node.get("/metrics").splitlines()
                            if x.startswith("flowcheck_rss_bytes")), None)
    finally:
        node.stop()
        c.rmtree(work)
    wall = time.perf_counter() - t_start

    # ---- tables
    def med(a: Alt, key: str) -> float:
        return statistics.median(r[key] for r in a.rounds) if a.rounds else float("nan")

    ms = lambda v: f"{1e3 * v:.1f}"  # noqa: E731 - seconds as milliseconds
    p4_alts = [a for a in alts if a.kind != "none" and "P7" not in a.name]
    dcp_alt = next((a for a in alts if a.kind == "dcp"), None)
    base_iter, dcp_block = med(alts[0], "iter_s"), med(dcp_alt, "block_s") if dcp_alt else float("nan")

    def paired(a: Alt) -> float | None:
        """Median over rounds of (this round's iteration ÷ the same round's baseline) − 1: the box's drift
        between rounds (other jobs, thermal) cancels, which a ratio of medians does not do."""
        pairs = [r["iter_s"] / b["iter_s"] - 1 for r, b in zip(a.rounds, alts[0].rounds)]
        return statistics.median(pairs) if a in p4_alts and len(pairs) == len(a.rounds) and pairs else None
    md = [("| method | iteration s (median) | min | max | slowdown vs none | paired slowdown | blocking ms/save (median) "
           "| min | max | blocking ÷ DCP async | in save() / in hook, ms | CPU s/iteration: trainer, node | notes |"),
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for a in alts:
        if not a.rounds:
            md.append(f"| {a.name} |" + " – |" * 11 + f" FAILED: {a.extra.get('error')} |")
            continue
        it, bl = [r["iter_s"] for r in a.rounds], [r["block_s"] for r in a.rounds]
        slow, ratio, note = med(a, "iter_s") / base_iter - 1, med(a, "block_s") / dcp_block, a.note
        if a.fc:
            note += (f"; side thread: copy {med(a, 'copy_s'):.3f} s, send {med(a, 'send_s'):.3f} s; " + ", ".join(
                f"{k} {sum(s[k] for s in a.stats)}" for k in ("saves", "sent", "coalesced", "failures")))
        if a.extra.get("wait_prev_s"):
            note += (f"; wait on previous future {ms(statistics.median(a.extra['wait_prev_s']))} ms, "
                     f"async_save call {ms(statistics.median(a.extra['async_save_call_s']))} ms (medians)")
        pair = paired(a)
        md.append(f"| {a.name} | {med(a, 'iter_s'):.3f} | {min(it):.3f} | {max(it):.3f} | {100 * slow:+.1f}% | "
                  + (f"{100 * pair:+.1f}% | " if pair is not None else "– | ") +
                  f"{ms(med(a, 'block_s'))} | {ms(min(bl))} | {ms(max(bl))} | {ratio:.3f}x | {ms(med(a, 'save_call_s'))}"
                  f" / {ms(med(a, 'hook_wait_s'))} | {med(a, 'cpu_s'):.2f}, {med(a, 'node_cpu_s'):.2f} | {note} |")
        a.row = {"method": a.name, "rounds": a.rounds, "iter_s_median": med(a, "iter_s"), "block_s_median":
                 med(a, "block_s"), "slowdown": slow, "slowdown_paired": pair, "block_ratio_vs_dcp_async": ratio,
                 "note": note,
                 "checkpointer_stats": a.stats, "extra": a.extra}
    goals = [(f"{a.name}: {what}", a.row.get(key), goal if a.fc else "-") for a in p4_alts if a.rounds
             for what, key, goal in (
                 ("blocking ÷ DCP async_save blocking", "block_ratio_vs_dcp_async", "<= 0.05x"),
                 ("iteration slowdown vs no checkpoint (ratio of medians)", "slowdown", "<= 3%"),
                 ("iteration slowdown vs no checkpoint (median of per-round ratios)", "slowdown_paired", "<= 3%"))]
    goals += [(f"flowcheck Checkpointer ({kind}): iteration slowdown, interleaved pass (sum loaded ÷ sum quiet over "
               f"{len(r['quiet_s'])} pairs; 95% CI {100 * r['mean_slowdown_ci95'][0]:+.1f} … "
               f"{100 * r['mean_slowdown_ci95'][1]:+.1f}%)", r["mean_slowdown"], "<= 3%") for kind, r in interleaved.items()]

    # ---- P7
    p4_peak, p7_peak, p7 = node.peak("p4-push"), node.peak("p7"), {}
    p7_rows = [("node RSS right after start (python + imports, no state)", rss_start, "")] + [
        (label, pk[2], f"RssAnon {pk[3] / 2**20:.0f} MiB, RssShmem {pk[4] / 2**20:.0f} MiB") for label, pk in (
            ("peak during P4 pushes (no snapshot)", p4_peak),
            (f"peak during the P7 pass (pushes + {len(snaps)} snapshots)", p7_peak)) if pk is not None]
    if p7_peak is not None:
        p7_rows += [("P7 peak − start baseline", p7_peak[2] - rss_start, ""),
                    ("P7 peak's RssAnon − start baseline (without the mapped segment)", p7_peak[3] - rss_start, "")]
        p7 = {"start_rss": rss_start, "p4_peak": p4_peak, "p7_peak": p7_peak, "ratio": p7_peak[2] / state_bytes,
              "ratio_minus_baseline": (p7_peak[2] - rss_start) / state_bytes, "snapshots": snaps,
              "metrics_rss_end": metrics_rss, "samples (time, phase, rss, RssAnon, RssShmem)": node.samples}
        goals += [("P7 node peak RSS ÷ state bytes (pushes + snapshots)", p7["ratio"], "<= 1.25x"),
                  ("P7 node (peak RSS − start RSS) ÷ state bytes", p7["ratio_minus_baseline"], "-")]
    p7_md = ["| node RSS | MiB | ÷ state | notes |", "|---|---:|---:|---|"] + [
        f"| {n} | {v / 2**20:.0f} | {v / state_bytes:.2f}x | {note} |" for n, v, note in p7_rows]
    goal_md = ["| comparison | value | goal |", "|---|---:|---|"] + [
        f"| {n} | {'–' if v is None else (f'{100 * v:+.1f}%' if 'slowdown' in n else f'{v:.3f}x')} | {g} |"
        for n, v, g in goals]
    notes = (f"- {args.repeats} rounds interleaved, {args.warmup} warm-up + {args.iters} timed iterations per alternative "
             f"each; median/min/max over rounds' means; {state_bytes / 1e9:.3f} GB per save\n- node push counters: "
             + ", ".join(f"{k} {v}" for k, v in status.get("push", {}).items()) + "; P7 snapshots: "
             + "; ".join(f"step {s.get('step')} in {s['s']:.1f} s" if "step" in s else s["error"] for s in snaps)
             + f"\n- after the last push: {'verified' if verified else 'NOT verified'} (POST /snapshot, every tensor "
             f"read back from the local tier equals the trainer's bit for bit); wall {wall:.0f} s")
    title = "P4 push: blocking per save and iteration slowdown, flowcheck vs torch.save and DCP async_save (+ P7 node RSS)"
    p7_title = (f"P7 node RSS (state = params + 2 Adam moments, fp32 = {state_bytes / 2**20:.0f} MiB; RssShmem = the "
                "trainer's segment while the node maps it):")
    text = "\n\n".join([c.header(title, None, args, cmd, f"- model: {description}\n" + notes), "\n".join(md),
                        "\n".join(goal_md), p7_title, "\n".join(p7_md)])
    print("\n" + text, flush=True)
    result = {"benchmark": "push", "command": cmd, "machine": c.machine(), "model": description, "params": n_params,
              "state_bytes": state_bytes, "rows": [a.row for a in alts], "interleaved": interleaved, "p7": p7, "verified": verified,
              "node_status": status, "goals": [{"comparison": n, "value": v, "goal": g} for n, v, g in goals],
              "wall_s": wall, "markdown": text}
    c.save_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
