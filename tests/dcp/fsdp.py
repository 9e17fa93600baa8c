"""A tiny GPT trained with FSDP2 on CPU ranks (gloo), saving and loading through DCP: what tests/dcp runs in real
processes (``torch.multiprocessing`` spawn).  Every global batch depends on the step only and is split evenly over
the ranks, so runs at different world sizes train on the same data (their losses then agree to float tolerance;
at one world size bit for bit)."""
from __future__ import annotations

import json
import os
import socket
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

VOCAB, DIM, SEQ, BATCH = 64, 32, 16, 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def init(rank: int, world: int, port: int) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))


def finish() -> None:
    """Leave once every rank is done, without tearing gloo down (``leave_group`` says why)."""
    from flowcheck.demo.ranks import leave_group

    leave_group()


def build(world: int, mesh_shape: tuple[int, ...] | None = None):
    """(model, optimizer, scheduler): FSDP2 over all ranks (or a 2-D FSDP x TP mesh), AdamW, a step scheduler."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyGPT()
    if mesh_shape is None:
        mesh = init_device_mesh("cpu", (world,))
    else:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh2 = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        for b in model.blocks:
            parallelize_module(b, mesh2["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        mesh = mesh2["dp"]
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    return model, opt, sched


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    mine = data[rank * BATCH // world:(rank + 1) * BATCH // world]
    return mine[:, :-1], mine[:, 1:]


def train_step(model, opt, sched, step: int, dp_rank: int, dp: int) -> float:
    """One step on data-parallel rank ``dp_rank``'s share of the step's batch; the mean loss of the global batch."""
    x, y = batch(step, dp_rank, dp)
    loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return (total / dist.get_world_size()).item()


def state(model, opt, sched, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "sched": sched.state_dict(), "train": {"step": step}}


def restore(model, opt, sched, loaded: dict) -> int:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    sched.load_state_dict(loaded["sched"])
    return int(loaded["train"]["step"])


def dump(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


# ---- scenarios (spawned) ---------------------------------------------------------------------
def train_and_save(rank: int, world: int, port: int, cfg: str, k: int, n: int, fs_dir: str, out: str,
                   mesh_shape: tuple[int, ...] | None = None) -> None:
    """Train steps 1..n; after step k save through flowcheck and through DCP's FileSystemWriter."""
    import flowcheck.dcp

    init(rank, world, port)
    model, opt, sched = build(world, mesh_shape)
    tp = mesh_shape[1] if mesh_shape else 1  # TP ranks of one data-parallel group see the same batch
    losses = {}
    for step in range(1, n + 1):
        losses[step] = train_step(model, opt, sched, step, rank // tp, world // tp)
        if step == k:
            dcp.save(state(model, opt, sched, step), storage_writer=flowcheck.dcp.Writer(cfg, step=step))
            dcp.save(state(model, opt, sched, step), checkpoint_id=fs_dir)
    if rank == 0:
        dump(out, losses)
    finish()


def resume(rank: int, world: int, port: int, cfg: str, step: int | str, n: int, out: str) -> None:
    """Load a step through flowcheck.dcp.Reader at this world size and train on to n."""
    import flowcheck.dcp

    init(rank, world, port)
    model, opt, sched = build(world)
    loaded = state(model, opt, sched, 0)
    dcp.load(loaded, storage_reader=flowcheck.dcp.Reader(cfg, step=step))
    start = restore(model, opt, sched, loaded)
    losses = {s: train_step(model, opt, sched, s, rank, world) for s in range(start + 1, n + 1)}
    if rank == 0:
        dump(out, {"start": start, "losses": losses})
    finish()


def resume_async_save(rank: int, world: int, port: int, cfg: str, step: int, later: int, out: str) -> None:
    """Save a fresh model at step ``later`` (a newer state on main), then resume from ``step`` through the Reader at
    this world size, train one step and ``dcp.async_save`` it as step ``later + 1`` with ``parent=reader`` on its
    own gloo group; rank 0 records the committed manifest's parent."""
    import flowcheck.dcp

    init(rank, world, port)
    ckpt_group = dist.new_group(backend="gloo")
    model, opt, sched = build(world)
    # a newer state on main: it names step ``step`` as its parent (a fresh process that did not would start a root)
    dcp.save(state(model, opt, sched, 0), storage_writer=flowcheck.dcp.Writer(cfg, step=later, parent=step))
    reader = flowcheck.dcp.Reader(cfg, step=step)
    loaded = state(model, opt, sched, 0)
    dcp.load(loaded, storage_reader=reader)
    start = restore(model, opt, sched, loaded)
    train_step(model, opt, sched, start + 1, rank, world)
    writer = flowcheck.dcp.Writer(cfg, step=later + 1, parent=reader)
    dcp.async_save(state(model, opt, sched, start + 1), storage_writer=writer, process_group=ckpt_group).result()
    if rank == 0:
        parent = writer.committed.parent
        dump(out, {"start": start, "parent": [parent.step, parent.manifest_digest], "consumed": reader.resumed is None})
    finish()


def push_train(rank: int, world: int, port: int, node_url: str, cfg: str, k: int, n: int, out: str) -> None:
    """Train steps 1..n pushing every step to a node (flowcheck.torch.Checkpointer, DTensor state), then die (SIGKILL).
    After step k the ranks wait until the node's policy committed it to the local tier (so it is step k it commits,
    not a later one a loaded machine let arrive first)."""
    import signal
    import time

    from flowcheck.store import open_store
    from flowcheck.torch import Checkpointer

    init(rank, world, port)
    model, opt, sched = build(world)
    ck = Checkpointer(model, opt, sched, node=node_url, run="gpt", timeout_s=60)
    losses = {}
    for step in range(1, n + 1):
        losses[step] = train_step(model, opt, sched, step, rank, world)
        ck.save(step)
        if step == k:
            assert ck.flush(60), ck.stats.last_error
            deadline = time.monotonic() + 60
            while rank == 0 and k not in open_store(cfg).local.steps() and time.monotonic() < deadline:
                time.sleep(0.05)
            dist.barrier()
    assert ck.flush(60), ck.stats.last_error
    if rank == 0:
        dump(out, {"losses": losses, "stats": {"sent": ck.stats.sent, "failures": ck.stats.failures}})
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)  # the trainer dies: no close(), no goodbye


