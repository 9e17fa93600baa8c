"""How fast the node takes a push, beside what the memory and the link allow, on the same bytes in one run.

A CPU trainer holding --gb of fp32 parameters (no optimizer: every byte is the push) pushes to a `flowcheck serve`
node on this host, --repeats times per transport, alternatives interleaved:
- shm: the node adopts the trainer's filled shared-memory segment as its RAM state (no copy).  Time = from the push
  frame sent to the node's ack (``stats.last_send_s``: the node checks the part and adopts the step); against
  ``np.copyto`` of the same bytes on one thread (the threads the node gives a push), a memcpy's time to move it.
  Goal: take speed >= 0.8x memcpy.
- tcp: the push streamed over loopback into the node's receive buffer (hashed there), time from frame sent to ack
  (the trainer hashes its payload first: ``last_send_s`` includes that too); against a plain socket stream of the same
  bytes between two processes (sendall -> recv_into a preallocated buffer).  Goal: >= 0.8x the plain stream.
Also: the node's RSS and the trainer's after each pass (the state twice on the host: the trainer's two segments, or
the trainer's buffer and the node's state + receive buffer).

  python benchmarks/bench_push_take.py --gb 4 --out push_take.json
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402
from bench_push import NodeProc  # noqa: E402

from flowcheck.torch.checkpointer import Checkpointer  # noqa: E402

CHUNK = 64 << 20


def _model(gb: float) -> torch.nn.Module:
    n = int(gb * 1e9) // 4 // 16
    model = torch.nn.Module()
    for i in range(16):
        model.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(n // 1024, 1024)))
    return model


def _push_times(node: NodeProc, model: torch.nn.Module, transport: str, repeats: int) -> list[float]:
    ck = Checkpointer(model, None, node=node.push, run="bench", transport=transport, timeout_s=600)
    times = []
    try:
        for step in range(1, repeats + 2):
            with torch.no_grad():
                next(model.parameters()).add_(1.0)  # a new step
            assert ck.save(step) and ck.flush(600), ck.stats.last_error
            if step > 1:  # the first push also allocates (and faults in) the host buffers
                times.append(ck.stats.last_send_s)
    finally:
        ck.close()
    return times


def _memcpy_times(nbytes: int, repeats: int) -> list[float]:
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    np.copyto(dst, src)  # fault both in
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out.append(time.perf_counter() - t0)
    return out


_RECEIVER = """
import socket, sys, numpy as np
n = int(sys.argv[1]); s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
buf = memoryview(np.empty(n, np.uint8)); conn, _ = s.accept()
while True:
    got = 0
    while got < n:
        r = conn.recv_into(buf[got:], min(n - got, 64 << 20))
        if not r: sys.exit(0)
        got += r
    conn.sendall(b"k")
"""


def _stream_times(nbytes: int, repeats: int) -> list[float]:
    """A plain loopback socket stream of ``nbytes`` into a preallocated buffer in another process, with a 1-byte ack."""
    proc = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(nbytes)], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    data = memoryview(np.ones(nbytes, np.uint8))
    out = []
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for at in range(0, nbytes, CHUNK):
                s.sendall(data[at:at + CHUNK])
            assert s.recv(1) == b"k"
            out.append(time.perf_counter() - t0)
    proc.wait(60)
    return out[1:]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=4.0, help="push size in GB (default 4)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--transports", default="shm,tcp")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model = _model(a.gb)
    nbytes = sum(t.numel() * 4 for t in model.parameters())
    result = {"bench": "push_take", "bytes": nbytes, "machine": c.machine(), "command": c.command(__file__, argv),
              "rows": {}}
    work = c.workdir("fc-push-take-")
    node = NodeProc(work)
    try:
        for transport in a.transports.split(","):
            base = _memcpy_times(nbytes, a.repeats) if transport == "shm" else _stream_times(nbytes, a.repeats)
            took = _push_times(node, model, transport, a.repeats)
            status = node.get("/status")
            med_base, med_took = statistics.median(base), statistics.median(took)
            result["rows"][transport] = {
                "push_s": took, "baseline": "memcpy 1 thread" if transport == "shm" else "plain socket stream",
                "baseline_s": base, "ratio": med_base / med_took, "goal": 0.8, "met": med_base / med_took >= 0.8,
                "node_rss_gb": node.ps.memory_info().rss / 1e9,
                "node_memory": {k: status["memory"][k] for k in ("bytes", "lent_bytes", "receive_buffer_bytes")},
                "adopted_segments": status["push"]["adopted_segments"]}
            print(f"{transport}: push taken in {med_took:.4f} s (median of {len(took)}), {result['rows'][transport]['baseline']} "
                  f"{med_base:.4f} s: {med_base / med_took:.2f}x (goal >= 0.8x); node RSS "
                  f"{result['rows'][transport]['node_rss_gb']:.2f} GB, memory {result['rows'][transport]['node_memory']}",
                  flush=True)
    finally:
        node.stop()
        c.rmtree(work)
    c.save_json(a.out, result)
    return result


if __name__ == "__main__":
    main()
