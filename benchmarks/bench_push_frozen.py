"""Issue 20, trainer side: a LoRA trainer's push and the node's snapshot per step, frozen parameters kept vs sent.

A frozen GPT (the demo's model, --hidden wide, --layers deep) + rank-8 adapters on every attention projection, AdamW
over the adapters only, one torch thread.  Two `flowcheck serve` node processes on this host, one per alternative,
fed step by step in turn (ABAB: a drifting machine favours neither):
  kept: PushConfig(skip_frozen=True) (the default) — frozen parameters sent once, then carried as kept shards; the
        node writes only the changed shards into RAM and its snapshot hashes only those (tiers/memory.py digests);
  full: PushConfig(skip_frozen=False, skip_unchanged_buffers=False) — every tensor every save, as before issue 20's
        trainer side: the node rewrites every shard and its snapshot hashes the whole state.
  buffers_sent (only with --ema-mib): frozen parameters kept, buffers sent every save (skip_unchanged_buffers=False,
        as before buffers were compared).  --ema-mib registers a buffer of that size that never changes (a frozen EMA
        / teacher copy): "kept" compares it with the bytes the node holds on the side thread and sends it as kept.
Per step (after the first, a full push either way): payload bytes pushed, seconds of save() + flush() (the push to the
node's ack), seconds of the node's POST /snapshot (local tier, fsync on), bytes that snapshot wrote.  Medians; ratios
full / kept.  TCP transport (over shared memory the node reads the segment in place; bytes are the same).

  python benchmarks/bench_push_frozen.py --hidden 512 --layers 4 --steps 20 [--ema-mib 32]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch

from flowcheck.demo.lora import lora_gpt as demo_lora_gpt
from flowcheck.demo.model import CHARS, CONTEXT, batches, data
from flowcheck.node.client import control_request
from flowcheck.restore.arch import ModelArch
from flowcheck.store import open_store
from flowcheck.torch import Checkpointer, PushConfig

def lora_gpt(hidden: int, layers: int):
    return demo_lora_gpt(ModelArch(num_layers=layers, hidden_size=hidden, num_attention_heads=8, vocab_size=len(CHARS),
                                   ffn_hidden_size=4 * hidden, max_position_embeddings=CONTEXT,
                                   make_vocab_size_divisible_by=4))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    def __init__(self, root: str) -> None:
        self.push, self.http = free_port(), free_port()
        self.config = os.path.join(root, "node.yaml")
        with open(self.config, "w") as f:
            f.write(f"run: lora\ntiers:\n  local:\n    root: {root}/local\n  object:\n    url: file://{root}/object\n"
                    "policy:\n  local:\n    every_steps: 1000000\n  object:\n    every_seconds: null\n"
                    f"serve:\n  push: 127.0.0.1:{self.push}\n  http: 127.0.0.1:{self.http}\n")
        self.log = open(os.path.join(root, "node.log"), "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "flowcheck", "serve", "--config", self.config],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.request("GET", "/status")
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("node did not start") from None
                time.sleep(0.2)

    def request(self, method: str, path: str) -> dict:
        req = control_request(f"http://127.0.0.1:{self.http}{path}", method, token=os.environ.get("FLOWCHECK_NODE_TOKEN"))
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def wait_step(self, step: int) -> None:
        while self.request("GET", "/status")["memory"]["step"] != step:
            time.sleep(0.01)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ema-mib", type=float, default=0, help="a constant buffer of this size (a frozen EMA copy)")
    ap.add_argument("--dir", default=None, help="where the two nodes' stores go (default: a temporary folder)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="bench-push-frozen-", dir=args.dir)
    tokens = data()
    alts = {}
    try:
        plan = [("kept", True, True), ("full", False, False)] + ([("buffers_sent", True, False)] if args.ema_mib else [])
        for name, skip, skip_buffers in plan:
            os.makedirs(os.path.join(root, name))
            node = Node(os.path.join(root, name))
            model, opt = lora_gpt(args.hidden, args.layers)
            if args.ema_mib:
                model.register_buffer("ema", torch.randn(int(args.ema_mib * 2**20) // 4))
            ck = Checkpointer(model, opt, config=PushConfig(node=f"tcp://127.0.0.1:{node.push}", run="lora",
                                                            transport="tcp", skip_frozen=skip, timeout_s=120,
                                                            skip_unchanged_buffers=skip_buffers))
            alts[name] = {"node": node, "model": model, "opt": opt, "ck": ck, "store": open_store(node.config),
                          "push_s": [], "push_bytes": [], "snap_s": [], "snap_bytes": []}
        names = list(alts)
        for step in range(1, args.steps + 1):
            for name in names[step % len(names):] + names[:step % len(names)]:  # rotated: drift favours none
                a = alts[name]
                x, y = batches(tokens)
                logits = a["model"](x)
                torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
                a["opt"].step()
                a["opt"].zero_grad()
                t0 = time.perf_counter()
                a["ck"].save(step)
                assert a["ck"].flush(120), a["ck"].stats.last_error
                push_s = time.perf_counter() - t0
                a["node"].wait_step(step)
                t0 = time.perf_counter()
                a["node"].request("POST", "/snapshot")
                snap_s = time.perf_counter() - t0
                if step > 1:
                    a.setdefault("copy_s", []).append(a["ck"].stats.last_copy_s)
                    a["push_s"].append(push_s)
                    a["push_bytes"].append(a["ck"].stats.last_sent_bytes)
                    a["snap_s"].append(snap_s)
                    a["snap_bytes"].append(a["store"].local.manifest(step).nbytes)
        out = {"state_bytes": alts["kept"]["ck"].stats.buffer_bytes, "steps": args.steps}
        for name, a in alts.items():
            out[name] = {k: statistics.median(a[k]) for k in ("push_s", "copy_s", "push_bytes", "snap_s", "snap_bytes")}
        for other in names[1:]:
            out[f"ratio_{other}_over_kept"] = {k: out[other][k] / out["kept"][k] for k in out["kept"]}
        print(json.dumps(out, indent=2))
    finally:
        for a in alts.values():
            a["ck"].close()
            a["node"].stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
