"""Frozen parameters are pushed once: later pushes carry them as "kept" (no bytes) while the node's RAM state holds
them.  A node that restarted asks for them again; an unfrozen, changed-in-place or ``mark_changed`` parameter is sent
again; whatever the node stores is bit for bit what the trainer held."""
from __future__ import annotations

import socket

import numpy as np
import torch

from flowcheck.capture.push.auth import PushSigner
from flowcheck.demo.ranks import leave_group
from flowcheck.capture.push.wire import recv_header, send_frame
from flowcheck.torch import PushConfig
from flowcheck.torch.checkpointer import Checkpointer

from .conftest import NodeProcess
from .test_push_node import _stored


def _frozen_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The first (larger) layer frozen; the optimizer over the whole model (frozen parameters get no state)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))
    model[0].requires_grad_(False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, gen) -> None:
    model(torch.randn(8, 32, generator=gen)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _expected(model, opt) -> dict[str, np.ndarray]:
    from flowcheck.torch.state import _flatten_optimizer, optimizer_param_names

    out = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}
    tensors, _, _ = _flatten_optimizer(opt.state_dict(), optimizer_param_names(model, opt))
    out.update({k: v.detach().clone().numpy() for k, v in tensors.items()})
    return out


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _assert_stored(node, step, want) -> None:
    got = _stored(node, step)
    assert set(got) == set(want)
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def _push(ck, model, opt, gen, step) -> int:
    _step(model, opt, gen)
    ck.save(step)
    assert ck.flush(20), ck.stats.last_error
    return ck.stats.last_sent_bytes


def test_frozen_parameters_are_sent_once_and_the_node_keeps_them(node):
    model, opt = _frozen_model()
    gen = torch.Generator().manual_seed(1)
    frozen = _nbytes(model[0].weight, model[0].bias)
    with Checkpointer(model, opt, node=node.url, run="gpt", transport="tcp") as ck:
        sent = [_push(ck, model, opt, gen, step) for step in range(1, 5)]
        full = ck.stats.buffer_bytes
        assert sent == [full] + [full - frozen] * 3
        assert ck.stats.kept_bytes == 3 * frozen
    node.wait_step(4)
    status = node.get("/status")["push"]
    assert status["bytes"] == full + 3 * (full - frozen) and status["kept_bytes"] == 3 * frozen
    _assert_stored(node, 4, _expected(model, opt))


def test_skip_frozen_false_sends_every_tensor_every_save(node):
    model, opt = _frozen_model()
    gen = torch.Generator().manual_seed(5)
    config = PushConfig(node=node.url, run="gpt", transport="tcp", skip_frozen=False)
    with Checkpointer(model, opt, config=config) as ck:
        assert [_push(ck, model, opt, gen, step) for step in (1, 2, 3)] == [ck.stats.buffer_bytes] * 3
        assert ck.stats.kept_bytes == 0
    node.wait_step(3)
    _assert_stored(node, 3, _expected(model, opt))


def test_shared_memory_pushes_skip_frozen_parameters_too(node):
    model, opt = _frozen_model()
    gen = torch.Generator().manual_seed(2)
    with Checkpointer(model, opt, node=node.url, run="gpt", transport="shm") as ck:
        sent = [_push(ck, model, opt, gen, step) for step in range(1, 4)]
        assert sent[1:] == [ck.stats.buffer_bytes - _nbytes(model[0].weight, model[0].bias)] * 2
    node.wait_step(3)
    _assert_stored(node, 3, _expected(model, opt))


def test_a_restarted_node_is_sent_the_frozen_parameters_again(tmp_path):
    node = NodeProcess(str(tmp_path)).start()
    try:
        model, opt = _frozen_model()
        gen = torch.Generator().manual_seed(3)
        ck = Checkpointer(model, opt, node=node.url, run="gpt", transport="tcp", timeout_s=5)
        _push(ck, model, opt, gen, 1)
        assert _push(ck, model, opt, gen, 2) < ck.stats.buffer_bytes
        node.kill()
        node.start()  # same ports, empty RAM: it must not take "kept" shards it never received
        assert _push(ck, model, opt, gen, 3) == ck.stats.buffer_bytes
        assert ck.stats.resends == 1 and node.get("/status")["push"]["resends_asked"] == 1
        node.wait_step(3)
        _assert_stored(node, 3, _expected(model, opt))
        assert _push(ck, model, opt, gen, 4) < ck.stats.buffer_bytes  # the new node state holds them now
        node.wait_step(4)
        _assert_stored(node, 4, _expected(model, opt))
        ck.close()
    finally:
        node.stop()


