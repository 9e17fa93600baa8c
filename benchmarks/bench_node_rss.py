"""Node RSS at scale (issue 18's scaling goal: node RSS <= 1.25x the state at 4 GB and 12 GB of state).

A pushing "trainer" (this process) holds --gb of fp32 tensors with the GPT-like names and shapes of the other
benchmarks (parameters + two Adam moments, as module parameters, so `Checkpointer(model)` pushes all of them), and
changes every tensor in place before each save (a multiply over all its bytes: every shard changes every step, the
worst case for the node). A `flowcheck serve` node process on this host takes a push every iteration
(Checkpointer(transport=--transport, on_busy="coalesce"): a save arriving while the previous push is still in
flight is skipped, as in P7) while a background thread asks it for local snapshots back to back (POST /snapshot),
so pushes and snapshots overlap for the whole run (``--on-busy wait`` sends every save; ``--snapshot-with-push``
asks for each snapshot exactly when a push starts sending, so every push arrives while the previous state is being
written: the copy-on-write case, for trainers whose pushes are slower than a snapshot). The node's RSS, RssAnon and RssShmem are sampled every 0.1 s.
At the end the trainer's state is pushed once more (waiting), snapshotted, and every tensor is read back from the
local tier and compared with the trainer's bit for bit.

Memory on one host: trainer state (1x) + its push buffer (1x: a shared-memory segment for shm, private for tcp) +
the node (~1.1x) + page cache, so this host (24 GiB) runs it up to about 6 GB of state; a trainer and its node on
different hosts (the deployment this measures) have no such limit.  ``--lean-trainer`` (chosen, with ``--on-busy
wait --snapshot-with-push``, when the host's available memory is under ~3.3x the state) makes the trainer small
enough for a 12 GB node on this host, keeping everything the node sees: the trainer's tensors are views into one
shared pool (each at its own offset, so they overlap: the multiply still changes every byte of every tensor each
iteration, and the final check compares with what the views hold), and its push buffer (tcp transport) is a file
on disk mapped shared instead of anonymous memory, so the kernel writes it back and drops it under pressure.  The
node receives the same frames, shards and bytes per push as from a trainer on another host.

  python benchmarks/bench_node_rss.py --gb 4 --iters 8 --out rss4.json
  python benchmarks/bench_node_rss.py --gb 12 --iters 6 --lean-trainer --on-busy wait --snapshot-with-push --out rss12.json
"""
from __future__ import annotations

