"""Live capture on a veth pair: per-frame recvmsg vs the PACKET_MMAP TPACKET_V3 ring (1 and K fanout workers).

Needs root and iproute2 (two network namespaces joined by a veth pair are created and removed).  A sender
process in one namespace sends --frames RoCEv2 frames of ~1 KiB as fast as it can (a raw socket, one send each);
a reader process in the other captures them with ``live_frames``.  Reported per reader: frames received, distinct
sender sequence numbers among them (``delivered``: their share of what was sent), the kernel's drops, and the
reader process's CPU seconds after its imports (user + system, from its rusage) per million frames received —
the cost of capture itself, which the ring is meant to cut.  The sender, not the link, sets the rate: a Python sender reaches a few hundred thousand
frames per second on this machine, far under a 100 Gb/s mirror; that the ring costs less CPU per frame is what
this shows, not line rate.

    sudo python benchmarks/bench_mirror_live.py --frames 300000 --out /tmp/live.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid

READER = r"""
import json, resource, sys, time
from flowcheck.capture.mirror.live import live_frames
from flowcheck.capture.mirror.packet_ring import RingConfig
mode, want = sys.argv[1], int(sys.argv[2])
ring = None if mode == "recvmsg" else RingConfig(block_size=1 << 22, block_count=32, block_timeout_ms=5,
                                                  workers=int(mode.split("-")[1]))
import numpy as np
got, drops, seqs = 0, [], []
t0, quiet = None, 0
def cpu():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime
c0 = cpu()  # after the imports: only capture is charged
open(sys.argv[3], "w").close()  # ready
for batch in live_frames("fcrx0", duration_s=float(sys.argv[4]), idle=True, on_drops=drops.append, ring=ring,
                         batch=4096):
    if len(batch) and t0 is None:
        t0 = time.perf_counter()
    got += len(batch)
    quiet = quiet + 1 if not len(batch) and t0 is not None else 0
    if len(batch):  # the sender's sequence number: 3 bytes 12 before each frame's end
        at = batch.offsets + batch.lengths - 12
        buf = np.frombuffer(batch.buf, np.uint8)
        seqs.append(buf[at] | buf[at + 1].astype(np.int64) << 8 | buf[at + 2].astype(np.int64) << 16)
    if got >= want or quiet > 20:  # everything, or a second without frames after the burst
        break
wall = time.perf_counter() - (t0 or time.perf_counter())
distinct = len(np.unique(np.concatenate(seqs))) if seqs else 0
print(json.dumps({"mode": mode, "received": got, "distinct": distinct, "drops": sum(drops), "cpu_s": cpu() - c0,
                  "wall_s": wall}))
"""

SENDER = r"""
import socket, sys, time
from flowcheck.capture.mirror.frames import Endpoint, write_frames
a = Endpoint("02:fc:5e:00:00:01", "fe80::fc:5eff:fe00:1")
b = Endpoint("02:fc:5e:00:00:02", "fe80::fc:5eff:fe00:2")
frames = []
for qp in range(8):  # 8 flows (QPs, UDP source ports): what fanout spreads
    frames += write_frames(a, b, sport=49152 + qp, dqpn=0x100 + qp, psn=0, va=0x1000, data=bytes(1024 * 64),
                           imm=65536, mtu=1024)
n = int(sys.argv[1])
with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
    s.bind(("fctx0", 0))
    t0 = time.perf_counter()
    for k in range(n):
        f = bytearray(frames[k % len(frames)])
        f[-12:-9] = k.to_bytes(3, "little")  # a sequence number (in the payload; the ICRC is not checked here)
        s.send(f)
    print(n / (time.perf_counter() - t0))
"""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def run_one(rx: str, tx: str, mode: str, frames: int) -> dict:
    ready = f"/tmp/fc-live-ready-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    reader = subprocess.Popen(["ip", "netns", "exec", rx, sys.executable, "-c", READER, mode, str(frames), ready, "60"],
                              stdout=subprocess.PIPE, text=True, env=env)
    while not os.path.exists(ready):
        time.sleep(0.05)
    time.sleep(0.5)
    sent = subprocess.run(["ip", "netns", "exec", tx, sys.executable, "-c", SENDER, str(frames)], capture_output=True,
                          text=True, env=env, check=True)
    out, _ = reader.communicate(timeout=120)  # it stops once it has everything or after a quiet second
    os.unlink(ready)
    lines = [x for x in out.splitlines() if x.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"mode": mode, "received": None}
    result["sent"], result["send_rate_fps"] = frames, float(sent.stdout.strip())
    if result.get("received"):
        result["cpu_s_per_mframe"] = result["cpu_s"] / result["received"] * 1e6
        result["delivered"] = result["distinct"] / frames
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=300_000)
    p.add_argument("--modes", default="recvmsg,ring-1,ring-2")
    p.add_argument("--out")
    args = p.parse_args()
    tag = uuid.uuid4().hex[:6]
    rx, tx = f"fcb-rx-{tag}", f"fcb-tx-{tag}"
    made = []
    try:
        for ns in (rx, tx):
            ip("netns", "add", ns)
            made.append(ns)
        ip("link", "add", "fcrx0", "netns", rx, "type", "veth", "peer", "name", "fctx0", "netns", tx)
        ip("-n", rx, "link", "set", "fcrx0", "up")
        ip("-n", tx, "link", "set", "fctx0", "up")
        results = [run_one(rx, tx, m, args.frames) for m in args.modes.split(",")]
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for r in results:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"load": os.getloadavg(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
