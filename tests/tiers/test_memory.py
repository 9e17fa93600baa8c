"""The memory tier: in-place updates, step-consistent snapshots under concurrent updates, stale state."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from flowcheck.config import LocalConfig, MemoryConfig
from flowcheck.errors import ConfigError, StaleStateError, StepNotFoundError
from flowcheck.state import Scalars, Shard, Snapshot, StateLayout, TensorSpec
from flowcheck.tiers.local import LocalTier
from flowcheck.tiers.memory import MemoryTier

N_TENSORS = 8


def _state(step: int) -> Snapshot:
    specs = tuple(TensorSpec(f"layers.{i}.weight", "float32", (64, 32)) for i in range(N_TENSORS))
    data = {Shard.whole(s): np.full(s.shape, float(step), np.float32) for s in specs}
    return Snapshot("r", step, StateLayout(specs), data, Scalars(optimizer_step=step))


def _apply(tier: MemoryTier, step: int, pause: float = 0.0) -> None:
    """One 'optimizer step': every shard set to the step number, shard by shard (slowly)."""
    with tier.update(step, Scalars(optimizer_step=step)) as u:
        for shard in u.shards():
            u.array(shard)[...] = float(step)
            if pause:
                time.sleep(pause)


def test_update_is_in_place_and_visible_only_after_commit():
    tier = MemoryTier(MemoryConfig(), "r")
    tier.write(_state(0))
    shard = next(iter(_state(0).data))
    before = tier._arrays[shard]
    _apply(tier, 1)
    assert tier._arrays[shard] is before  # no snapshot held it: no copy
    assert tier.steps() == [1]
    np.testing.assert_array_equal(tier.read(1, shard.tensor), np.ones((64, 32), np.float32))
    assert tier.cow_copies == 0


@pytest.mark.parametrize("budget", [None, 0.15, 0.0])
def test_snapshot_is_step_consistent_while_next_steps_are_applied(tmp_path, budget):
    """Snapshots persisted to the local tier while a thread keeps updating: never a torn mixture
    (copy-on-write unlimited, bounded, or none at all: updates wait for the snapshot's writes)."""
    tier = MemoryTier(MemoryConfig(cow_budget=budget), "r")
    tier.write(_state(0))
    local = LocalTier(LocalConfig(root=str(tmp_path), fsync=False, workers=2), "r")
    stop = threading.Event()

    def updater():
        step = 0
        while not stop.is_set():
            step += 1
            _apply(tier, step, pause=0.0005)

    t = threading.Thread(target=updater)
    t.start()
    written = []
    try:
        for _ in range(6):
            snap = tier.pin()
            try:
                time.sleep(0.01)  # let updates race with the snapshot
                if snap.step not in local.steps():
                    local.write(snap)
                    written.append(snap.step)
            finally:
                tier.release(snap)
    finally:
        stop.set()
        t.join()
    assert len(written) >= 3
    assert tier.cow_copies > 0 if budget is None else tier.cow_copies <= N_TENSORS * len(written) * budget + len(written)
    for step in written:
        m = local.manifest(step)
        for name in m.tensors:
            values = np.unique(local.read(step, name))
            assert values.tolist() == [float(step)], f"step {step} {name} mixes steps: {values}"
        assert m.scalars["optimizer_step"] == step


def test_pinned_arrays_never_change_after_pin():
    tier = MemoryTier(MemoryConfig(cow_budget=None), "r")
    tier.write(_state(0))
    snap = tier.pin()
    copies = {s: np.array(snap.array(s)) for s in snap.data}
    _apply(tier, 1)
    _apply(tier, 2)
    for s in snap.data:
        np.testing.assert_array_equal(snap.array(s), copies[s])
    tier.release(snap)
    assert tier.cow_copies == N_TENSORS  # each shard copied once, on first touch


def test_failed_update_marks_state_stale_and_refuses_snapshots():
    tier = MemoryTier(MemoryConfig(), "r")
    tier.write(_state(0))
    with pytest.raises(RuntimeError):
        with tier.update(1) as u:
            u.array(next(iter(u.shards())))[...] = 7
            raise RuntimeError("lost a bucket")
    assert tier.stale and tier.steps() == []
    with pytest.raises(StaleStateError):
        tier.pin()
    tier.write(_state(5))  # a full push (resync) clears it
    assert not tier.stale and tier.steps() == [5]


def test_empty_memory_tier_has_no_steps():
    tier = MemoryTier(MemoryConfig(), "r")
    assert tier.steps() == []
    with pytest.raises(StepNotFoundError):
        tier.pin()
    with pytest.raises(StepNotFoundError):
        with tier.update(1):
            pass


def test_shards_already_written_by_a_snapshot_are_not_copied_on_write(tmp_path):
    """The local tier unpins each shard once its bytes are in the file: later updates need no copy of it."""
    tier = MemoryTier(MemoryConfig(), "r")
    tier.write(_state(0))
    local = LocalTier(LocalConfig(root=str(tmp_path), fsync=False, workers=2), "r")
    snap = tier.pin()
    local.write(snap)  # every shard written; the snapshot is not released yet
    _apply(tier, 1)
    assert tier.cow_copies == 0
    tier.release(snap)
    for name in local.manifest(0).tensors:
        assert np.unique(local.read(0, name)).tolist() == [0.0]


def test_copy_on_write_stays_within_its_budget_and_updates_wait_for_the_snapshot(tmp_path):
    """With the budget spent, an update waits until the snapshot has written the shard, never copies it."""
    tier = MemoryTier(MemoryConfig(cow_budget=0.0), "r")
    tier.write(_state(0))
    snap = tier.pin()
    done = threading.Event()
    t = threading.Thread(target=lambda: (_apply(tier, 1), done.set()))
    t.start()
    assert not done.wait(0.3)  # blocked on the first pinned shard
    assert tier.cow_waits == 1 and tier.cow_copies == 0
    local = LocalTier(LocalConfig(root=str(tmp_path), fsync=False, workers=2), "r")
    local.write(snap)  # unpins each shard as written: the update proceeds shard by shard
    t.join(10)
    assert done.is_set() and tier.cow_copies == 0 and tier.step == 1
    tier.release(snap)
    for name in local.manifest(0).tensors:
        assert np.unique(local.read(0, name)).tolist() == [0.0]


def test_an_update_waits_at_most_cow_wait_s_then_copies():
    tier = MemoryTier(MemoryConfig(cow_budget=0.0, cow_wait_s=0.2), "r")
    tier.write(_state(0))
    snap = tier.pin()  # never written, never released while the update runs
    t0 = time.monotonic()
    _apply(tier, 1)
    assert 0.2 <= time.monotonic() - t0 < 5
    assert tier.cow_copies == N_TENSORS and tier.step == 1
    for s in snap.data:
        assert np.unique(snap.array(s)).tolist() == [0.0]
    tier.release(snap)


def test_memory_config_rejects_a_bad_budget():
    with pytest.raises(ConfigError, match="cow_budget"):
        MemoryConfig(cow_budget=-1)
    with pytest.raises(ConfigError, match="cow_wait_s"):
        MemoryConfig(cow_wait_s=0)


@pytest.mark.parametrize("rewrite, take, fresh", [(True, N_TENSORS, True), (True, N_TENSORS - 1, False),
                                                  (False, N_TENSORS, False)])
def test_a_stale_state_is_fresh_again_only_when_a_rewrite_took_every_shard(rewrite, take, fresh):
    """A full push rewrites a stale state in place (no second copy in RAM); a partial one leaves it stale."""
    tier = MemoryTier(MemoryConfig(), "r")
    tier.write(_state(0))
    before = dict(tier._arrays)
    tier.mark_stale("a push failed half-way")
    with tier.update(1, Scalars(optimizer_step=1), rewrite=rewrite) as u:
        for shard in u.shards()[:take]:
            u.array(shard)[...] = 1.0
    assert tier.stale is not fresh and tier.step == 1
    assert all(tier._arrays[s] is a for s, a in before.items())  # in place: the same arrays
    if fresh:
        snap = tier.pin()
        assert all(np.unique(snap.array(s)).tolist() == [1.0] for s in snap.data)
        tier.release(snap)
    else:
        with pytest.raises(StaleStateError):
            tier.pin()


def test_an_update_that_fails_during_a_rewrite_stays_stale():
    tier = MemoryTier(MemoryConfig(), "r")
    tier.write(_state(0))
    tier.mark_stale("earlier failure")
    with pytest.raises(RuntimeError), tier.update(1, rewrite=True) as u:
        for shard in u.shards():
            u.array(shard)[...] = 1.0
        raise RuntimeError("the sender vanished after its last shard")
    assert tier.stale


# ---- a push adopted whole, in lent memory ---------------------------------------------------------------------
def _lent(step: int, released: list[int]) -> tuple[Snapshot, dict]:
    """Step ``step`` with every shard a view into one buffer lent by a receiver: (snapshot, blocks)."""
    from flowcheck.tiers.memory import Block

    snap = _state(step)
    buf = np.empty(sum(a.nbytes for a in snap.data.values()), np.uint8)
    data, at = {}, 0
    for shard, arr in snap.data.items():
        view = buf[at:at + arr.nbytes].view(np.float32).reshape(arr.shape)
        view[...] = arr
        data[shard], at = view, at + arr.nbytes
    block = Block(buf.nbytes, lambda: released.append(step))
    return Snapshot("r", step, snap.layout, data, snap.scalars), {s: block for s in data}


def test_an_adopted_push_is_not_copied_and_its_memory_goes_back_once_replaced():
    tier = MemoryTier(MemoryConfig(), "r")
    released: list[int] = []
    one, blocks = _lent(1, released)
    state_id = tier.adopt_push(one, blocks)
    shard = next(iter(one.data))
    assert tier._arrays[shard] is one.data[shard] and tier.steps() == [1] and released == []
    assert tier.lent_bytes == next(iter(blocks.values())).nbytes
    two, blocks2 = _lent(2, released)
    assert tier.adopt_push(two, blocks2) == state_id  # the same tensors: what senders were told still holds
    assert released == [1] and tier.steps() == [2] and tier.manifest(2).step == 2
    tier.delete(2)
    assert released == [1, 2] and tier.lent_bytes == 0


def test_a_snapshot_holds_the_memory_of_the_step_it_pinned_until_it_wrote_it(tmp_path):
    """A push adopted while a snapshot of the previous step is in flight: the snapshot keeps its step's bytes (nothing
    is written in place), and that step's memory goes back only once the snapshot wrote (unpinned) every shard."""
    tier = MemoryTier(MemoryConfig(cow_budget=0.0), "r")
    released: list[int] = []
    tier.adopt_push(*_lent(1, released))
    snap = tier.pin()
    tier.adopt_push(*_lent(2, released))
    assert released == [] and tier.step == 2 and tier.cow_copies == 0 and tier.cow_waits == 0
    assert all(np.all(snap.array(s) == 1.0) for s in snap.data)
    local = LocalTier(LocalConfig(root=str(tmp_path), fsync=False, workers=2), "r")
    local.write(snap)  # unpins shard by shard
    assert released == [1]
    tier.release(snap)
    assert released == [1] and local.read(1, "layers.0.weight").max() == 1.0


def test_kept_shards_come_from_the_state_they_were_sent_to_copied_out_of_lent_memory():
    from flowcheck.tiers.memory import KeptShardsGone

    tier = MemoryTier(MemoryConfig(), "r")
    released: list[int] = []
    one, blocks = _lent(1, released)
    base = tier.adopt_push(one, blocks)
    frozen = Shard.whole(one.layout.tensors[0])
    two, blocks2 = _lent(2, released)
    two = Snapshot("r", 2, two.layout, {s: a for s, a in two.data.items() if s != frozen}, two.scalars)
    with pytest.raises(KeptShardsGone, match="sent to node state 'elsewhere'"):
        tier.adopt_push(two, blocks2, kept=[frozen], base="elsewhere")
    assert tier.step == 1 and released == []  # refused: nothing changed
    tier.adopt_push(two, blocks2, kept=[frozen], base=base)
    assert released == [1]  # step 1's memory went back: the kept shard was copied out of it first
    assert np.all(tier.read(2, frozen.tensor) == 1.0) and np.all(tier.read(2, "layers.1.weight") == 2.0)
    assert tier.lent_bytes == next(iter(blocks2.values())).nbytes
