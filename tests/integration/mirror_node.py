"""One checkpoint node of a scaled-out mirror capture, as a real process: `flowcheck serve`'s Node replays the
captures, updates its part of the parameters, and at the end persists its newest step (its cluster part).

    python -m tests.integration.mirror_node --config node.yaml [--until-step N --ready FILE]

Prints one JSON line {"mirror": the node's mirror status (placed_bytes, iterations, ...), "step": the committed
step's number or null}; exits 0 when the step is committed, 3 when it stays incomplete (StepIncompleteError),
4 when the mirror capture failed, 5 when the node's state is stale (no snapshot of it is taken).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from flowcheck import config as config_mod
from flowcheck.errors import StaleStateError, StepIncompleteError
from flowcheck.node.service import Node


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--until-step", type=int, help="live capture: persist once RAM holds this step (the capture "
                                                   "runs until the node stops)")
    p.add_argument("--ready", help="live capture: create this file once the node has counted a frame")
    p.add_argument("--deadline", type=float, default=240.0, help="seconds to wait for the capture")
    args = p.parse_args(argv)
    node = Node(config_mod.load(args.config)).start()
    try:
        deadline = time.time() + args.deadline
        if args.until_step is not None:
            while node.store.memory.step != args.until_step and time.time() < deadline:
                if args.ready and node.mirror_stats.frames and not os.path.exists(args.ready):
                    open(args.ready, "w").close()
                if node.mirror is not None and node.mirror["state"] == "failed":
                    break
                time.sleep(0.05)
            if node.mirror is not None:
                node.mirror.update(placed_bytes=node.mirror_info.placed_bytes if node.mirror_info else None,
                                   iterations=node.mirror_report.iterations if node.mirror_report else None,
                                   stale=len(node.mirror_report.stale) if node.mirror_report else None)
        while (node.mirror is None or node.mirror["state"] == "running") and time.time() < deadline \
                and args.until_step is None:
            time.sleep(0.1)
        ok = node.store.memory.step == args.until_step if args.until_step is not None else \
            node.mirror is not None and node.mirror["state"] == "done"
        if not ok:
            report = node.mirror_report
            print(json.dumps({"mirror": node.mirror, "step": None, "memory_step": node.store.memory.step,
                              "frames": node.mirror_stats.frames, "dropped": node.mirror_stats.frames_dropped,
                              "stale": [s.to_json() for s in report.stale] if report else None}, default=str))
            return 4
        node.policy.drain()
        try:
            local = node.policy.snapshot_now()  # the newest step to this node's local tier
        except StaleStateError as e:
            print(json.dumps({"mirror": node.mirror, "step": None, "stale": str(e)}))
            return 5
        try:
            m = node.store.promote(local.step)  # its part to the object tier, then the cluster commit
        except StepIncompleteError as e:
            print(json.dumps({"mirror": node.mirror, "step": None, "incomplete": str(e)}))
            return 3
        print(json.dumps({"mirror": node.mirror, "step": m.step, "nodes": [n.node for n in m.nodes]}))
        return 0
    finally:
        node.stop()


if __name__ == "__main__":
    sys.exit(main())