def test_unfrozen_and_changed_frozen_parameters_are_sent_again(node):
    model, opt = _frozen_model()
    gen = torch.Generator().manual_seed(4)
    w, b = model[0].weight, model[0].bias
    full_frozen = _nbytes(w, b)
    with Checkpointer(model, opt, node=node.url, run="gpt", transport="tcp") as ck:
        _push(ck, model, opt, gen, 1)
        full = ck.stats.buffer_bytes
        assert _push(ck, model, opt, gen, 2) == full - full_frozen
        with torch.no_grad():
            w.mul_(0.5)  # an in-place op bumps the version counter: sent again, once
        assert _push(ck, model, opt, gen, 3) == full - _nbytes(b)
        assert _push(ck, model, opt, gen, 4) == full - full_frozen
        node.wait_step(4)
        _assert_stored(node, 4, _expected(model, opt))
        w.data[0, 0] = 123.0  # a .data write is invisible to the version counter: the user says so
        ck.mark_changed("0.weight")
        assert _push(ck, model, opt, gen, 5) == full - _nbytes(b)
        node.wait_step(5)
        _assert_stored(node, 5, _expected(model, opt))
        b.requires_grad_(True)  # staged unfreezing: sent every step from now on; its AdamW state appears later
        _push(ck, model, opt, gen, 6)
        assert ck.stats.buffer_bytes > full  # the optimizer state of the unfrozen bias is new: a new layout
        assert _push(ck, model, opt, gen, 7) == ck.stats.buffer_bytes - _nbytes(w)
    node.wait_step(7)
    _assert_stored(node, 7, _expected(model, opt))


def test_a_node_without_that_state_refuses_kept_shards_and_asks_for_the_part_again(node, node_token):
    """A push naming a node state this node does not hold is answered ``resend``; nothing of it is applied."""
    spec = {"name": "w", "dtype": "float32", "shape": [4], "role": "replicated"}
    with socket.create_connection(("127.0.0.1", node.push_port), timeout=10) as sock:
        signer = PushSigner.handshake(sock, node_token, "gpt", "node")
        assert signer.hello.get("kept_shards") is True
        header = {"kind": "push", "run": "gpt", "step": 1, "sender": 0, "senders": 1, "tensors": [spec],
                  "shards": [{"tensor": "w", "offsets": [0], "shape": [4], "at": 0, "kept": True}],
                  "scalars": {}, "parent": None, "base": "made-up", "payload": {"bytes": 16, "digest": "xxh3-128:0"}}
        send_frame(sock, signer.sign(header))
        answer = recv_header(sock)
    assert answer["kind"] == "error" and answer["reason"] == "resend", answer
    assert "holds no state" in answer["message"]
    assert node.get("/status")["memory"]["step"] is None


