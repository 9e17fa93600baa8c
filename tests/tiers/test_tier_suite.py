"""The behaviour every tier shares, run against each tier kind (see conftest.TIER_KINDS)."""
from __future__ import annotations

import numpy as np
import pytest

from flowcheck.errors import StepExistsError, StepNotFoundError
from flowcheck.state import Shard, TensorSpec
from tests.helpers import (
    BIG,
    COUNT,
    EMPTY,
    NORM,
    W,
    assert_step_intact,
    big_snapshot,
    failing_snapshot,
    global_array,
    make_custom_snapshot,
    make_snapshot,
)


def test_written_shards_read_back_bit_exactly(tier, make_tier, snapshot):
    tier.write(snapshot)
    assert_step_intact(tier, snapshot)
    assert_step_intact(make_tier(), snapshot)  # a reopened tier reads the same bytes
    for name in (W, NORM, COUNT, EMPTY):
        got = tier.read(10, name)
        want = global_array(snapshot, name)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    assert tier.read(10, NORM).dtype == np.uint16  # bf16 travels as its raw bit pattern


@pytest.mark.parametrize(
    "region",
    [
        (slice(2, 6),),  # rows across the shard boundary at 4
        (slice(3, 5), slice(1, 5)),
        (slice(4, 5), slice(0, 6)),  # first row of the second shard
        (slice(0, 8), slice(5, 6)),
        (slice(-3, None), slice(None, -2)),
        (slice(4, 4),),  # empty
    ],
)
def test_regions_spanning_shard_boundaries_read_back(tier, snapshot, region):
    tier.write(snapshot)
    want = global_array(snapshot, W)[region]
    got = tier.read(10, W, region)
    assert got.shape == want.shape and got.tobytes() == want.tobytes()


def test_load_gives_back_scalars_and_layout(tier, snapshot):
    tier.write(snapshot)
    loaded = tier.load(10)
    assert loaded.scalars == snapshot.scalars
    assert loaded.layout.digest() == snapshot.layout.digest()
    assert set(loaded.shards()) == set(snapshot.shards())


def test_steps_lists_only_committed_steps(tier, make_tier, persistent):
    assert tier.steps() == []
    for step in (30, 10, 20):
        tier.write(make_snapshot(step=step))
    with pytest.raises(RuntimeError, match="mid-write"):
        tier.write(failing_snapshot(40))
    assert tier.steps() == [10, 20, 30]
    assert make_tier().steps() == [10, 20, 30]
    with pytest.raises(StepNotFoundError):
        tier.manifest(40)


def test_failed_write_does_not_block_a_retry(tier):
    with pytest.raises(RuntimeError):
        tier.write(failing_snapshot(40))
    tier.write(big_snapshot(40))
    assert tier.steps() == [40]
    assert_step_intact(tier, big_snapshot(40))


def test_latest_moves_only_after_commit(tier, persistent):
    assert tier.latest() is None
    tier.write(make_snapshot(step=10))
    assert tier.latest() == 10
    with pytest.raises(RuntimeError):
        tier.write(failing_snapshot(20))
    assert tier.latest() == 10
    tier.write(make_snapshot(step=5))
    assert tier.latest() == 10  # an older step committed late does not move latest back
    tier.write(make_snapshot(step=20))
    assert tier.latest() == 20


def test_promotion_from_local_keeps_manifest_digest(tier, local_tier, snapshot):
    source = local_tier.write(snapshot)
    promoted = tier.write(local_tier.load(10))
    assert promoted.digest() == source.digest()
    assert tier.manifest(10).digest() == source.digest()
    for field in ("created_at", "producer", "parent", "scalars", "layout_digest"):
        assert getattr(promoted, field) == getattr(source, field), field
    assert tier.verify(10) == []
    assert_step_intact(tier, snapshot)


def test_promotion_out_of_the_tier_keeps_manifest_digest(tier, local_tier, snapshot):
    parent = make_snapshot(step=5)
    first = tier.write(parent)
    source = tier.write(snapshot, parent=first.parent_ref())
    promoted = local_tier.write(tier.load(10))
    assert promoted.digest() == source.digest()
    assert promoted.parent == source.parent == first.parent_ref()
    assert local_tier.verify(10) == []


def test_writing_a_step_again_with_different_content_raises_step_exists(tier, snapshot, persistent):
    tier.write(snapshot)
    with pytest.raises(StepExistsError):
        tier.write(make_snapshot(step=10, seed=1))
    assert_step_intact(tier, snapshot)  # the committed step is untouched


