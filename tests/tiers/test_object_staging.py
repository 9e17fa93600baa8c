"""A write to the object tier, failed or not, leaves no staging folder behind and nothing visible."""
from __future__ import annotations

import os

import numpy as np
import pytest

from flowcheck.config import Config, LocalConfig, ObjectConfig, TiersConfig
from flowcheck.errors import TierError
from flowcheck.state import Shard, TensorSpec
from flowcheck.store import Store
from tests.helpers import make_custom_snapshot, make_snapshot

SPECS = [TensorSpec("a", "float32", (512, 1024)), TensorSpec("b", "float32", (512, 1024))]  # 2 MiB each


def two_file_snapshot(fail_second: bool = False):
    """Two 2 MiB shards: with max_file_mib=1 they go to separate files, so the second fails after the first
    was uploaded (a failure mid-way)."""
    rng = np.random.default_rng(0)
    arrays = {Shard(s.name, (0, 0), s.shape): rng.standard_normal(s.shape, dtype=np.float32) for s in SPECS}
    snap = make_custom_snapshot(SPECS, arrays, step=5)
    if not fail_second:
        return snap
    data = dict(snap.data)
    second = Shard("b", (0, 0), (512, 1024))
    reads = []

    def read_once():  # read for its digest, then the source fails while the files are staged
        reads.append(1)
        if len(reads) > 1:
            raise OSError(5, "Input/output error (injected)")
        return arrays[second]

    data[second] = read_once
    return type(snap)(snap.run, snap.step, snap.layout, data, snap.scalars)


def make_store(tmp_path, url: str | None = None, staging_dir: str | None = None) -> Store:
    obj = ObjectConfig(url=url or f"file://{tmp_path / 'object'}", max_file_mib=1, staging_dir=staging_dir)
    return Store(Config(run="r1", tiers=TiersConfig(local=LocalConfig(root=str(tmp_path / "local")), object=obj)))


def test_a_write_failing_mid_way_leaves_no_staging_folder_and_no_step(tmp_path):
    store = make_store(tmp_path)
    with pytest.raises(TierError, match="step 5"):
        store.write(two_file_snapshot(fail_second=True), "object")
    assert not os.path.exists(tmp_path / "local" / ".staging")
    assert store.object.steps() == [] and store.object.incomplete() == ["step-000000005"]  # GC removes the upload
    store.write(two_file_snapshot(), "object")  # the same step, once the source reads again
    assert store.object.steps() == [5] and not os.path.exists(tmp_path / "local" / ".staging")


def test_a_target_that_refuses_the_upload_leaves_no_staging_folder(tmp_path):
    (tmp_path / "object" / "r1").mkdir(parents=True)
    (tmp_path / "object" / "r1" / "step-000000005").write_text("a file where the step folder should be")
    store = make_store(tmp_path)
    with pytest.raises(TierError, match=r"uploading .*tiers\.object\.url"):
        store.write(make_snapshot(step=5), "object")
    assert not os.path.exists(tmp_path / "local" / ".staging")


def test_a_configured_staging_folder_is_the_users_and_stays(tmp_path):
    staging = tmp_path / "my-staging"
    store = make_store(tmp_path, staging_dir=str(staging))
    with pytest.raises(TierError):
        store.write(two_file_snapshot(fail_second=True), "object")
    store.write(make_snapshot(step=6), "object")
    assert os.listdir(staging) == []