def _dp_trainer(rank: int, world: int, port: int, node_url: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model, _ = _frozen_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    ck = Checkpointer(model, opt, node=node_url, run="gpt", timeout_s=30, transport="tcp")
    sent = []
    for step in range(1, 4):
        ddp(torch.randn(8, 32, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ck.save(step)
        assert ck.flush(30), ck.stats.last_error
        sent.append(ck.stats.last_sent_bytes)
    torch.save({"state": {k: torch.from_numpy(v) for k, v in _expected(model, opt).items()}, "sent": sent,
                "full": ck.stats.buffer_bytes}, f"{out}/rank{rank}.pt")
    ck.close()
    leave_group()


def test_data_parallel_ranks_keep_their_share_of_the_frozen_parameters(node, tmp_path):
    import torch.multiprocessing as mp

    from .conftest import free_port

    mp.start_processes(_dp_trainer, args=(2, free_port(), node.url, str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    node.wait_step(3)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    # each rank sends its share whole once, then less; together, after the first step, the state less the frozen layer
    frozen = 256 * 32 * 4 + 256 * 4
    assert [r["sent"][0] for r in ranks] == [r["full"] for r in ranks]
    assert sum(r["sent"][2] for r in ranks) == sum(r["full"] for r in ranks) - frozen
    _assert_stored(node, 3, {k: v.numpy() for k, v in ranks[0]["state"].items()})


def test_a_node_that_does_not_offer_kept_shards_gets_every_shard(tmp_path, node_token):
    """A node from before kept shards (its hello offers none, its acks name no state) is sent everything, every save."""
    import time

    from flowcheck.node.receiver import PushReceiver
    from flowcheck.store import open_store

    class OlderNode(PushReceiver):
        offers_kept = False

    store = open_store(NodeProcess(str(tmp_path)).config)
    receiver = OlderNode(store, part_timeout_s=10, token=node_token).start()
    model, opt = _frozen_model()
    gen = torch.Generator().manual_seed(6)
    try:
        with Checkpointer(model, opt, node=f"tcp://127.0.0.1:{receiver.address[1]}", run="gpt", transport="tcp") as ck:
            sent = [_push(ck, model, opt, gen, step) for step in (1, 2, 3)]
            assert sent == [ck.stats.buffer_bytes] * 3 and ck.stats.kept_bytes == 0
        deadline = time.monotonic() + 10
        while store.memory.step != 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        want = _expected(model, opt)
        for name, arr in want.items():
            assert np.array_equal(store.memory.read(3, name), arr), name
    finally:
        receiver.close()


def test_a_stale_node_state_asks_for_the_kept_shards_again_and_is_replaced_whole(tmp_path, node_token):
    """A RAM state marked stale (a failed update) cannot vouch for kept shards: the node asks for the whole part,
    which then replaces the stale state (received into the buffer of a state gone before: no third state in RAM),
    and the state is fresh again."""
    import time

    from flowcheck.node.receiver import PushReceiver
    from flowcheck.store import open_store

    store = open_store(NodeProcess(str(tmp_path)).config)
    receiver = PushReceiver(store, part_timeout_s=10, token=node_token).start()
    model, opt = _frozen_model()
    gen = torch.Generator().manual_seed(7)
    frozen = _nbytes(model[0].weight, model[0].bias)

    def until_step(step: int) -> None:
        deadline = time.monotonic() + 10
        while store.memory.step != step and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.memory.step == step

    try:
        with Checkpointer(model, opt, node=f"tcp://127.0.0.1:{receiver.address[1]}", run="gpt", transport="tcp") as ck:
            full = _push(ck, model, opt, gen, 1)
            assert _push(ck, model, opt, gen, 2) == full - frozen
            until_step(2)
            store.memory.mark_stale("test: an update failed")
            assert _push(ck, model, opt, gen, 3) == full  # asked again, whole
            assert ck.stats.resends == 1 and receiver.stats.resends_asked == 1
            until_step(3)
            assert not store.memory.stale
            assert receiver.pool.lent_bytes + receiver.pool.pooled_bytes <= 2 * ck.stats.buffer_bytes
            assert _push(ck, model, opt, gen, 4) == full - frozen  # and kept again from then on
            until_step(4)
        want = _expected(model, opt)
        for name, arr in want.items():
            assert np.array_equal(store.memory.read(4, name), arr), name
    finally:
        receiver.close()


def _model_with_buffers(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The frozen model plus two buffers: a constant (rotary ``inv_freq``-like) and an EMA copy of the last layer."""
    model, opt = _frozen_model(seed)
    model.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)))
    model.register_buffer("ema", model[2].weight.detach().clone())
    return model, opt


def test_unchanged_buffers_are_kept_and_any_change_even_through_data_is_sent(node):
    model, opt = _model_with_buffers()
    gen = torch.Generator().manual_seed(8)
    frozen = _nbytes(model[0].weight, model[0].bias)
    inv, ema = _nbytes(model.inv_freq), _nbytes(model.ema)
    with Checkpointer(model, opt, node=node.url, run="gpt", transport="tcp") as ck:
        full = _push(ck, model, opt, gen, 1)
        assert _push(ck, model, opt, gen, 2) == full - frozen - inv - ema  # neither buffer changed
        with torch.no_grad():
            model.ema.mul_(0.9).add_(model[2].weight, alpha=0.1)  # an EMA update: in place
        assert _push(ck, model, opt, gen, 3) == full - frozen - inv
        model.ema.data[0, 0] += 1.0  # a .data write: no version bump, and still seen (the bytes are compared)
        model.inv_freq.data[-1] = 0.5
        assert _push(ck, model, opt, gen, 4) == full - frozen
        node.wait_step(4)
        _assert_stored(node, 4, _expected(model, opt))
        assert _push(ck, model, opt, gen, 5) == full - frozen - inv - ema
        assert ck.stats.kept_bytes == 4 * frozen + 2 * (inv + ema) + inv  # steps 2-5; 2, 5; 3
    node.wait_step(5)
    _assert_stored(node, 5, _expected(model, opt))


def test_skip_unchanged_buffers_false_sends_buffers_every_save(node):
    model, opt = _model_with_buffers()
    gen = torch.Generator().manual_seed(9)
    frozen = _nbytes(model[0].weight, model[0].bias)
    config = PushConfig(node=node.url, run="gpt", transport="tcp", skip_unchanged_buffers=False)
    with Checkpointer(model, opt, config=config) as ck:
        full = _push(ck, model, opt, gen, 1)
        assert [_push(ck, model, opt, gen, step) for step in (2, 3)] == [full - frozen] * 2
    node.wait_step(3)
    _assert_stored(node, 3, _expected(model, opt))


def test_a_restarted_node_is_sent_the_unchanged_buffers_again(tmp_path):
    node = NodeProcess(str(tmp_path)).start()
    try:
        model, opt = _model_with_buffers()
        gen = torch.Generator().manual_seed(10)
        with Checkpointer(model, opt, node=node.url, run="gpt", transport="shm", timeout_s=5) as ck:
            full = _push(ck, model, opt, gen, 1)
            kept = full - _nbytes(model[0].weight, model[0].bias, model.inv_freq, model.ema)
            assert _push(ck, model, opt, gen, 2) == kept
            node.kill()
            node.start()
            assert _push(ck, model, opt, gen, 3) == full and ck.stats.resends == 1
            assert _push(ck, model, opt, gen, 4) == kept
            node.wait_step(4)
            _assert_stored(node, 4, _expected(model, opt))
    finally:
        node.stop()