import contextlib
import itertools
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
    p.add_argument("--lean-trainer", action="store_true",
                   help="trainer tensors as views of one pool and its push buffer a file on disk (implies tcp): "
                        "a 12 GB node fits beside it on a 24 GiB host")
    p.add_argument("--on-busy", default="coalesce", choices=("coalesce", "wait"),
                   help="a save while the previous push is in flight: skipped (coalesce, as in P7; default) or "
                        "waits for it (wait: pushes back to back)")
    p.add_argument("--snapshot-with-push", action="store_true",
                   help="ask for each snapshot as a push starts sending (its copy done), instead of back to back: "
                        "every push then arrives while the previous state is being written (the copy-on-write case)")
    p.add_argument("--pool-mib", type=int, default=1024, help="--lean-trainer: the pool's size (default 1024)")
    args = p.parse_args(argv)
    need, have = 3.3 * args.gb * 1e9, _available_bytes()
    if not args.lean_trainer and have is not None and need > have:
        print(f"node RSS: a trainer and its node at {args.gb} GB need about {need / 2**30:.0f} GiB on one host, "
              f"{have / 2**30:.0f} GiB available: --lean-trainer --on-busy wait --snapshot-with-push", flush=True)
        args.lean_trainer, args.on_busy, args.snapshot_with_push = True, "wait", True
    if args.lean_trainer:
        args.transport = "tcp"  # the buffer is a file mapping; shm would put it in RAM (tmpfs)
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
    tensor = _pooled(shapes, args.pool_mib << 20) if args.lean_trainer else (lambda shape: torch.randn(shape).mul_(0.02))
    for i, (name, shape, _) in enumerate(shapes):
        for slot in ("param", "exp_avg", "exp_avg_sq"):
            key = f"t{i}_{slot}"
            model.register_parameter(key, nn.Parameter(tensor(shape), requires_grad=False))
            names[key] = f"{name}:{slot}"
    state_bytes = sum(t.nbytes for t in model.parameters())
    description = (f"{len(names)} fp32 tensors (GPT-like shapes: params + 2 Adam moments) = {state_bytes / 1e9:.3f} GB; "
                   f"{args.iters} pushes ({args.transport}, on_busy={args.on_busy}), local snapshots "
                   f"{'as each push starts sending' if args.snapshot_with_push else 'back to back'}" +
                   (f"; lean trainer (tensors: views of one {args.pool_mib} MiB pool; push buffer: a file on disk)"
                    if args.lean_trainer else ""))
    print(f"node RSS: {description}", flush=True)
    work = c.workdir("fc-bench-rss-", args.dir)
    # the local tier keeps its newest step and writes the next beside it (keep_last 1: disk for 12 GB runs)
    c.check_disk(work, (3 if args.lean_trainer else 2) * state_bytes + (1 << 30))
    node = NodeProc(work, keep_last=1)
    gc_store = open_store(node.cfg)
    time.sleep(1.0)
    rss_start = node.ps.memory_info().rss
    snaps: list[dict] = []
    stop, sending = threading.Event(), threading.Event()

    def snapshots() -> None:
        while not stop.is_set():
            if args.snapshot_with_push:
                if not sending.wait(1.0):
                    continue
                sending.clear()
            t0 = time.perf_counter()
            try:
                snaps.append({"step": node.get("/snapshot", "POST").get("step"), "s": time.perf_counter() - t0})
                # the API's snapshot runs no GC (the policy's does): retention as an operator's `flowcheck gc` would
                gc_store.gc(tiers=["local"])
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                snaps.append({"error": f"{type(e).__name__}: {e}", "s": time.perf_counter() - t0})
                stop.wait(1.0)

    verified, iters, t0, memory = None, [], time.perf_counter(), {}
    try:
        kind = _lean_checkpointer(Checkpointer, os.path.join(work, "push-buffer")) if args.lean_trainer else Checkpointer
        ck = kind(model, node=node.push, run="bench", transport=args.transport, on_busy=args.on_busy,
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
                elif args.snapshot_with_push:
                    ck.wait()  # this push's copy is done: it is sending now
                    sending.set()
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
        memory = node.get("/status").get("memory", {})  # copy-on-write: shards copied / updates that waited
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
        if not verified:  # what the node said is the first thing to read
            with contextlib.suppress(OSError), open(os.path.join(work, "node.log"), errors="replace") as f:
                print("node log (last 40 lines):\n" + "".join(f.readlines()[-40:]), flush=True)
        c.rmtree(work)
    wall = time.perf_counter() - t0

    peak = node.peak("push")
    anon_peak = max((s[3] for s in node.samples if s[1] == "push"), default=0)
    done = [s for s in snaps if "step" in s]
    distinct = sorted({s["step"] for s in done})
    rows = [("right after start (Python + imports, no state)", rss_start),
            ("peak RSS, pushes + snapshots", peak[2] if peak else 0),
            ("RssAnon at that peak", peak[3] if peak else 0),
            ("RssShmem at that peak (the trainer's segment, mapped while copied)", peak[4] if peak else 0),
            ("peak RssAnon", anon_peak)]
    ratio = (peak[2] / state_bytes) if peak else None
    md = ["| node memory | MiB | ÷ state |", "|---|---:|---:|"] + [
        f"| {what} | {b / 2**20:.0f} | {b / state_bytes:.2f}x |" for what, b in rows]
    summary = (f"{len(done)} snapshots completed during the pushes (median {statistics.median([s['s'] for s in done]):.1f} s; "
               f"{len(distinct)} of them wrote a new step: {distinct}, the others found their step stored"
               if done else "no snapshot completed during the pushes (") + \
              f"), pushes acknowledged {pushed.get('sent')}, copy-on-write while a snapshot held the state: " \
              f"{memory.get('cow_copies', '?')} shards copied, {memory.get('cow_waits', '?')} updates waited, iterations median {statistics.median(iters):.2f} s, pushes skipped while busy: " \
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
              "verified": verified, "memory_status": memory, "samples (time, phase, rss, RssAnon, RssShmem)": node.samples, "markdown": text,
              "machine": c.machine()}
    c.save_json(args.out, result)
    return result


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def _pooled(shapes, pool_bytes: int):
    """A maker of fp32 tensors that are views into one pool of random values, each at its own offset."""
    import math

    import torch
    largest = max(math.prod(shape) for _, shape, _ in shapes)
    pool = torch.randn(max(pool_bytes // 4, largest + (1 << 20))).mul_(0.02)
    room = pool.numel() - largest
    count = itertools.count()

    def tensor(shape):
        start = (next(count) * 7_919_993) % room  # spread over the pool: tensors overlap, no two start alike
        return pool[start:start + math.prod(shape)].view(shape)
    return tensor


def _lean_checkpointer(base, path: str):
    """The Checkpointer with its (tcp) push buffer in a shared file mapping on disk instead of anonymous memory."""
    import numpy as np
    import torch

    from flowcheck.torch.host_buffer import HostBuffers

    class LeanCheckpointer(base):
        def _allocate(self, nbytes: int) -> None:
            self._host = HostBuffers(0, 1, shm=False)
            self._host.nbytes = nbytes
            self._host.regions = [torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="w+", shape=(max(nbytes, 1),)))]
            self.stats.buffer_bytes = nbytes
    return LeanCheckpointer


if __name__ == "__main__":
    main()
