"""The CLI as users run it: help with examples, audit exit codes, clear errors (the demo: tests/test_demo.py)."""
from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from flowcheck.cli import main
from tests.test_audit import rolled_back

COMMANDS = ["ls", "show", "diff", "capture", "plan", "snapshot", "promote", "export", "restore", "import", "serve", "audit", "lineage", "gc", "demo"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example_and_config_option(command):
    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0
    assert "Example:" in result.output and "--config" in result.output


def _run(*args, env=None):
    return CliRunner().invoke(main, list(args), env=env)


def test_audit_exits_1_on_a_flipped_byte(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: r\ntiers:\n  local: {{root: {tmp_path / 'l'}}}\n  object: {{url: 'file://{tmp_path / 'o'}'}}\n")
    import torch

    torch.save({"w": torch.ones(64, 64)}, tmp_path / "state.pt")
    assert _run("snapshot", "--state", str(tmp_path / "state.pt"), "--step", "5", "--config", str(cfg)).exit_code == 0
    assert _run("promote", "--config", str(cfg)).exit_code == 0
    assert _run("audit", "--config", str(cfg)).exit_code == 0
    (shard,) = (tmp_path / "o" / "r" / "step-000000005").glob("attempt-*/shard-00000-of-00001.safetensors")
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x10
    shard.write_bytes(bytes(raw))
    result = _run("audit", "--config", str(cfg))
    assert result.exit_code == 1 and "shard-00000-of-00001.safetensors" in result.output


def test_errors_are_one_clear_line(tmp_path):
    result = _run("show", "--step", "7", "--config", str(tmp_path / "missing.yaml"))
    assert result.exit_code == 2 and result.output.startswith("error: config file")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"tiers:\n  local: {{root: {tmp_path / 'l'}}}\n  object: {{url: 'file://{tmp_path / 'o'}'}}\n")
    result = _run("show", "--step", "7", "--config", str(cfg))
    assert result.exit_code == 2 and "(asked for step 7)" in result.output and result.output.count("\n") == 1
    result = _run("show", "--step", "abc", "--config", str(cfg))
    assert result.exit_code == 2 and "expected a step number, 'latest' or a manifest digest prefix" in result.output


def test_signed_manifests_and_required_signatures(tmp_path, monkeypatch):
    cfg = tmp_path / "c.yaml"
    base = f"run: r\ntiers:\n  local: {{root: {tmp_path / 'l'}}}\n  object: {{url: 'file://{tmp_path / 'o'}'}}\n"
    cfg.write_text(base)
    import torch

    torch.save({"w": torch.ones(4)}, tmp_path / "s.pt")
    assert _run("snapshot", "--state", str(tmp_path / "s.pt"), "--step", "1", "--config", str(cfg)).exit_code == 0
    strict = tmp_path / "strict.yaml"
    strict.write_text(base + "signing: {required: true}\n")
    monkeypatch.setenv("FLOWCHECK_HMAC_KEY", "k3y-for-tests")
    result = _run("audit", "--config", str(strict))
    assert result.exit_code == 1 and "unsigned" in result.output  # step 1 was written without a key
    assert _run("snapshot", "--state", str(tmp_path / "s.pt"), "--step", "2", "--config", str(strict)).exit_code == 0
    manifest = json.loads((tmp_path / "l" / "r" / "step-000000002" / "manifest.json").read_text())
    assert manifest["signature"]["alg"] == "hmac-sha256"
    monkeypatch.setenv("FLOWCHECK_HMAC_KEY", "another-key")
    result = _run("show", "--step", "2", "--config", str(strict))
    assert result.exit_code == 2 and "HMAC does not match" in result.output
    assert "k3y-for-tests" not in result.output


def _config(tmp_path, run: str = "r1") -> str:
    """A config for the stores tests.test_store.make_store builds under tmp_path."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: {run}\ntiers:\n  local: {{root: {tmp_path / 'local'}}}\n"
                   f"  object: {{url: 'file://{tmp_path / 'object'}'}}\n")
    return str(cfg)


@pytest.fixture
def rollback(tmp_path):
    """Steps 1..3 on main, then a rollback to 1 and a different step 2 on branch b1-2 (the current branch)."""
    return _config(tmp_path), rolled_back(tmp_path)


def test_ls_lists_every_branch_of_every_tier_and_marks_the_current_one(rollback):
    cfg, store = rollback
    rows = json.loads(_run("ls", "--json", "--config", cfg).output)
    assert [(r["tier"], r["branch"], r["step"], r["current"]) for r in rows] == [
        ("local", "main", 1, False), ("local", "main", 2, False), ("local", "main", 3, False),
        ("local", "b1-2", 2, True), ("object", "main", 3, False)]
    assert rows[3]["digest"] == store.manifest(2, "local").digest() != rows[1]["digest"]
    text = _run("ls", "--config", cfg).output.splitlines()
    assert "current branch b1-2" in text[0] and text[1].split()[:3] == ["tier", "branch", "step"]
    assert text[5].split()[:3] == ["local", "b1-2", "*"] and text[3].split()[:3] == ["local", "main", "2"]


def test_ls_shows_incomplete_writes_of_a_branch(rollback):
    cfg, store = rollback
    os.makedirs(os.path.join(store.local.root, "branches", "b1-2", "step-000000003.tmp"))
    rows = json.loads(_run("ls", "--json", "--config", cfg).output)
    assert rows[4]["branch"] == "b1-2" and rows[4]["step"] is None
    assert rows[4]["status"] == "incomplete (step-000000003.tmp)"


def test_ls_run_lists_another_run_of_the_store(tmp_path):
    from dataclasses import replace

    from flowcheck.store import Store
    from tests.helpers import make_snapshot
    from tests.test_store import make_store

    make_store(tmp_path).local.write(make_snapshot(step=1))
    other = make_store(tmp_path)
    other = Store(replace(other.config, run="other"))
    other.local.write(make_snapshot(run="other", step=7))
    cfg = _config(tmp_path)
    assert [r["step"] for r in json.loads(_run("ls", "--json", "--config", cfg).output)] == [1]
    result = _run("ls", "--run", "other", "--config", cfg)
    assert result.exit_code == 0 and result.output.startswith("run other ")
    rows = [line.split()[:3] for line in result.output.splitlines()[2:] if not line.startswith("(")]
    assert rows == [["local", "main", "*"]]
    assert "exists and holds no steps of run other" in result.output or "is not created yet" in result.output
    assert json.loads(_run("ls", "--run", "other", "--json", "--config", cfg).output)[0]["step"] == 7


def test_show_resolves_the_step_on_the_current_branch_or_the_one_named(rollback):
    cfg, store = rollback
    new, old = store.manifest(2, "local").digest(), store.manifest(2, "local", branch="main").digest()
    out = _run("show", "--step", "2", "--config", cfg).output
    assert out.startswith("run r1 step 2@b1-2 ") and f"digest     {new}" in out
    assert "branch     b1-2 (current; forks after step 1 of main)" in out
    assert "tiers      local\n" in out and "chain      step 2@b1-2 [local] <- 1 [local] (root)" in out
    out = _run("show", "--step", "2", "--branch", "main", "--config", cfg).output
    assert out.startswith("run r1 step 2 ") and f"digest     {old}" in out and "branch     main\n" in out
    assert "local: manifest integrity ok, same digest" in out
    by_digest = _run("show", "--step", old[:16], "--config", cfg)
    assert by_digest.exit_code == 0 and f"digest     {old}" in by_digest.output


def test_a_step_only_another_branch_holds_is_one_clear_line_naming_that_branch(rollback):
    cfg, _ = rollback
    result = _run("show", "--step", "3", "--config", cfg)
    assert result.exit_code == 2
    assert result.output == ("error: step 3 is not committed on branch 'b1-2' of run 'r1'; branch main of the run "
                             "holds a step 3: add --branch main\n")
    result = _run("show", "--step", "1", "--branch", "nope", "--config", cfg)
    assert result.exit_code == 2 and result.output.startswith("error: run 'r1' has no branch 'nope'")
    result = _run("show", "--step", "sha256:", "--config", cfg)
    assert result.exit_code == 2 and "manifest digest prefix 'sha256:<hex>'" in result.output


def test_promote_and_export_take_branch(rollback, tmp_path):
    cfg, store = rollback
    result = _run("promote", "--step", "2", "--branch", "main", "--config", cfg)
    assert result.exit_code == 0 and result.output.startswith("step 2 committed in the object tier")
    assert store.tier("object").steps() == [2, 3] and store.tier("object", "b1-2").steps() == []
    result = _run("promote", "--config", cfg)  # latest: the current branch's head
    assert result.exit_code == 0 and result.output.startswith("step 2@b1-2 committed in the object tier")
    assert store.tier("object", "b1-2").steps() == [2]
    result = _run("export", "--step", "2", "--branch", "main", "--out", str(tmp_path / "m.safetensors"), "--config", cfg)
    assert result.exit_code == 0 and "exported step 2 from the" in result.output
    result = _run("export", "--step", "2", "--out", str(tmp_path / "b.safetensors"), "--config", cfg)
    assert result.exit_code == 0 and "exported step 2@b1-2 from the" in result.output
    assert (tmp_path / "m.safetensors").read_bytes() != (tmp_path / "b.safetensors").read_bytes()


def test_audit_reports_a_rollback_fork_as_information_and_passes(rollback):
    cfg, _ = rollback
    result = _run("audit", "--config", cfg)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "[info] lineage fork after step 1 (branch main): branches main, b1-2 start at steps 2, 2",
        "audit OK: 5 step copies checked, 4 distinct states on 2 branches, 0 errors, 0 warnings"]


def test_gc_prints_states_with_their_branch_and_why_each_goes(tmp_path):
    from tests.test_store import make_store

    rolled_back(tmp_path)
    cfg = _config(tmp_path)
    with open(cfg, "a") as f:
        f.write("policy:\n  local: {keep_last: 1}\n  object: {keep_last: 1}\n")
    result = _run("gc", "--dry-run", "--config", cfg)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "local: would delete steps [1]; keeps [2, 2@b1-2, 3]"
    assert lines[1] == "local:   1: superseded on the current branch"
    assert make_store(tmp_path).local.steps() == [1, 2, 3]  # a dry run


def test_export_never_writes_inside_a_tier(tmp_path):
    """`export --out` naming a committed step's manifest.json (or any path in a tier's folder) is refused in one
    line, exit 2, and the step stays intact (issue 34, item 7)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: r\ntiers:\n  local: {{root: {tmp_path / 'l'}}}\n  object: {{url: 'file://{tmp_path / 'o'}'}}\n")
    import torch

    torch.save({"w": torch.ones(64, 64)}, tmp_path / "state.pt")
    assert _run("snapshot", "--state", str(tmp_path / "state.pt"), "--step", "5", "--config", str(cfg)).exit_code == 0
    assert _run("promote", "--config", str(cfg)).exit_code == 0
    manifest = tmp_path / "l" / "r" / "step-000000005" / "manifest.json"
    before = manifest.read_bytes()
    for out in (manifest, tmp_path / "o" / "r" / "x.safetensors", tmp_path / "l" / "new.safetensors"):
        result = _run("export", "--step", "5", "--out", str(out), "--config", str(cfg))
        assert result.exit_code == 2 and "expected a path outside the store" in result.output, result.output
        assert result.output.count("\n") == 1
    assert manifest.read_bytes() == before and _run("audit", "--config", str(cfg)).exit_code == 0
    assert _run("export", "--step", "5", "--out", str(tmp_path / "x.safetensors"), "--config", str(cfg)).exit_code == 0


