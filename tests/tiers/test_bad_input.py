"""Damaged or hostile stored data: errors name the file, and other committed steps stay intact."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from flowcheck.config import ObjectConfig
from flowcheck.errors import FlowcheckError, IntegrityError, ManifestError, TierError
from flowcheck.digest import sha256
from flowcheck.manifest import canonical_json
from flowcheck.tiers.base import step_dir
from tests.helpers import BIG, W, assert_step_intact, big_snapshot, make_snapshot, read_raw, write_raw

Failed = pytest.fail.Exception  # what a 'DID NOT RAISE' raises
LOCAL = pytest.mark.parametrize("tier_kind", ["local"], indirect=True)
OBJECT = pytest.mark.parametrize(
    "tier_kind", ["object-file", pytest.param("object-s3", marks=pytest.mark.s3)], indirect=True
)


@pytest.fixture
def two_steps(tier, local_tier):
    """Steps 10 and 20 committed in the tier under test (promoted, so their manifests are consistent)."""
    snaps = {10: make_snapshot(step=10, seed=1), 20: big_snapshot(20)}
    for snap in snaps.values():
        local_tier.write(snap)
        tier.write(local_tier.load(snap.step))
    return snaps


def assert_other_step_intact(tier, snaps) -> None:
    assert 10 in tier.steps()
    assert tier.verify(10) == []
    assert_step_intact(tier, snaps[10])


def manifest_rel(step: int) -> str:
    return f"{step_dir(step)}/manifest.json"


def edit_manifest(tier, step: int, edit, *, reseal: bool) -> None:
    raw = json.loads(read_raw(tier, manifest_rel(step)))
    edit(raw)
    if reseal:  # a careful forger recomputes the integrity field
        body = {k: v for k, v in raw.items() if k != "integrity"}
        raw = {**body, "integrity": sha256(canonical_json(body))}
    write_raw(tier, manifest_rel(step), canonical_json(raw) + b"\n")


def other_digest(digest: str) -> str:
    alg, hexd = digest.split(":")
    return f"{alg}:{'0' if hexd[0] != '0' else '1'}{hexd[1:]}"


def flip_byte(tier, rel: str, offset: int) -> None:
    data = bytearray(read_raw(tier, rel))
    data[offset] ^= 0x01
    write_raw(tier, rel, bytes(data))


# ---- local tier: zarr chunks -----------------------------------------------------------------
def chunk_file(tier, step: int, tensor: str) -> str:
    """The file holding the tensor's first shard: its pack's shard file, or its own array's chunk file."""
    return shard_bytes_at(tier, step, tensor)[0]


def shard_bytes_at(tier, step: int, tensor: str) -> tuple[str, int]:
    """(file, offset in it of the shard's first byte) of the tensor's first shard."""
    from flowcheck.tiers.zarr_pack import CHUNK_BYTES

    m = tier.manifest(step)
    piece = m.tensors[tensor].shards[0].location[0]
    if piece.start is None:
        (rel,) = [f.path for f in m.files if f.path.startswith(f"{step_dir(step)}/{tensor}/0/c/")]
        return rel, 0
    byte = piece.start * np.dtype(m.tensors[tensor].dtype).itemsize
    return f"{piece.path}/c/0", byte // CHUNK_BYTES * (CHUNK_BYTES + 4) + byte % CHUNK_BYTES


@LOCAL
def test_a_corrupted_zarr_chunk_is_caught_and_named(tier, two_steps):
    rel, at = shard_bytes_at(tier, 20, BIG)
    flip_byte(tier, rel, at + 100)
    m = tier.manifest(20)
    with pytest.raises(IntegrityError, match=rel):
        tier.read_shard(m, BIG, m.tensors[BIG].shards[0])
    with pytest.raises(IntegrityError):
        tier.read(20, BIG, (slice(0, 2),))  # a region read checks the chunk CRC too
    problems = tier.verify(20)
    assert problems and problems[0].path.endswith(rel)
    assert_other_step_intact(tier, two_steps)


@LOCAL
def test_a_missing_zarr_chunk_is_not_read_as_zeros(tier, two_steps):
    import os

    os.unlink(f"{tier.root}/{chunk_file(tier, 10, W)}")
    with pytest.raises(FlowcheckError):
        tier.read(10, W)


@LOCAL
@pytest.mark.parametrize("what", ["zarr.json", "c/0"])
def test_a_fifo_where_a_step_file_belongs_is_refused_at_once_never_waited_on(tier, two_steps, what):
    """A FIFO would block the reader forever (open waits for a writer): reads and verify name it instead."""
    import os
    import threading

    m = tier.manifest(20)
    data = chunk_file(tier, 20, BIG)
    path = f"{tier.root}/{data.rsplit('/c/', 1)[0] + '/zarr.json' if what == 'zarr.json' else data}"
    os.replace(path, path + ".kept")
    os.mkfifo(path)
    got: list[BaseException] = []

    def read():
        try:
            tier.read_shard(m, BIG, m.tensors[BIG].shards[0])
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            got.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(60)
    assert not reader.is_alive() and len(got) == 1 and isinstance(got[0], IntegrityError), got
    assert "is a FIFO, not a regular file" in str(got[0]) and path in str(got[0])
    problems = tier.verify(20)
    assert any("is a FIFO" in p.what for p in problems)
    os.remove(path)
    os.replace(path + ".kept", path)
    assert tier.verify(20) == [] and tier.verify(10) == []


