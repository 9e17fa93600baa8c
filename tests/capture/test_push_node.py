"""Trainer Checkpointer -> `flowcheck serve` node in another process: bit-exact, never torn, never partial."""
from __future__ import annotations

import contextlib
import dataclasses
import socket
import time

import numpy as np
import pytest
import torch

from flowcheck.capture.push.auth import PushSigner
from flowcheck.capture.push.wire import recv_header, send_frame
from flowcheck.store import open_store
from flowcheck.torch.checkpointer import Checkpointer
from tests.helpers import trainer_state

from .conftest import NodeProcess


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model, opt, gen) -> float:
    x = torch.randn(16, 32, generator=gen)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


_expected = trainer_state


def _stored(node: NodeProcess, step: int) -> dict[str, np.ndarray]:
    node.wait_step(step)  # a part is acked once it is in; the step is published just after (a whole state: hashed)
    status, body = node.post("/snapshot")
    assert status == 200 and body["step"] == step, body
    store = open_store(node.config)
    m = store.local.manifest(step)
    return {n: store.local.read(step, n) for n in m.tensors}


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_pushed_state_reaches_ram_and_local_tier_bit_for_bit(node, transport):
    model, opt = _model()
    gen = torch.Generator().manual_seed(1)
    with Checkpointer(model, opt, node=node.url, run="gpt", transport=transport, timeout_s=20) as ck:
        for step in range(1, 6):
            _train_step(model, opt, gen)
            assert ck.save(step)
        assert ck.flush(20), ck.stats.last_error
    node.wait_step(5)
    want, got = _expected(model, opt), _stored(node, 5)
    assert set(want) == set(got)
    for name in want:
        assert np.array_equal(want[name], got[name]), name


def test_no_torn_snapshot_when_parameters_change_right_after_wait(node):
    model, opt = _model()
    gen = torch.Generator().manual_seed(2)
    _train_step(model, opt, gen)
    ck = Checkpointer(model, opt, node=node.url, run="gpt", transport="shm")
    before = _expected(model, opt)
    ck.save(1)
    ck.wait()  # the only blocking point: after it the trainer may change everything
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    for state in opt.state.values():
        state["exp_avg"].mul_(-3.0)
    assert ck.flush(20), ck.stats.last_error
    ck.close()
    got = _stored(node, 1)
    for name in before:
        assert np.array_equal(before[name], got[name]), name


def test_the_optimizer_hook_makes_step_wait_for_the_copy(node):
    model, opt = _model()
    ck = Checkpointer(model, opt, node=node.url, run="gpt")
    gen = torch.Generator().manual_seed(3)
    _train_step(model, opt, gen)
    ck.save(1)
    _train_step(model, opt, gen)  # optimizer.step() runs the hook: wait() before any parameter changes
    assert ck._job.copied.is_set()
    assert ck.flush(20)
    ck.close()


def test_a_dead_node_never_blocks_training_and_a_restarted_node_recovers(tmp_path):
    node = NodeProcess(str(tmp_path)).start()
    model, opt = _model()
    gen = torch.Generator().manual_seed(4)
    ck = Checkpointer(model, opt, node=node.url, run="gpt", timeout_s=2)
    _train_step(model, opt, gen)
    ck.save(1)
    assert ck.flush(20)
    node.wait_step(1)  # the ack precedes the step's publication in RAM
    assert node.post("/snapshot")[0] == 200
    node.kill()  # SIGKILL: no goodbye
    from flowcheck.audit import audit

    report = audit(open_store(node.config))  # what the dead node committed is intact; nothing partial is visible
    assert report.ok and open_store(node.config).local.steps() == [1], report.problems
    t0 = time.monotonic()
    for step in range(2, 6):
        _train_step(model, opt, gen)
        ck.save(step)
    ck.flush(5)
    assert time.monotonic() - t0 < 15, "training was held up by a dead node"
    assert ck.stats.failures >= 1 and "step" in (ck.stats.last_error or "")
    node.start()  # same config: recovers its view from the local tier
    status = node.get("/status")
    assert status["tiers"]["local"] == 1 and status["memory"]["parent"] == 1
    assert status["memory"]["cow_copies"] == 0 and status["memory"]["cow_waits"] == 0  # nothing pinned it yet
    ck.save(6)  # reconnects
    assert ck.flush(20), ck.stats.last_error
    node.wait_step(6)
    ck.close()
    node.stop()


