"""A deleted DCP step that a later step references keeps every file the reference names (issue 34, item 1).

A DCP step keeps its packs under ``nodes/<part>/packs/``; the folder a delete retains for a later step's references
used to lose them (only a top-level ``packs/`` was kept), so the later step's bytes were gone.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

import flowcheck.dcp
from flowcheck.audit import audit
from flowcheck.cli import main
from flowcheck.store import open_store
from tests.dcp.test_dcp_fsdp import config


def _run(*args: str) -> None:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output


def test_deleting_a_dcp_step_keeps_the_bytes_a_later_step_references(tmp_path):
    cfg = config(str(tmp_path))
    w = torch.randn(256, 64)
    dcp.save({"model": {"w": w}}, storage_writer=flowcheck.dcp.Writer(cfg, run="gpt", step=7))
    out = str(tmp_path / "x.safetensors")
    _run("export", "--config", cfg, "--step", "7", "--out", out)
    _run("snapshot", "--config", cfg, "--state", out, "--step", "8")  # stores references to step 7's bytes
    store = open_store(cfg)
    assert store.local.manifest(8).refs, "step 8 should reference step 7's files"
    _run("delete", "--config", cfg, "--step", "7", "--tier", "local")
    report = audit(open_store(cfg))
    assert report.ok, report.problems
    store = open_store(cfg)
    m = store.local.manifest(8)
    for name in m.tensors:
        assert np.array_equal(store.local.read(8, name), w.numpy()), name
    _run("gc", "--config", cfg)  # a GC sweep of the retained holder keeps what step 8 needs, too
    assert audit(open_store(cfg)).ok