# ---- object tier: safetensors files ------------------------------------------------------------
@OBJECT
@pytest.mark.parametrize("keep", ["4-bytes", "header-only", "all-but-one"])
def test_a_truncated_safetensors_file_is_named_and_reads_fail(tier, make_tier, two_steps, keep):
    m = tier.manifest(20)
    entry = m.tensors[BIG].shards[0]
    rel = entry.location[0].path
    data = read_raw(tier, rel)
    cut = {"4-bytes": 4, "header-only": tier.header(rel).data_start, "all-but-one": len(data) - 1}[keep]
    write_raw(tier, rel, data[:cut])
    problems = make_tier().verify(20)
    assert [p.path for p in problems] == [rel] and "size" in problems[0].what
    for reader in (tier, make_tier()):  # with and without the header cached
        with pytest.raises(FlowcheckError, match=rel.split("/")[-1]):
            reader.read_shard(m, BIG, entry)
    assert_other_step_intact(tier, two_steps)


def test_promoting_a_damaged_step_commits_nothing(tier, tmp_path):
    from flowcheck.config import LocalConfig
    from flowcheck.tiers.local import LocalTier

    source = LocalTier(LocalConfig(root=str(tmp_path / "damaged-source")), "r1")
    source.write(make_snapshot(step=10))
    source.write(big_snapshot(20))
    rel, at = shard_bytes_at(source, 20, BIG)
    flip_byte(source, rel, at + 100)
    with pytest.raises(IntegrityError):
        tier.write(source.load(20))
    assert tier.steps() == []
    tier.write(source.load(10))  # the healthy step still promotes
    assert_step_intact(tier, make_snapshot(step=10))


# ---- manifests -----------------------------------------------------------------------------------
def test_a_manifest_with_a_modified_shard_digest_is_refused(tier, two_steps, persistent):
    def edit(raw):
        shard = raw["tensors"][BIG]["shards"][0]
        shard["digest"] = other_digest(shard["digest"])

    edit_manifest(tier, 20, edit, reseal=False)
    with pytest.raises(ManifestError, match="integrity"):
        tier.manifest(20)
    with pytest.raises(ManifestError):
        tier.read(20, "small")
    assert [p.path for p in tier.verify(20)] == ["manifest.json"]
    assert_other_step_intact(tier, two_steps)


def test_a_resealed_manifest_with_a_wrong_shard_digest_fails_the_data_check(tier, two_steps, persistent):
    def edit(raw):
        shard = raw["tensors"]["small"]["shards"][0]
        shard["digest"] = other_digest(shard["digest"])

    edit_manifest(tier, 20, edit, reseal=True)
    m = tier.manifest(20)
    with pytest.raises(IntegrityError, match="small"):
        tier.read_shard(m, "small", m.tensors["small"].shards[0])
    assert tier.verify(20) != []
    assert_other_step_intact(tier, two_steps)


def test_verify_reports_a_manifest_naming_a_path_outside_the_root(tier, two_steps, persistent):
    def edit(raw):
        raw["tensors"]["small"]["shards"][0]["location"][0]["path"] = "../../etc/x"

    edit_manifest(tier, 20, edit, reseal=True)
    problems = tier.verify(20)
    assert [p.path for p in problems] == ["manifest.json"]


# ---- unreachable endpoints ---------------------------------------------------------------------------
@pytest.mark.s3
def test_an_unreachable_s3_endpoint_raises_tier_error_quickly(object_bucket, tmp_path):
    from flowcheck.tiers.object import ObjectTier

    good = ObjectTier(ObjectConfig(url=object_bucket), "r1", staging_dir=str(tmp_path / "staging"))
    snap = make_snapshot(step=10)
    good.write(snap)
    dead_endpoint = ObjectConfig(url=object_bucket, endpoint_url="http://127.0.0.1:1")
    down = ObjectTier(dead_endpoint, "r1", staging_dir=str(tmp_path / "s2"))
    for call in (down.steps, lambda: down.write(make_snapshot(step=20))):
        start = time.monotonic()
        with pytest.raises(TierError, match="127.0.0.1:1") as info:
            call()
        assert time.monotonic() - start < 30
        assert isinstance(info.value, FlowcheckError) and isinstance(info.value, OSError)
    assert good.steps() == [10]
    assert_step_intact(good, snap)