@pytest.mark.parametrize("target", ["..", "outside", "other-run"])
def test_a_symlinked_branch_folder_is_never_a_branch(tmp_path, target):
    """`branches/x` as a symlink (to main's folder, outside the store, another run's folder): not listed, a delete
    naming it is refused, GC collects nothing through it, and audit reports it as an error (issue 34, item 4)."""
    import torch

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: r\ntiers:\n  local: {{root: {tmp_path / 'l'}}}\n  object: {{url: 'file://{tmp_path / 'o'}'}}\n")
    torch.save({"w": torch.ones(8, 8)}, tmp_path / "state.pt")
    assert _run("snapshot", "--state", str(tmp_path / "state.pt"), "--step", "10", "--config", str(cfg)).exit_code == 0
    victim = {"..": tmp_path / "l" / "r", "outside": tmp_path / "elsewhere", "other-run": tmp_path / "l" / "other"}[target]
    (victim / "step-000000010").mkdir(parents=True, exist_ok=True)
    (victim / "step-000000010" / "manifest.json").write_text("{}") if target != ".." else None
    (tmp_path / "l" / "r" / "branches").mkdir()
    (tmp_path / "l" / "r" / "branches" / "x").symlink_to(victim if target != ".." else "..")
    listing = _run("ls", "--config", str(cfg))
    assert listing.exit_code == 0 and listing.output.count("step 10") <= 1 and "@x" not in listing.output
    deleted = _run("delete", "--step", "10", "--branch", "x", "--tier", "local", "--config", str(cfg))
    assert deleted.exit_code == 2 and "has no branch 'x'" in deleted.output, deleted.output
    assert (victim / "step-000000010").exists()
    _run("gc", "--config", str(cfg))
    assert (victim / "step-000000010").exists() and (tmp_path / "l" / "r" / "step-000000010").exists()
    result = _run("audit", "--config", str(cfg))
    assert result.exit_code == 1 and "is a symlink" in result.output and "not a branch folder" in result.output


