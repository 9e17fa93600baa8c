"""Lineage you can see: a run resumed from a restore shows as a branch in every view, and `show` walks a step's
chain across branches."""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace

import pytest
from click.testing import CliRunner
from flowcheck.restore.importer import import_checkpoint, import_into
from flowcheck.restore.megatron_common import Target
from flowcheck.restore.service import restore

from flowcheck.cli import main
from tests.restore.conftest import (
    SMALL,
    canonical_state,
    make_store,
    store_config,
    write_reference,
)


def _trained(ref, store, step):
    """A later training state, as a trainer would push it (the tensors need not change for lineage)."""
    return replace(import_checkpoint(ref, store.config.run, step), source="push")


@pytest.fixture(scope="module")
def forked(tmp_path_factory):
    """Step 10 imported; training goes on to 20; step 10 is restored into a Megatron directory, the
    resumed run imports it as 30 (source restore, parent 10) and goes on to 40: a fork after step 10, and
    30 and 40 live on the branch b10-30 (the current branch)."""
    tmp = tmp_path_factory.mktemp("forked")
    arch = SMALL["gqa_swiglu"]
    ref = write_reference(str(tmp / "ref.safetensors"), arch, canonical_state(arch))
    store = make_store(tmp)
    m10 = import_into(store, ref, 10)
    store.write(_trained(ref, store, 20))  # parent: the newest earlier step, 10
    out = restore(store, 10, Target(2, 1, 1, "megatron-dist"), str(tmp / "restored")).out
    m30 = import_into(store, out, 30)
    assert m30.producer.source == "restore" and m30.parent == m10.parent_ref()
    store.write(_trained(ref, store, 40), parent=m30.parent_ref())
    store.promote(40)
    assert store.history().current() == "b10-30"
    return store_config(tmp), store


def _run(*args):
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_json_shows_the_restore_as_a_second_child_of_the_fork_point(forked):
    cfg, _ = forked
    data = json.loads(_run("lineage", "--format", "json", "--config", cfg))
    nodes = {n["step"]: n for n in data["nodes"]}
    assert nodes[10]["children"] == [20, 30]
    assert {"parent_step": 10, "children": [20, 30]} in data["forks"]
    assert nodes[30]["source"] == "restore" and nodes[30]["parent"]["step"] == 10
    assert nodes[40]["tiers"] == ["local", "object"]
    assert {s: n["branch"] for s, n in nodes.items()} == {10: "main", 20: "main", 30: "b10-30", 40: "b10-30"}
    # the default is lineage's cheap check (manifests and links): healthy states are unverified
    assert {n["status"] for n in data["nodes"]} == {"unverified"} and data["verified"] is False
    verified = json.loads(_run("lineage", "--format", "json", "--verify", "--config", cfg))
    assert {n["status"] for n in verified["nodes"]} == {"verified"}


def test_dot_draws_both_branches_from_the_fork_point(forked, tmp_path):
    cfg, store = forked
    out = tmp_path / "lineage.dot"
    _run("lineage", "--format", "dot", "--out", str(out), "--config", cfg)
    dot = out.read_text()
    d = {s: store.manifest(s, branch="main" if s in (10, 20) else None).digest() for s in (10, 20, 30, 40)}
    for parent, child in ((10, 20), (10, 30), (30, 40)):
        assert f'"{d[parent]}" -> "{d[child]}"' in dot
    assert dot.count("->") == 3
    assert f'"{d[10]}" -> "{d[30]}" [penwidth=2.5' in dot  # out of the fork point: bold
    assert "step 30@b10-30\\nrestore\\nlocal" in dot and "step 40@b10-30\\npush\\nlocal,object" in dot
    cluster = dot[dot.index('subgraph "cluster_b10-30"'):]
    assert 'label="branch b10-30"' in cluster and d[40] in cluster[:cluster.index("}")]
    assert "fillcolor=grey85" in dot


