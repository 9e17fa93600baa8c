"""``dcp.async_save`` through ``flowcheck.dcp.Writer`` to S3 (moto, then the SeaweedFS cluster, on loopback): 4 FSDP2 ranks keep training
while the save is in flight, the step is invisible until every rank's part is in and the coordinator committed it,
and it then reads back equal to DCP's own FileSystemWriter copy; a rank killed mid-save leaves nothing committed,
and GC removes what it left."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import flowcheck.dcp
from flowcheck.store import open_store
from tests.dcp import fsdp
from tests.dcp.test_dcp_fsdp import config, flat

pytestmark = pytest.mark.s3
K, N = 2, 5


def test_async_save_to_s3_lets_training_go_on_and_commits_the_step_only_when_complete(object_bucket, tmp_path):
    cfg = config(str(tmp_path), object_bucket)
    fsdp.spawn(fsdp.async_save, 4, cfg, K, N, str(tmp_path / "fs"), str(tmp_path / "gate"), str(tmp_path / "log.json"))
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["saved"] is True
    # after async_save returned, the loop trained on (steps K+1..N) while the save waited at its gate: in flight,
    # nothing of the step visible
    assert log["in_flight"] == {"done": False, "steps": []}
    assert sorted(int(s) for s in log["losses"]) == list(range(1, N + 1))
    assert log["after"] == [K]
    store = open_store(cfg)
    m = store.object.manifest(K)
    assert [n.node for n in m.nodes] == ["objects", "rank-00000", "rank-00001", "rank-00002", "rank-00003"]
    ours = flat(fsdp.full_state(flowcheck.dcp.Reader(cfg, step=K, prefer="object")))
    theirs = flat(fsdp.full_state(FileSystemReader(str(tmp_path / "fs"))))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], v) if isinstance(v, torch.Tensor) else ours[k] == v for k, v in theirs.items())
    done = subprocess.run([sys.executable, "-m", "flowcheck", "--config", cfg, "audit"], check=False, capture_output=True, text=True)
    assert done.returncode == 0 and "0 errors, 0 warnings" in done.stdout, done.stdout + done.stderr


def test_a_rank_killed_mid_save_leaves_nothing_committed_and_gc_removes_its_parts(object_bucket, tmp_path):
    cfg = config(str(tmp_path), object_bucket)
    with pytest.raises(torch.multiprocessing.ProcessExitedException):
        fsdp.spawn(fsdp.async_save, 4, cfg, K, N, str(tmp_path / "fs"), str(tmp_path / "gate"),
                   str(tmp_path / "log.json"), 1)
    store = open_store(cfg)
    assert store.object.steps() == [] and store.local.steps() == []
    tier = store.object
    left = tier._files(f"step-{K:09d}")  # noqa: SLF001 - what the save left under the step's prefix
    assert any("/nodes/rank-00001/" in p for p in left), left  # the killed rank had stored its part
    done = subprocess.run([sys.executable, "-m", "flowcheck", "--config", cfg, "gc"], check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert tier._files(f"step-{K:09d}") == {}  # noqa: SLF001
    done = subprocess.run([sys.executable, "-m", "flowcheck", "--config", cfg, "audit"], check=False, capture_output=True, text=True)
    assert "0 errors" in done.stdout, done.stdout + done.stderr
