"""Node RSS at scale (issue 18's scaling goal: node RSS <= 1.25x the state at 4 GB and 12 GB of state).

A pushing "trainer" (this process) holds --gb of fp32 tensors with the GPT-like names and shapes of the other
benchmarks (parameters + two Adam moments, as module parameters, so `Checkpointer(model)` pushes all of them), and
changes every tensor in place before each save (a multiply over all its bytes: every shard changes every step, the
worst case for the node). A `flowcheck serve` node process on this host takes a push every iteration
(Checkpointer(transport=--transport, on_busy="coalesce"): a save arriving while the previous push is still in
flight is skipped, as in P7) while a background thread asks it for local snapshots back to back (POST /snapshot),
so pushes and snapshots overlap for the whole run. The node's RSS, RssAnon and RssShmem are sampled every 0.1 s.
At the end the trainer's state is pushed once more (waiting), snapshotted, and every tensor is read back from the
local tier and compared with the trainer's bit for bit.

Memory on one host: trainer state (1x) + its push buffer (1x: a shared-memory segment for shm, private for tcp) +
the node (~1.1x) + page cache, so this host (24 GiB) runs it up to about 6 GB of state; a trainer and its node on
different hosts (the deployment this measures) have no such limit.

  python benchmarks/bench_node_rss.py --gb 4 --iters 8 --out rss4.json
"""
from __future__ import annotations

import os
import statistics
import sys
import threading
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _common as c  # noqa: E402
from bench_push import NodeProc  # noqa: E402

SCRIPT = "bench_node_rss.py"
GOAL = 1.25


