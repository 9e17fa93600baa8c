"""A run belongs to the experiment that first wrote it: another config pointing the same run name and local root at
another object store is refused before it writes, naming both (issue: two experiments with the default run name)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from flowcheck.identity import IDENTITY, RunIdentityError
from flowcheck.store import Store
from tests.helpers import make_snapshot
from tests.test_store import make_store


def _experiment_config(folder, name: str) -> str:
    """A config file in its own folder, with the default run name and one shared local root (as in the issue)."""
    os.makedirs(folder / name, exist_ok=True)
    path = folder / name / "fc.yaml"
    path.write_text(f"tiers:\n  local: {{root: {folder / 'shared-local'}}}\n  object: {{url: file://./object}}\n"
                    "policy:\n  local: {keep_last: 5}\n")
    return str(path)


def test_a_second_experiment_on_one_run_and_local_root_is_refused_and_the_first_keeps_its_latest(tmp_path):
    """The issue's attack through the CLI: experiment 2 snapshots into experiment 1's run; refused in one line, and
    experiment 1's `--step latest` still exports its own state."""
    one, two = _experiment_config(tmp_path, "exp1"), _experiment_config(tmp_path, "exp2")
    cli = [sys.executable, "-m", "flowcheck"]
    for name, value in (("s1", 1.0), ("s2", 2.0)):
        save_file({"w": np.full((4, 4), value, dtype=np.float32)}, str(tmp_path / f"{name}.safetensors"))
    ok = subprocess.run(cli + ["snapshot", "--config", one, "--state", str(tmp_path / "s1.safetensors"), "--step", "5"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(cli + ["snapshot", "--config", two, "--state", str(tmp_path / "s2.safetensors"),
                                    "--step", "6"], capture_output=True, text=True)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "belongs to another experiment" in refused.stderr
    out = tmp_path / "out.safetensors"
    done = subprocess.run(cli + ["export", "--config", one, "--step", "latest", "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert np.array_equal(load_file(str(out))["w"], np.full((4, 4), 1.0, dtype=np.float32))


def test_the_conflict_is_refused_before_anything_is_written_and_names_both_experiments(tmp_path):
    from flowcheck.config import load

    one, two = load(_experiment_config(tmp_path, "exp1")), load(_experiment_config(tmp_path, "exp2"))
    a = Store(one)
    first = a.write(make_snapshot(run="default", step=5, seed=1), "local")
    b = Store(two)
    with pytest.raises(RunIdentityError) as e:
        b.write(make_snapshot(run="default", step=6, seed=2), "local")
    message = str(e.value)
    assert "belongs to another experiment" in message and str(tmp_path / "exp1" / "object") in message
    assert str(tmp_path / "exp2" / "object") in message and "its own run name" in message
    with pytest.raises(RunIdentityError):
        b.gc()
    with pytest.raises(RunIdentityError):
        b.delete(5, force=True)
    assert Store(one).local.steps() == [5]
    assert Store(one).locate("latest")[1] == 5 and Store(one).local.manifest(5).digest() == first.digest()
    # the override the message names: another run name for the second experiment
    import dataclasses

    Store(dataclasses.replace(two, run="exp2")).write(make_snapshot(run="exp2", step=6, seed=2), "local")
    assert Store(one).local.steps() == [5]


def test_the_same_experiment_may_gain_an_object_tier_and_a_copied_store_is_bound_where_it_is(tmp_path):
    import dataclasses

    from flowcheck.config import ObjectConfig

    store = make_store(tmp_path)
    bare = dataclasses.replace(store.config, tiers=dataclasses.replace(store.config.tiers, object=ObjectConfig(enabled=False)))
    Store(bare).write(make_snapshot(step=1), "local")  # no object tier yet: the record names none
    Store(store.config).write(make_snapshot(step=2, seed=2), "local")  # it gains one: the record takes its URL
    shutil.copytree(tmp_path / "local", tmp_path / "copy" / "local")
    store.promote(2)
    shutil.copytree(tmp_path / "object", tmp_path / "copy" / "object")
    moved = make_store(tmp_path / "copy")
    moved.write(make_snapshot(step=3, seed=3), "local")
    assert moved.local.steps() == [1, 2, 3]
    with open(os.path.join(moved.local.root, IDENTITY)) as f:
        assert str(tmp_path / "copy" / "object") in f.read()