def resume_push(rank: int, world: int, port: int, cfg: str, n: int, out: str) -> None:
    """Load the latest pushed step through flowcheck.dcp.Reader at this world size and train on to n."""
    import flowcheck.dcp

    init(rank, world, port)
    model, opt, sched = build(world)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    loaded = {"model": msd, "optim": osd, "sched": sched.state_dict()}
    reader = flowcheck.dcp.Reader(cfg, step="latest", push_keys=flowcheck.dcp.PushKeys(lr_scheduler="sched"))
    dcp.load(loaded, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    sched.load_state_dict(loaded["sched"])
    start = reader.resumed.step
    losses = {s: train_step(model, opt, sched, s, rank, world) for s in range(start + 1, n + 1)}
    if rank == 0:
        dump(out, {"start": start, "losses": losses})
    finish()


FROZEN = ("tok.", "pos", "blocks.0.")  # a LoRA-like fine-tune: the embeddings and the first block frozen


def push_frozen(rank: int, world: int, port: int, node_url: str, n: int, pause_after: int, gates: str) -> None:
    """Train steps 1..n with the FROZEN parameters frozen (AdamW over the others), pushing every step to a node;
    after step ``pause_after`` wait for ``<gates>/go`` (the test restarts the node meanwhile).  Each rank dumps the
    payload bytes of every push, its buffer size and the bytes of its frozen pieces; rank 0 also the state as it
    should be stored (every tensor whole, optimizer slots named as the push names them)."""
    import time

    from flowcheck.torch import Checkpointer
    from flowcheck.torch.state import _flatten_optimizer, optimizer_param_names

    init(rank, world, port)
    torch.manual_seed(0)
    model = TinyGPT()
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(FROZEN))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    frozen = sum(p.to_local().numel() * p.element_size() for name, p in model.named_parameters()
                 if name.startswith(FROZEN))
    ck = Checkpointer(model, opt, sched, node=node_url, run="gpt", timeout_s=60, transport="tcp")
    sent = []
    for step in range(1, n + 1):
        train_step(model, opt, sched, step, rank, world)
        ck.save(step)
        assert ck.flush(60), ck.stats.last_error
        sent.append(ck.stats.last_sent_bytes)
        if step == pause_after:
            dist.barrier()
            if rank == 0:
                open(os.path.join(gates, "paused"), "w").close()
            while not os.path.exists(os.path.join(gates, "go")):
                time.sleep(0.05)
    dump(os.path.join(gates, f"rank{rank}.json"), {"sent": sent, "full": ck.stats.buffer_bytes, "frozen": frozen,
                                                     "resends": ck.stats.resends, "failures": ck.stats.failures})
    whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    tensors, _, _ = _flatten_optimizer(opt.state_dict(), optimizer_param_names(model, opt))
    whole.update({k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in tensors.items()})
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in whole.items()}, os.path.join(gates, "state.pt"))
    ck.close()
    finish()


