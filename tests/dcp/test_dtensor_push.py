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


def test_fsdp2_ranks_keep_their_frozen_pieces_are_asked_again_by_a_restarted_node_and_restore_bit_exact(tmp_path):
    """2 FSDP2 ranks, the embeddings and the first block frozen: each rank sends its frozen DTensor pieces once, then
    only the trainable ones (and their AdamW state; the frozen ones have none); the node is killed and restarted
    after step 2 — empty RAM — so step 3's pushes are answered ``resend`` and sent whole; from step 4 on the
    frozen pieces are kept again; the stored step 5 is bit for bit the trainer's state."""
    import time

    import numpy as np
    import torch.multiprocessing as mp

    from tests.capture.test_push_node import _stored

    node = NodeProcess(str(tmp_path), part_timeout_s=60).start()
    gates = tmp_path / "gates"
    gates.mkdir()
    try:
        ctx = mp.start_processes(fsdp.push_frozen, args=(2, fsdp.free_port(), node.url, 5, 2, str(gates)), nprocs=2,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + 300
        while not (gates / "paused").exists():
            assert time.monotonic() < deadline and not ctx.join(0.1), "the ranks never reached the pause"
        node.kill()
        node.start()  # same ports, empty RAM: it must not take "kept" pieces it never received
        (gates / "go").touch()
        while not ctx.join(1):
            assert time.monotonic() < deadline, "the ranks did not finish"
        ranks = [json.loads((gates / f"rank{r}.json").read_text()) for r in range(2)]
        for r in ranks:
            assert r["frozen"] > 0 and r["failures"] == 0 and r["resends"] == 1, r
            full, kept = r["full"], r["full"] - r["frozen"]
            assert r["sent"] == [full, kept, full, kept, kept], r
        assert node.get("/status")["push"]["resends_asked"] == 2
        want = torch.load(gates / "state.pt", weights_only=True)
        assert not any(k.startswith("optimizer.") and k.split(".", 2)[2].startswith(fsdp.FROZEN) for k in want)
        got = _stored(node, 5)
        assert set(got) == set(want)
        for name, t in want.items():
            assert np.array_equal(got[name], t.numpy()), name
    finally:
        node.stop()