def test_text_hangs_each_branch_off_the_fork_point(forked):
    cfg, _ = forked
    lines = _run("lineage", "--config", cfg).splitlines()
    assert [re.sub(r" [0-9a-f]{12}", "", line) for line in lines] == [
        "step 10 [local] import ok",
        "├─ step 20 [local] push ok (fork)",
        "└─ step 30@b10-30 [local] restore ok (fork)",
        "   step 40@b10-30 [local,object] push ok",
    ]


def test_png_is_a_png(forked, tmp_path):
    if shutil.which("dot") is None:
        pytest.skip("Graphviz's `dot` is not installed (Debian package graphviz)")
    cfg, _ = forked
    out = tmp_path / "lineage.png"
    _run("lineage", "--format", "png", "--out", str(out), "--verify", "--config", cfg)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_needs_out_and_names_graphviz_when_dot_is_missing(forked, tmp_path, monkeypatch):
    cfg, _ = forked
    result = CliRunner().invoke(main, ["lineage", "--format", "png", "--config", cfg])
    assert result.exit_code == 2 and "--out" in result.output
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` here
    result = CliRunner().invoke(main, ["lineage", "--format", "png", "--out", str(tmp_path / "x.png"), "--config", cfg])
    assert result.exit_code == 2 and "graphviz" in result.output and not (tmp_path / "x.png").exists()


def test_show_walks_the_chain_to_the_first_step_and_says_what_was_verified(forked):
    cfg, _ = forked
    out = _run("show", "--step", "40", "--config", cfg)
    assert "source=push" in out  # the existing summary stays
    assert "branch     b10-30 (current; forks after step 10 of main)" in out
    assert re.search(r"chain +step 40@b10-30 \[local,object\] <- 30@b10-30 \[local\] <- 10 \[local\] \(root\)", out), out
    assert "manifests verified; files and data not re-read" in out
    assert "local: manifest integrity ok, same digest, unsigned" in out
    verified = _run("show", "--step", "40", "--verify", "--config", cfg)
    assert "verified: manifests, files and shard data" in verified
    assert "object: manifest integrity ok, same digest, unsigned, files and shard data ok" in verified


def test_show_names_a_break_in_the_chain(tmp_path):
    arch = SMALL["gqa_swiglu"]
    ref = write_reference(str(tmp_path / "ref.safetensors"), arch, canonical_state(arch))
    store = make_store(tmp_path)
    import_into(store, ref, 10)
    store.write(import_checkpoint(ref, store.config.run, 20))
    store.write(import_checkpoint(ref, store.config.run, 30))
    shutil.rmtree(tmp_path / "local" / "r1" / "step-000000020")  # lost, not pruned by GC
    out = _run("show", "--step", "30", "--config", store_config(tmp_path))
    assert "chain      step 30 [local] <- 20 (MISSING: not in any tier and not pruned by GC (lineage gap))" in out
    drawn = CliRunner().invoke(main, ["lineage", "--format", "dot", "--config", store_config(tmp_path)])
    assert drawn.exit_code == 1  # a lost step is an audit error: the drawing is written, and the exit says so
    assert "missing\\n(lineage gap)" in drawn.output and "fillcolor=khaki1" in drawn.output


def test_restore_takes_a_step_of_another_branch_with_branch(forked, tmp_path):
    cfg, _ = forked
    result = CliRunner().invoke(main, ["restore", "--step", "20", "--out", str(tmp_path / "a"), "--config", cfg])
    assert result.exit_code == 2
    assert result.output == ("error: step 20 is not committed on branch 'b10-30' of run 'r1'; branch main of the run "
                             "holds a step 20: add --branch main\n")
    out = _run("restore", "--step", "20", "--branch", "main", "--no-optim", "--out", str(tmp_path / "b"), "--config", cfg)
    assert "restored step 20 of run r1 from the local tier" in out
    out = _run("restore", "--step", "40", "--no-optim", "--out", str(tmp_path / "c"), "--config", cfg)
    assert "restored step 40@b10-30 of run r1 from the local tier" in out