# ---- every error a user can cause: one line, a documented exit status -------------------------------------------

def _cli(*args: str, cwd=None, close_stdout: bool = False):
    """A real `flowcheck` process: (exit status, stdout, stderr).  ``close_stdout``: its reader goes away at once,
    as `| head -1` does once it has its line."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "flowcheck", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd)
    if close_stdout:
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(120)
        return proc.returncode, "", err
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


@pytest.fixture
def two_runs(tmp_path):
    """Run r1: steps 1 and 2 in local, step 1 promoted to object; run other: step 7 in local."""
    from dataclasses import replace

    from flowcheck.store import Store
    from tests.helpers import make_snapshot
    from tests.test_store import make_store

    store = make_store(tmp_path)
    store.write(make_snapshot(step=1))
    store.promote(1)
    store.write(make_snapshot(step=2, seed=1))
    Store(replace(store.config, run="other")).write(make_snapshot(run="other", step=7))
    return _config(tmp_path)


def test_every_error_a_user_can_cause_is_one_line_with_a_documented_exit_status(tmp_path, two_runs):
    cfg = two_runs
    (tmp_path / "bad.yaml").write_text("run: r1\ntiers:\n  local: [oops\n")
    (tmp_path / "keep.yaml").write_text("policy:\n  object:\n    keep_last: 0\n")
    (tmp_path / "gone.yaml").write_text(f"run: r1\ntiers:\n  local: {{root: {tmp_path / 'gone' / 'local'}}}\n"
                                        f"  object: {{url: 'file://{tmp_path / 'gone' / 'object'}'}}\n")
    gone = str(tmp_path / "gone")
    cases = [  # (argv, expected exit status, what the line must say)
        (["ls", "--config", str(tmp_path / "bad.yaml")], 2, "bad.yaml': not valid YAML: line 4, column 1"),
        (["ls", "--config", str(tmp_path / "keep.yaml")], 2, "policy.object.keep_last: expected >= 1"),
        (["show", "--step", "abc", "--config", cfg], 2, "Invalid value for --step"),
        (["show", "--step", "9", "--config", cfg], 2, "step 9 is not committed"),
        (["promote", "--step", "2", "--to", "local", "--config", cfg], 2, "not committed in object (held by: local)"),
        (["lineage", "--config", str(tmp_path / "gone.yaml")], 2, gone),
        (["gc", "--config", str(tmp_path / "gone.yaml")], 2, gone),
        (["audit", "--config", str(tmp_path / "gone.yaml")], 2, gone),
        (["show", "--step", "1", "--config", str(tmp_path / "gone.yaml")], 2, gone),
        (["export", "--step", "1", "--out", str(tmp_path / "x.safetensors"), "--config", str(tmp_path / "gone.yaml")],
         2, gone),
        (["restore", "--step", "1", "--tp", "1", "--pp", "1", "--out", str(tmp_path / "r"), "--config",
          str(tmp_path / "gone.yaml")], 2, gone),
    ]
    for argv, status, said in cases:
        code, _, err = _cli(*argv)
        assert code == status and err.startswith("error: ") and err.count("\n") == 1 and said in err, (argv, code, err)
    for argv in (["show", "--step", "1", "--config", cfg], ["ls", "--config", cfg]):  # `| head -1`
        code, _, err = _cli(*argv, close_stdout=True)
        assert code == 141 and err == "", (argv, code, err)


def test_audit_lineage_and_gc_take_run_like_ls(two_runs):
    cfg = two_runs
    view = json.loads(_run("lineage", "--run", "other", "--format", "json", "--config", cfg).output)
    assert [n["step"] for n in view["nodes"]] == [7]
    result = _run("audit", "--run", "other", "--no-data", "--config", cfg)
    assert result.exit_code == 0 and "1 distinct states" in result.output, result.output
    result = _run("gc", "--run", "other", "--dry-run", "--config", cfg)
    assert result.exit_code == 0 and "keeps [7]" in result.output, result.output
    result = _run("show", "--run", "other", "--step", "7", "--config", cfg)
    assert result.exit_code == 0 and result.output.startswith("run other step 7"), result.output