def test_a_sender_lost_mid_payload_leaves_no_partial_step(node):
    model, opt = _model()
    gen = torch.Generator().manual_seed(5)
    ck = Checkpointer(model, opt, node=node.url, run="gpt", transport="tcp")
    _train_step(model, opt, gen)
    ck.save(1)
    assert ck.flush(20)
    node.wait_step(1)
    # a trainer dies halfway through the payload of step 2
    header = _header_like(ck, step=2)
    with _signed_connection(node) as (s, signer):
        send_frame(s, signer.sign(header))
        s.sendall(b"\0" * (header["payload"]["bytes"] // 2))
    deadline = time.monotonic() + 20
    while node.get("/status")["push"]["aborted_steps"] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    status = node.get("/status")
    assert status["push"]["aborted_steps"] == 1 and status["memory"]["step"] != 2
    code, body = node.post("/snapshot")
    assert code == 409 or body.get("step") == 1  # stale state refuses; never a step-2 mixture
    assert 2 not in open_store(node.config).local.steps()
    # the next full push heals the node
    _train_step(model, opt, gen)
    ck.save(3)
    assert ck.flush(20), ck.stats.last_error
    node.wait_step(3)
    ck.close()


def _header_like(ck: Checkpointer, step: int) -> dict:
    specs = ck._specs
    shards, at = [], 0
    for e in ck._entries:
        shards.append({"tensor": e.name, "offsets": [0] * e.tensor.dim(), "shape": list(e.tensor.shape), "at": at})
        at += e.nbytes
    return {"kind": "push", "run": "gpt", "step": step, "sender": 0, "senders": 1, "source_layout": {},
            "tensors": specs, "shards": shards, "scalars": {}, "payload": {"bytes": at, "digest": "xxh3-128:" + "0" * 32}}


def _pushed_step_one(node: NodeProcess, transport: str, seed: int):
    """A model and its Checkpointer whose step 1 the node holds: (model, opt, ck, generator)."""
    model, opt = _model()
    ck = Checkpointer(model, opt, node=node.url, run="gpt", transport=transport)
    gen = torch.Generator().manual_seed(seed)
    _train_step(model, opt, gen)
    ck.save(1)
    assert ck.flush(20), ck.stats.last_error
    node.wait_step(1)
    return model, opt, ck, gen


@contextlib.contextmanager
def _signed_connection(node: NodeProcess):
    """A raw push connection greeted as a Checkpointer greets (signing with the node's token): (socket, signer)."""
    with socket.create_connection(("127.0.0.1", node.push_port), timeout=20) as s:
        yield s, PushSigner.handshake(s, node.token, "gpt", f"127.0.0.1:{node.push_port}")


def _answer(node: NodeProcess, header: dict, payload: bytes | None = None) -> dict:
    """The node's answer to one raw, authorised push frame."""
    with _signed_connection(node) as (s, signer):
        send_frame(s, signer.sign(header), payload)
        return recv_header(s)


def test_a_corrupted_payload_is_refused_and_reported(node):
    _, _, ck, _ = _pushed_step_one(node, "tcp", seed=6)
    header = _header_like(ck, step=2)
    answer = _answer(node, header, b"\1" * header["payload"]["bytes"])
    assert answer["kind"] == "error" and "digest" in answer["message"]
    assert node.get("/status")["memory"]["step"] != 2
    ck.close()


def test_sigterm_stops_the_node_cleanly(node):
    model, opt = _model()
    with Checkpointer(model, opt, node=node.url, run="gpt") as ck:
        ck.save(1)
        assert ck.flush(20)
    node.wait_step(1)
    node.post("/snapshot")
    assert node.kill(15) == 0
    local = open_store(node.config).local
    assert local.steps() == [1]
    import os

    leftovers = [n for n in os.listdir(os.path.join(node.root, "local", "gpt")) if n.endswith(".tmp")]
    assert not leftovers


def test_a_shared_memory_payload_is_checked_by_its_generation_not_hashed(node):
    """Through shared memory the trainer sends no digest: the segment's generation counter guards it, and a segment
    the node adopts must be lent (its lease word set) — else the trainer could write it under the node's state."""
    from flowcheck import _native
    from flowcheck.capture.push.buffers import FREE, LENT, lease_at
    from flowcheck.torch.checkpointer import generation_at

    model, opt, ck, gen = _pushed_step_one(node, "shm", seed=8)
    at = generation_at(ck.stats.buffer_bytes)
    held, spare = ck._host.segments  # the node adopted segment 0 as its state; segment 1 is the trainer's
    assert ck._host.generations == [2, 0] and _native.generation_load(held.buf, at) == 2
    assert _native.generation_load(held.buf, lease_at(ck.stats.buffer_bytes)) == LENT
    assert _native.generation_load(spare.buf, lease_at(ck.stats.buffer_bytes)) == FREE

    def refused(payload: dict, seg=held) -> str:
        header = _header_like(ck, step=2)
        header["payload"] = {"bytes": header["payload"]["bytes"], "shm": seg.name, **payload}
        answer = _answer(node, header)
        assert answer["kind"] == "error", answer
        return answer["message"]

    # the trainer is writing the buffer again (odd): a frame naming the finished generation is refused
    _native.generation_store(held.buf, at, 3)
    assert "generation 3, the header says 2" in refused({"generation": 2, "generation_at": at})
    _native.generation_store(held.buf, at, 2)
    # neither a generation nor a digest, an odd generation, a counter outside the segment: refused, named
    assert "needs an even generation" in refused({})
    assert "needs an even generation" in refused({"generation": 3, "generation_at": at})
    assert "no room for the generation" in refused({"generation": 2, "generation_at": held.size})
    # a segment offered for adoption that its trainer did not lend, or a lease word outside it: refused
    assert "did not lend it" in refused({"generation": 0, "generation_at": at,
                                         "lease_at": lease_at(ck.stats.buffer_bytes)}, seg=spare)
    assert "lease_at must be" in refused({"generation": 0, "generation_at": at, "lease_at": spare.size}, seg=spare)
    # a refused frame naming the segment the node's state lives in does not give that segment back to the trainer
    assert "the header says 4" in refused({"generation": 4, "generation_at": at,
                                           "lease_at": lease_at(ck.stats.buffer_bytes)})
    assert _native.generation_load(held.buf, lease_at(ck.stats.buffer_bytes)) == LENT
    assert node.get("/status")["memory"]["step"] == 1
    # the trainer's own next push still lands, bit for bit
    _train_step(model, opt, gen)
    ck.save(2)
    assert ck.flush(20), ck.stats.last_error
    node.wait_step(2)
    want = _expected(model, opt)
    got = _stored(node, 2)
    assert all(np.array_equal(got[n], want[n]) for n in want)
    ck.close()


def _until(done, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done()


def _ram_state(store) -> dict[str, np.ndarray]:
    snap = store.memory.pin()
    try:
        return {s.tensor: np.array(snap.array(s)) for s in snap.data}
    finally:
        store.memory.release(snap)


def test_a_segment_rewritten_while_the_node_holds_it_aborts_its_step_and_the_previous_one_stays(
        tmp_path, monkeypatch, node_token):
    """A segment its trainer writes after lending it (a trainer that ignores the lease) is caught when the step is
    adopted: the step aborts, its sender is told, and the previous complete step stays the RAM state, whole."""
    from flowcheck import _native
    from flowcheck.node import receiver as push
    from flowcheck.torch.checkpointer import generation_at

    store = open_store(NodeProcess(str(tmp_path)).config)
    receiver = push.PushReceiver(store, part_timeout_s=10, token=node_token).start()
    model, opt = _model()
    ck = Checkpointer(model, opt, node=f"tcp://127.0.0.1:{receiver.address[1]}", run="gpt", transport="shm")
    gen = torch.Generator().manual_seed(9)
    adopt = push.PushReceiver._adopt

    def trainer_writes_meanwhile(self, opened):
        seg = ck._host.segments[1]  # step 2's: the node holds step 1 in segment 0
        _native.generation_store(seg.buf, generation_at(ck.stats.buffer_bytes), ck._host.generations[1] + 1)
        return adopt(self, opened)

    try:
        _train_step(model, opt, gen)
        ck.save(1)
        assert ck.flush(20), ck.stats.last_error
        assert store.memory.step == 1  # acknowledged: the node holds it
        step_one = _expected(model, opt)
        monkeypatch.setattr(push.PushReceiver, "_adopt", trainer_writes_meanwhile)
        _train_step(model, opt, gen)
        ck.save(2)
        assert not ck.flush(20)
        assert "after lending it to the node" in ck.stats.last_error and "stays step 1" in ck.stats.last_error
        assert store.memory.step == 1 and not store.memory.stale
        assert receiver.stats.last_aborted.endswith("the RAM state stays step 1")
        got = _ram_state(store)
        assert all(np.array_equal(got[n], step_one[n]) for n in step_one)
        monkeypatch.setattr(push.PushReceiver, "_adopt", adopt)
        _train_step(model, opt, gen)
        ck.save(3)
        assert ck.flush(20), ck.stats.last_error
        assert store.memory.step == 3 and not store.memory.stale
    finally:
        ck.close()
        receiver.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_snapshot_in_flight_never_holds_a_push_back_and_keeps_its_own_step(tmp_path, node_token, transport):
    """A push is received beside the RAM state, so a snapshot still writing step 1 neither delays step 2 nor sees
    any of it; a stale state (a failure elsewhere) is replaced whole by the next push.  Over TCP the replaced state's
    buffers are received into again once the snapshot let them go (no new allocation per push)."""
    from flowcheck.node import receiver as push

    store = open_store(NodeProcess(str(tmp_path)).config)
    store.memory.config = dataclasses.replace(store.memory.config, cow_budget=0.0)  # no copy-on-write room at all
    receiver = push.PushReceiver(store, part_timeout_s=0.5, token=node_token).start()
    model, opt = _model()
    gen = torch.Generator().manual_seed(3)
    ck = Checkpointer(model, opt, node=f"tcp://127.0.0.1:{receiver.address[1]}", run="gpt", transport=transport,
                      timeout_s=30)
    try:
        _train_step(model, opt, gen)
        ck.save(1)
        assert ck.flush(20), ck.stats.last_error
        step_one = _expected(model, opt)
        snap = store.memory.pin()  # a snapshot that has not written anything yet
        _train_step(model, opt, gen)
        ck.save(2)
        assert ck.flush(20), ck.stats.last_error
        assert store.memory.step == 2 and store.memory.cow_waits == 0 and store.memory.cow_copies == 0
        assert all(np.array_equal(snap.array(s), step_one[s.tensor]) for s in snap.data)
        m = store.local.write(snap)  # writes and unpins shard by shard
        store.memory.release(snap)
        assert m.step == 1 and store.local.steps() == [1]
        # a stale state is replaced by the next push, then snapshots again
        store.memory.mark_stale("test: an update failed")
        _train_step(model, opt, gen)
        ck.save(3)
        assert ck.flush(20), ck.stats.last_error
        assert store.memory.step == 3 and not store.memory.stale
        want, got = _expected(model, opt), _ram_state(store)
        assert set(got) == set(want) and all(np.array_equal(got[n], want[n]) for n in want)
        if transport == "tcp":  # step 1's buffer came back once the snapshot released it, and step 3 landed in it
            assert receiver.pool.lent_bytes == ck.stats.buffer_bytes
        else:  # the node holds the segment of step 3 only; the trainer has the other one back
            assert receiver.stats.adopted_segments == 3 and store.memory.lent_bytes == ck.stats.buffer_bytes
    finally:
        ck.close()
        receiver.close()
