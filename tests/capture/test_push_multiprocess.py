"""Several trainer processes (torch.distributed gloo, DDP) push to one node; a resumed trainer continues exactly."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from flowcheck.demo.ranks import leave_group
from flowcheck.store import open_store
from flowcheck.torch.checkpointer import Checkpointer

from .conftest import free_port
from .test_push_node import _expected, _model, _stored

STEPS = 3


def _trainer(rank: int, world: int, port: int, node_url: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model, opt = _model(seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    ck = Checkpointer(model, opt, node=node_url, run="gpt", timeout_s=30)
    assert ck.coords.dp == world and ck.coords.dp_rank == rank
    for step in range(1, STEPS + 1):
        loss = ddp(torch.randn(16, 32, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ck.save(step)
    assert ck.flush(30), ck.stats.last_error
    torch.save({"state": {k: torch.from_numpy(v) for k, v in _expected(model, opt).items()},
                "sent": ck.stats.buffer_bytes}, os.path.join(out, f"rank{rank}.pt"))
    ck.close()
    leave_group()


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_trainers_store_one_copy_bit_for_bit(node, tmp_path, world):
    mp.start_processes(_trainer, args=(world, free_port(), node.url, str(tmp_path)), nprocs=world, join=True,
                       start_method="spawn")
    node.wait_step(STEPS)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    want = {k: v.numpy() for k, v in ranks[0]["state"].items()}
    for r in ranks[1:]:  # DDP replicas are identical...
        assert all(np.array_equal(want[k], v.numpy()) for k, v in r["state"].items())
    got = _stored(node, STEPS)
    for name in want:
        assert np.array_equal(want[name], got[name]), name
    # ...so each replica's tensors were sent by one rank only (Checkpoint Razor)
    state_bytes = sum(v.nbytes for v in want.values())
    assert sum(r["sent"] for r in ranks) == state_bytes
    assert node.get("/status")["push"]["bytes"] == STEPS * state_bytes
    m = open_store(node.config).local.manifest(STEPS)
    assert m.source_layout.dp == world and "one data-parallel rank" in m.scalars["extra"]["push"]["dedup"]


def test_resume_from_a_stored_step_continues_bit_identically_and_forks_lineage(node):
    torch.manual_seed(7)
    model, opt = _model(seed=0)
    straight = []
    for _ in range(8):
        loss = model(torch.randn(16, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        straight.append(loss.item())

    torch.manual_seed(7)
    model, opt = _model(seed=0)
    ck = Checkpointer(model, opt, node=node.url, run="gpt")
    for step in range(1, 6):
        loss = model(torch.randn(16, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ck.save(step)
        assert ck.flush(20)
        if step in (3, 5):
            assert node.post("/snapshot")[0] == 200
    ck.close()
    # "the trainer died": a new process state (other weights, other RNG) resumes from step 3
    torch.manual_seed(999)
    model, opt = _model(seed=1)
    ck = Checkpointer(model, opt, node=node.url, run="gpt")
    assert ck.load(3, config=node.config) == 3
    resumed = []
    for step in range(4, 9):
        loss = model(torch.randn(16, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        resumed.append(loss.item())
        ck.save(step)
    assert ck.flush(20)
    ck.close()
    assert resumed == straight[3:]  # bit-identical losses
    node.wait_step(8)
    assert node.post("/snapshot")[0] == 200
    store = open_store(node.config)
    m8 = store.manifest(8, "local")  # on the current branch: the one the resumed trainer started
    branch = store.find(8, "local").branch
    assert branch != "main" and store.history().fork(branch).step == 3
    assert m8.parent.step == 3 and m8.parent.manifest_digest == store.local.manifest(3).digest()
    assert store.local.manifest(5).parent.step == 3  # step 3 now has two children: a fork
    assert store.manifest(5, "local", branch="main") == store.local.manifest(5)  # the abandoned 5 stays addressable
