"""A state damaged in one tier and intact in another: automatic reads verify, warn, and read the intact copy;
an explicit tier (``--from local``) reads that tier only and fails with its integrity error."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from flowcheck.errors import IntegrityError
from flowcheck.restore.diff import diff_step, report
from flowcheck.restore.export import export_file
from flowcheck.restore.megatron_common import Target
from flowcheck.restore.service import restore
from flowcheck.restore.source import StepReader, open_step
from flowcheck.store import Store
from tests.helpers import W, flip_shard_byte, global_array, make_snapshot
from tests.restore.conftest import SMALL, canonical_state, make_store, write_reference
from tests.test_store import make_store as make_plain_store


def flip_a_byte(store: Store, step: int, tensor: str) -> str:
    """Flip one byte of ``tensor``'s stored data in the local tier; returns that file."""
    return flip_shard_byte(store.local, step, tensor)


@pytest.fixture
def damaged(tmp_path):
    """Step 10 committed locally and promoted, then a byte of its local copy flipped."""
    store = make_plain_store(tmp_path)
    snap = make_snapshot(step=10)
    store.local.write(snap)
    store.promote(10)
    return store, snap, flip_a_byte(store, 10, W)


def fallback_warnings(caplog, path: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "local tier" in r.getMessage()
            and "step 10" in r.getMessage() and path in r.getMessage() and "object tier" in r.getMessage()]


def test_load_reads_the_intact_copy_and_warns_naming_the_damaged_file(damaged, caplog):
    store, snap, path = damaged
    loaded = store.load(10)  # what the trainer's Checkpointer.load and `flowcheck restore` read through
    for shard in snap.data:
        np.testing.assert_array_equal(loaded.array(shard), snap.array(shard))
    assert fallback_warnings(caplog, path)
    np.testing.assert_array_equal(store.read(10, W), global_array(snap, W))


def test_an_explicit_tier_does_not_fall_back(damaged):
    store, snap, _ = damaged
    loaded = store.load(10, prefer="local")
    with pytest.raises(IntegrityError, match="local tier.*CRC32C"):
        [loaded.array(s) for s in snap.data]
    tier, m = open_step(store, 10, "local")
    with pytest.raises(IntegrityError):
        export_file(tier, m, str(store.config.tiers.local.root) + "-export.safetensors")


def test_export_and_diff_read_the_intact_copy(damaged, tmp_path, caplog):
    store, _, path = damaged
    intact, m = open_step(store, 10, "object")
    export_file(intact, m, str(tmp_path / "reference.safetensors"))
    tier, m = open_step(store, 10)
    assert tier.name == "local"  # the fastest tier still serves every intact shard
    export_file(tier, m, str(tmp_path / "out.safetensors"))
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    assert fallback_warnings(caplog, path)
    caplog.clear()
    result = report(diff_step(*open_step(store, 10), str(tmp_path / "reference.safetensors")))
    assert result["bit_exact"] and fallback_warnings(caplog, path)
    with pytest.raises(IntegrityError):
        diff_step(*open_step(store, 10, "local"), str(tmp_path / "reference.safetensors"))


def test_a_damaged_local_manifest_is_read_from_the_object_tier(damaged, caplog):
    store, _, _ = damaged
    manifest = os.path.join(store.local.root, "step-000000010", "manifest.json")
    with open(manifest, "r+b") as f:
        f.seek(40)
        f.write(b"#")
    tier, m = open_step(store, 10)
    assert tier.name == "object" and m.digest() == store.object.manifest(10).digest()
    assert any("manifest damaged" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_restore_reads_the_intact_copy_with_automatic_choice_only(tmp_path, caplog):
    from flowcheck.restore.importer import import_into

    arch = SMALL["gqa_swiglu"]
    state = canonical_state(arch, optim=False)
    store = make_store(tmp_path)
    import_into(store, write_reference(str(tmp_path / "ref.safetensors"), arch, state), 10)
    store.promote(10)
    path = flip_a_byte(store, 10, "embedding.word_embeddings.weight")
    out = restore(store, 10, Target(2, 1, 1, "megatron", optim=False), str(tmp_path / "out"))
    assert out.tier == "local" and fallback_warnings(caplog, path)
    reader = StepReader.open(store, 10)
    assert np.array_equal(reader.tensor("embedding.word_embeddings.weight").numpy(),
                          state["embedding.word_embeddings.weight"].numpy())
    with pytest.raises(IntegrityError):
        restore(store, 10, Target(2, 1, 1, "megatron", optim=False), str(tmp_path / "out2"), prefer="local")
