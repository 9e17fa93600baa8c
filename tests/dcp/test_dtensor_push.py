"""An FSDP2 trainer pushes its DTensor state to a checkpoint node (flowcheck/torch/dtensor.py): 4 CPU ranks push every
step to a real ``flowcheck serve``, each its own piece of every sharded tensor at its global offset (plain tensors,
replicated on every rank, once), and die; the node's committed step then loads at 2 ranks through
``flowcheck.dcp.Reader`` and training goes on with the uninterrupted run's losses (to float tolerance: another
world size sums in another order)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from flowcheck.store import open_store
from tests.capture.conftest import NodeProcess, node_token  # noqa: F401 - the token every push suite runs with
from tests.dcp import fsdp

K, N = 3, 5  # the node commits step K (every_steps=K); the trainer pushes to N, dies; a resume trains K+1..N


def test_a_4_rank_fsdp2_trainer_pushes_dtensor_pieces_and_resumes_at_2_ranks_through_the_dcp_reader(tmp_path):
    node = NodeProcess(str(tmp_path), every_steps=K, part_timeout_s=60).start()
    try:
        with pytest.raises(torch.multiprocessing.ProcessExitedException, match="SIGKILL"):
            fsdp.spawn(fsdp.push_train, 4, node.url, node.config, K, N, str(tmp_path / "pushed.json"))
        pushed = json.loads((tmp_path / "pushed.json").read_text())
        assert pushed["stats"] == {"sent": N, "failures": 0}
        node.wait_step(N)
        store = open_store(node.config)
        assert store.local.steps() == [K]  # the policy's snapshot (every_steps=K); N is not a multiple of K
        m = store.local.manifest(K)
        w = m.tensors["blocks.0.fc1.weight"]  # sharded dim 0 over 4 ranks: four pieces at their global offsets
        assert w.global_shape == (4 * fsdp.DIM, fsdp.DIM) and sorted(s.offsets for s in w.shards) == [
            (0, 0), (32, 0), (64, 0), (96, 0)]
        assert len(m.tensors["optimizer.step.blocks.0.fc1.weight"].shards) == 1  # a plain replicated tensor: once
        assert m.source_layout.dp == 4
    finally:
        node.stop()
    fsdp.spawn(fsdp.resume_push, 2, node.config, N, str(tmp_path / "resumed.json"))
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["start"] == K
    for s in range(K + 1, N + 1):
        assert math.isclose(resumed["losses"][str(s)], pushed["losses"][str(s)], rel_tol=1e-5), (s, resumed, pushed)
