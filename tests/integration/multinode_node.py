"""One checkpoint node of a test cluster, as a real process: write its third of a step to a shared object store.

    python -m tests.integration.multinode_node --url URL --node n1 --nodes n0,n1,n2 --step 10 --work DIR
        [--barrier DIR] [--die-before-commit] [--wait SECONDS]

Prints one JSON line {"digest": ..., "won": bool}; exits 0 when the step is committed, 3 when it
stays incomplete (StepIncompleteError). ``--die-before-commit`` uploads the node's files, then kills
the process with SIGKILL right before its part manifest would be created. ``--barrier`` holds every
node after its part commit until all have committed theirs, so they race for the step manifest.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

from flowcheck.config import (
    ClusterConfig,
    Config,
    LocalConfig,
    ObjectConfig,
    TiersConfig,
)
from flowcheck.errors import StepIncompleteError
from flowcheck.state import Scalars, Shard, Snapshot, StateLayout, TensorSpec
from flowcheck.store import Store

RUN = "gpt"
ROWS = "decoder.layers.0.mlp.linear_fc2.weight"  # float32 [12, 8]: row blocks, one per node
COLS = "decoder.layers.0.mlp.linear_fc1.weight"  # float32 [6, 9]: column blocks, one per node
BIG = "decoder.layers.1.self_attention.linear_qkv.weight"  # float32 [768, 1024] (3 MiB): 1 MiB per node, files of 1 MiB
NORM = "decoder.final_layernorm.weight"  # bfloat16 [16]: all on one node
COUNT = "optimizer.step_count"  # int64 0-d: on another node
LAYOUT = StateLayout((
    TensorSpec(ROWS, "float32", (12, 8), "row"),
    TensorSpec(COLS, "float32", (6, 9), "column"),
    TensorSpec(BIG, "float32", (768, 1024), "qkv"),
    TensorSpec(NORM, "bfloat16", (16,)),
    TensorSpec(COUNT, "int64", ()),
))


def full_state(step: int) -> dict[str, np.ndarray]:
    """The whole training state of a step (what restore must give back bit for bit)."""
    rng = np.random.default_rng(step)
    return {
        ROWS: rng.standard_normal((12, 8)).astype(np.float32),
        COLS: rng.standard_normal((6, 9)).astype(np.float32),
        BIG: rng.standard_normal((768, 1024)).astype(np.float32),
        NORM: rng.integers(0, 1 << 16, 16, dtype=np.uint16),
        COUNT: np.array(step * 7, dtype=np.int64),
    }


def owned(nodes: list[str], node: str, shape_of=lambda n: LAYOUT.spec(n).shape) -> list[Shard]:
    """The shards a node owns: a third of each split tensor; NORM on the first node, COUNT on the second."""
    i, k = nodes.index(node), len(nodes)
    out = []
    for name, dim in ((ROWS, 0), (COLS, 1), (BIG, 0)):
        shape = shape_of(name)
        per = shape[dim] // k
        offsets = [0, 0]
        offsets[dim] = i * per
        box = list(shape)
        box[dim] = per
        out.append(Shard(name, tuple(offsets), tuple(box)))
    if i == 0:
        out.append(Shard(NORM, (0,), (16,)))
    if i == 1 % k:
        out.append(Shard(COUNT, (), ()))
    return out


def node_snapshot(step: int, nodes: list[str], node: str) -> Snapshot:
    state = full_state(step)
    data = {s: state[s.tensor][tuple(slice(o, o + n) for o, n in zip(s.offsets, s.shape))].copy()
            for s in owned(nodes, node)}
    return Snapshot(RUN, step, LAYOUT, data, Scalars(optimizer_step=step))


def node_config(url: str, node: str, nodes: list[str], work: str, wait_s: float) -> Config:
    return Config(
        run=RUN, node=node,
        tiers=TiersConfig(local=LocalConfig(root=os.path.join(work, node, "local")),
                          object=ObjectConfig(url=url, max_file_mib=1)),
        cluster=ClusterConfig(nodes=list(nodes), commit_wait_s=wait_s),
    )


def _instrument(args, won: list[bool]) -> None:
    """Fault injection and observation inside this process (the storage itself is real)."""
    from flowcheck.tiers import cluster
    from flowcheck.tiers.object import ObjectTier

    create = ObjectTier.create_exclusive

    def create_exclusive(self, rel, data, what="committing the manifest"):
        if args.die_before_commit and rel == cluster.part_manifest(args.step, args.node):
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9: files uploaded, part manifest never created
        create(self, rel, data, what)
        if rel.endswith("/manifest.json") and "/nodes/" not in rel:
            won.append(True)

    ObjectTier.create_exclusive = create_exclusive
    if args.barrier:
        commit = ObjectTier.wait_and_commit

        def wait_and_commit(tier, step):
            open(os.path.join(args.barrier, args.node), "w").close()
            while len(os.listdir(args.barrier)) < len(args.nodes):
                time.sleep(0.01)
            return commit(tier, step)

        ObjectTier.wait_and_commit = wait_and_commit


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--nodes", required=True, type=lambda s: s.split(","))
    p.add_argument("--step", required=True, type=int)
    p.add_argument("--work", required=True)
    p.add_argument("--barrier")
    p.add_argument("--die-before-commit", action="store_true")
    p.add_argument("--wait", type=float, default=60.0)
    args = p.parse_args(argv)
    won: list[bool] = []
    _instrument(args, won)
    store = Store(node_config(args.url, args.node, args.nodes, args.work, args.wait))
    try:
        m = store.write(node_snapshot(args.step, args.nodes, args.node), "object")
    except StepIncompleteError as e:
        print(json.dumps({"incomplete": str(e)}))
        return 3
    print(json.dumps({"digest": m.digest(), "won": bool(won)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