def test_promoting_different_content_onto_a_committed_step_raises_step_exists(tier, local_tier, snapshot, persistent):
    tier.write(snapshot)
    local_tier.write(make_snapshot(step=10, seed=1))
    with pytest.raises(StepExistsError):
        tier.write(local_tier.load(10))
    assert_step_intact(tier, snapshot)


def test_repromoting_identical_content_is_a_no_op(tier, local_tier, snapshot):
    local_tier.write(snapshot)
    first = tier.write(local_tier.load(10))
    stored = tier.manifest(10).to_bytes()
    again = tier.write(local_tier.load(10))
    assert again == first
    assert tier.manifest(10).to_bytes() == stored
    assert tier.steps() == [10]


def test_delete_removes_the_step_and_leaves_a_pruning_record(tier, make_tier, persistent):
    tier.write(make_snapshot(step=10))
    tier.write(make_snapshot(step=20))
    digest = tier.manifest(10).digest()
    tier.delete(10)
    assert tier.steps() == [20]
    with pytest.raises(StepNotFoundError):
        tier.manifest(10)
    assert tier.pruned() == {10: digest}
    assert make_tier().pruned() == {10: digest}
    assert_step_intact(tier, make_snapshot(step=20))
    tier.write(make_snapshot(step=10, seed=3))  # the number is free again
    assert_step_intact(tier, make_snapshot(step=10, seed=3))


def test_deleting_an_unknown_step_raises_step_not_found_and_records_nothing(tier):
    tier.write(make_snapshot(step=10))
    with pytest.raises(StepNotFoundError):
        tier.delete(99)
    assert tier.pruned() == {}


def test_verify_returns_no_problems_on_a_healthy_step(tier, snapshot):
    tier.write(snapshot)
    assert tier.verify(10) == []


def test_reading_an_unknown_step_raises_step_not_found(tier, snapshot):
    tier.write(snapshot)
    with pytest.raises(StepNotFoundError):
        tier.read(99, W)
    with pytest.raises(FileNotFoundError):  # callers that know only builtins still catch it
        tier.manifest(99)
    with pytest.raises(StepNotFoundError):
        tier.load(99)
    assert [p.path for p in tier.verify(99)] == ["manifest.json"]


def test_a_large_shard_split_over_several_files_reads_back(tier):
    snap = big_snapshot()
    m = tier.write(snap)
    entry = m.tensors[BIG].shards[0]
    if tier.name == "object":  # 2.5 MiB at max_file_mib=1: at least three safetensors files
        assert len(m.files) >= 3 and len(entry.location) >= 3
        assert all(p.rows is not None for p in entry.location)
    assert_step_intact(tier, snap)
    big = global_array(snap, BIG)
    for region in [(slice(250, 260), slice(3, 900)), (slice(0, 640), slice(1000, 1024)), (slice(511, 513),)]:
        assert tier.read(10, BIG, region).tobytes() == big[region].tobytes()


def test_a_zero_size_trailing_dimension_reads_back(tier):
    specs = [TensorSpec("wide", "float32", (4, 0)), TensorSpec("tail", "float32", (2,))]
    data = {
        Shard("wide", (0, 0), (4, 0)): np.zeros((4, 0), np.float32),
        Shard("tail", (0,), (2,)): np.ones(2, np.float32),
    }
    snap = make_custom_snapshot(specs, data)
    tier.write(snap)
    assert tier.read(10, "wide").shape == (4, 0)
    assert_step_intact(tier, snap)


@pytest.mark.s3
def test_multipart_uploads_of_several_parts_read_back(object_bucket, tmp_path):
    """A 12 MiB file in 5 MiB parts: the parallel multipart path, bit-exact."""
    from flowcheck.config import ObjectConfig
    from flowcheck.state import Shard, TensorSpec
    from flowcheck.tiers.object import ObjectTier

    spec = TensorSpec("decoder.layers.0.mlp.linear_fc1.weight", "float32", (3 << 20,))
    data = np.random.default_rng(3).standard_normal(3 << 20).astype(np.float32)
    snap = make_custom_snapshot([spec], {Shard.whole(spec): data})
    tier = ObjectTier(ObjectConfig(url=object_bucket, part_mib=5, upload_workers=3), "r1", staging_dir=str(tmp_path / "st"))
    m = tier.write(snap)
    assert m.files[0].bytes > 12 << 20 and tier.verify(10) == []
    np.testing.assert_array_equal(tier.read(10, spec.name), data)