def main(argv: list[str] | None = None) -> dict:
    p = c.base_parser(__doc__, default_gb=4.0)
    p.add_argument("--iters", type=int, default=8, help="pushes (one per iteration) (default 8)")
    p.add_argument("--transport", default="shm", choices=("shm", "tcp"), help="push transport (default shm)")
    args = p.parse_args(argv)
    cmd = c.command(SCRIPT, argv)
    c.preimport()
    import numpy as np
    import torch
    from torch import nn

    from flowcheck.store import open_store
    from flowcheck.torch.checkpointer import Checkpointer

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    shapes = c.gpt_param_shapes(args.gb)
    model = nn.Module()
    torch.manual_seed(0)
    names = {}
    for i, (name, shape, _) in enumerate(shapes):
        for slot in ("param", "exp_avg", "exp_avg_sq"):
            key = f"t{i}_{slot}"
            model.register_parameter(key, nn.Parameter(torch.randn(shape).mul_(0.02), requires_grad=False))
            names[key] = f"{name}:{slot}"
    state_bytes = sum(t.nbytes for t in model.parameters())
    description = (f"{len(names)} fp32 tensors (GPT-like shapes: params + 2 Adam moments) = {state_bytes / 1e9:.3f} GB; "
                   f"{args.iters} pushes ({args.transport}, on_busy=coalesce), local snapshots back to back")
    print(f"node RSS: {description}", flush=True)
    work = c.workdir("fc-bench-rss-", args.dir)
    c.check_disk(work, 3 * state_bytes + (1 << 30))
    node = NodeProc(work)
    time.sleep(1.0)
    rss_start = node.ps.memory_info().rss
    snaps: list[dict] = []
    stop = threading.Event()

    def snapshots() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                snaps.append({"step": node.get("/snapshot", "POST").get("step"), "s": time.perf_counter() - t0})
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                snaps.append({"error": f"{type(e).__name__}: {e}", "s": time.perf_counter() - t0})
                stop.wait(1.0)

    verified, iters, t0 = None, [], time.perf_counter()
    try:
        ck = Checkpointer(model, node=node.push, run="bench", transport=args.transport, on_busy="coalesce",
                          timeout_s=600, hook=False)
        node.phase = "push"
        snapper = threading.Thread(target=snapshots, daemon=True)
        with torch.no_grad():
            for step in range(1, args.iters + 1):
                ti = time.perf_counter()
                for t in model.parameters():
                    t.mul_(1.0001)
                ck.save(step)
                if step == 1:
                    ck.flush(600)  # the node holds a state before the first snapshot is asked for
                    snapper.start()
                iters.append(time.perf_counter() - ti)
                print(f"  iteration {step}: {iters[-1]:.2f} s, node RSS {node.ps.memory_info().rss / state_bytes:.2f}x "
                      f"state, snapshots so far {len(snaps)}", flush=True)
            ck.flush(600)
            stop.set()
            snapper.join()
            node.phase = "verify"
            final = args.iters + 1
            for t in model.parameters():
                t.mul_(1.0001)
            ck.on_busy = "wait"
            ck.save(final)
            if not ck.flush(600):
                print(f"  final push failed: {ck.stats.last_error}", flush=True)
        pushed = ck.stats.__dict__.copy()
        ck.close()
        snap, store = node.get("/snapshot", "POST"), open_store(node.cfg)
        sd = model.state_dict()
        ok = all(np.array_equal(store.read(snap["step"], k, prefer="local").reshape(-1).view(np.uint8),
                                t.contiguous().reshape(-1).view(torch.uint8).numpy()) for k, t in sd.items())
        verified = bool(ok and snap["step"] == final)
        print(("verified" if verified else "NOT VERIFIED") + f": step {snap['step']} (trainer's last {final}), "
              f"{len(sd)} tensors read back from the local tier bit for bit", flush=True)
    finally:
        node.stop()
        c.rmtree(work)
    wall = time.perf_counter() - t0

    peak = node.peak("push")
    anon_peak = max((s[3] for s in node.samples if s[1] == "push"), default=0)
    done = [s for s in snaps if "step" in s]
    rows = [("right after start (Python + imports, no state)", rss_start),
            ("peak RSS, pushes + snapshots", peak[2] if peak else 0),
            ("RssAnon at that peak", peak[3] if peak else 0),
            ("RssShmem at that peak (the trainer's segment, mapped while copied)", peak[4] if peak else 0),
            ("peak RssAnon", anon_peak)]
    ratio = (peak[2] / state_bytes) if peak else None
    md = ["| node memory | MiB | ÷ state |", "|---|---:|---:|"] + [
        f"| {what} | {b / 2**20:.0f} | {b / state_bytes:.2f}x |" for what, b in rows]
    summary = (f"{len(done)} snapshots completed during the pushes (median {statistics.median([s['s'] for s in done]):.1f} s"
               if done else "no snapshot completed during the pushes (") + \
              f"), iterations median {statistics.median(iters):.2f} s, pushes skipped while busy: " \
              f"{pushed.get('skipped', pushed.get('coalesced', '?'))}"
    goal = f"node peak RSS ÷ state: **{ratio:.2f}x** (goal <= {GOAL}x: {'met' if ratio and ratio <= GOAL else 'NOT met'})" \
        if ratio else "node peak RSS: no sample"
    text = "\n".join([c.header("Node RSS at scale: pushes every iteration + back-to-back local snapshots", None, args,
                               cmd, description), "", *md, "", f"- {goal}", f"- {summary}",
                      f"- after the last push: {'verified' if verified else 'NOT verified'} (every tensor read back "
                      f"from the local tier, bit for bit); wall {wall:.0f} s"])
    print(text, flush=True)
    result = {"bench": "node_rss", "command": cmd, "state_bytes": state_bytes, "rows": dict(rows), "ratio": ratio,
              "goal": GOAL, "goal_met": bool(ratio and ratio <= GOAL), "snapshots": snaps, "iterations_s": iters,
              "pushed": {k: v for k, v in pushed.items() if isinstance(v, (int, float, str, type(None)))},
              "verified": verified, "samples (time, phase, rss, RssAnon, RssShmem)": node.samples, "markdown": text,
              "machine": c.machine()}
    c.save_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
