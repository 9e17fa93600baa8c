"""Many checkpoint nodes, one step: three real node processes write one step to one object store.

Each node (``tests/integration/multinode_node.py``) owns a third of the shards; the step exists
only once every node's part is committed and one step manifest lists them. Runs against a moto
S3 server over HTTP, and against file://.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from flowcheck.restore.export import export_file
from flowcheck.tiers import cluster

from flowcheck.audit import audit
from flowcheck.config import (
    Config,
    LocalConfig,
    ObjectConfig,
    PolicyConfig,
    TierPolicy,
    TiersConfig,
)
from flowcheck.store import Store
from tests.conftest import OBJECT_SERVERS, bucket_on
from tests.integration.multinode_node import RUN, full_state, owned

NODES = ["n0", "n1", "n2"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(params=[*OBJECT_SERVERS, "file"])
def url(request, tmp_path):
    return f"file://{tmp_path / 'object'}" if request.param == "file" else bucket_on(request, request.param)


def run_nodes(url, tmp_path, step, *, barrier=False, die=(), wait=60.0) -> dict[str, tuple[int, dict]]:
    """Start one process per node at once; wait for all; {node: (exit code, printed JSON)}."""
    extra = []
    if barrier:
        os.makedirs(tmp_path / f"barrier-{step}")
        extra = ["--barrier", str(tmp_path / f"barrier-{step}")]
    procs = {
        n: subprocess.Popen(
            [sys.executable, "-m", "tests.integration.multinode_node", "--url", url, "--node", n, "--nodes", ",".join(NODES),
             "--step", str(step), "--work", str(tmp_path / "nodes"), "--wait", str(wait), *extra,
             *(["--die-before-commit"] if n in die else [])],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for n in NODES
    }
    out = {}
    for n, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        lines = stdout.decode().strip().splitlines()
        out[n] = (p.returncode, json.loads(lines[-1]) if lines else {"stderr": stderr.decode()[-4000:]})
    return out


def reader(url, tmp_path) -> Store:
    """A store that only reads the shared object tier (restore / audit / GC on any machine)."""
    return Store(Config(run=RUN, node="reader", tiers=TiersConfig(
        local=LocalConfig(root=str(tmp_path / "reader-local")), object=ObjectConfig(url=url, max_file_mib=1)),
        policy=PolicyConfig(object=TierPolicy(keep_last=5, tmp_grace_seconds=3600))))


def assert_step_is_full_state(store: Store, step: int, tmp_path) -> None:
    want = full_state(step)
    for name, arr in want.items():
        got = store.read(step, name, prefer="object")
        assert got.dtype == arr.dtype and got.tobytes() == arr.tobytes(), name
    m = store.manifest(step, prefer="object")
    out = str(tmp_path / f"export-{step}.safetensors")
    export_file(store.object, m, out)
    exported = safetensors.torch.load_file(out)  # any safetensors reader opens the export
    assert set(exported) == set(want)
    for name, arr in want.items():
        assert exported[name].reshape(-1).view(torch.uint8).numpy().tobytes() == arr.tobytes(), name


def test_three_node_processes_racing_commit_exactly_one_step(url, tmp_path):
    results = run_nodes(url, tmp_path, 10, barrier=True)  # all parts in, then all race for manifest.json
    assert all(rc == 0 for rc, _ in results.values()), results
    assert len({r["digest"] for _, r in results.values()}) == 1
    assert sum(r["won"] for _, r in results.values()) == 1, results

    store = reader(url, tmp_path)
    assert store.object.steps() == [10]
    m = store.object.manifest(10)
    assert m.format_version == 2 and [n.node for n in m.nodes] == NODES
    assert m.digest() == results["n0"][1]["digest"]
    for node in NODES:  # every shard's bytes lie in the files of the node that owns it
        for shard in owned(NODES, node):
            entry = next(e for e in m.tensors[shard.tensor].shards if e.offsets == shard.offsets)
            assert all(p.path.startswith(cluster.part_dir(10, node) + "/") for p in entry.location)
    assert_step_is_full_state(store, 10, tmp_path)
    report = audit(store)
    assert report.ok and not report.problems, [str(p) for p in report.problems]


def test_a_node_killed_before_its_part_commits_leaves_no_step_and_gc_cleans_it(url, tmp_path):
    assert all(rc == 0 for rc, _ in run_nodes(url, tmp_path, 10).values())
    # the survivors wait long enough for each other on a loaded machine, then give up on n2 alone
    results = run_nodes(url, tmp_path, 20, die={"n2"}, wait=8.0)
    assert results["n2"][0] == -9  # SIGKILL after uploading its files
    for n in ("n0", "n1"):
        assert results[n][0] == 3 and "['n2']" in results[n][1]["incomplete"], results[n]

    store = reader(url, tmp_path)
    assert store.object.steps() == [10]  # step 20 is not visible anywhere
    assert store.find("latest").name == "object" and store.manifest("latest").step == 10
    assert store.object.incomplete() == ["step-000000020"]
    report = audit(store)
    assert report.ok and [p.severity for p in report.problems] == ["warning"]

    removed = store.object.clean_incomplete(older_than_s=0)  # GC after the grace period
    assert any("step-000000020" in r for r in removed)
    fs = store.object.fs
    fs.invalidate_cache()
    assert not fs.exists(store.object._p("step-000000020"))
    assert store.object.incomplete() == []
    assert_step_is_full_state(store, 10, tmp_path)  # the previous committed step is intact
    assert audit(store).ok and not audit(store).problems
