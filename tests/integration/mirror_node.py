"""One checkpoint node of a scaled-out mirror capture, as a real process: `flowcheck serve`'s Node replays the
captures, updates its part of the parameters, and at the end persists its newest step (its cluster part).

    python -m tests.integration.mirror_node --config node.yaml

Prints one JSON line {"mirror": the node's mirror status (placed_bytes, iterations, ...), "step": the committed
step's number or null}; exits 0 when the step is committed, 3 when it stays incomplete (StepIncompleteError),
4 when the mirror capture failed, 5 when the node's state is stale (no snapshot of it is taken).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from flowcheck import config as config_mod
from flowcheck.errors import StaleStateError, StepIncompleteError
from flowcheck.node.service import Node


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    args = p.parse_args(argv)
    node = Node(config_mod.load(args.config)).start()
    try:
        deadline = time.time() + 240
        while (node.mirror is None or node.mirror["state"] == "running") and time.time() < deadline:
            time.sleep(0.1)
        if node.mirror is None or node.mirror["state"] != "done":
            print(json.dumps({"mirror": node.mirror, "step": None}))
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