def gated_writer(gate: str, die_rank: int | None = None):
    """A flowcheck Writer whose write_data waits for ``gate`` to exist (so a test sees the save in flight), and on
    ``die_rank`` dies (SIGKILL) right after its part is stored: a rank killed mid-save."""
    import signal
    import time

    import flowcheck.dcp

    class Gated(flowcheck.dcp.Writer):
        def write_data(self, plan, planner):
            while not os.path.exists(gate):
                time.sleep(0.01)
            done = super().write_data(plan, planner)
            if self.rank == die_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            return done

    return Gated


def async_save(rank: int, world: int, port: int, cfg: str, k: int, n: int, fs_dir: str, gate: str, out: str,
               die_rank: int | None = None, tier: str = "object") -> None:
    """Train; at step k ``dcp.async_save`` through a gated flowcheck Writer on its own gloo group, train on while it is
    in flight (rank 0 records what the store shows meanwhile), open the gate, wait for the save."""
    import time

    from flowcheck.store import open_store

    init(rank, world, port)
    ckpt_group = dist.new_group(backend="gloo")  # DCP's collectives run on the save thread: not the training group
    model, opt, sched = build(world)
    log: dict = {"losses": {}}
    fut = None
    for step in range(1, n + 1):
        log["losses"][step] = train_step(model, opt, sched, step, rank, world)
        if step == k:
            dcp.save(state(model, opt, sched, step), checkpoint_id=fs_dir)
            t0 = time.perf_counter()
            fut = dcp.async_save(state(model, opt, sched, step), process_group=ckpt_group,
                                 storage_writer=gated_writer(gate, die_rank)(cfg, step=step, tier=tier))
            log["blocked_s"] = time.perf_counter() - t0
        elif fut is not None and rank == 0 and "in_flight" not in log:
            log["in_flight"] = {"done": fut.done(), "steps": open_store(cfg).object.steps()}
    if rank == 0:
        with open(gate, "w"):
            pass
    try:
        fut.result()
        log["saved"] = True
    except Exception as e:  # noqa: BLE001 - a rank died: what the others saw
        log["saved"] = f"{type(e).__name__}: {e}"[:500]
    if rank == 0:
        log["after"] = open_store(cfg).object.steps()
        dump(out, log)
    if die_rank is None:
        finish()  # leaves the process
    else:  # a rank was killed: the others could never all count themselves out
        dist.destroy_process_group()


def spawn(fn, world: int, *args) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, join=True, start_method="spawn")


def full_state(loader) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, read in this one process (``loader``: a StorageReader)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    warnings.filterwarnings("ignore")
    out: dict = {}
    _load_state_dict(out, storage_reader=loader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return out
