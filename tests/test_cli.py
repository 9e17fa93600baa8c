"""The CLI as users run it: help with examples, the demo end to end, audit exit codes, clear errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from flowcheck.cli import main

COMMANDS = ["ls", "show", "diff", "capture", "plan", "snapshot", "promote", "export", "restore", "import", "serve", "audit", "lineage", "gc", "demo"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example_and_config_option(command):
    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0
    assert "Example:" in result.output and "--config" in result.output


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    """The README's main job, shortened: a real `flowcheck demo` process."""
    workdir = tmp_path_factory.mktemp("demo") / "work"
    exe = os.path.join(os.path.dirname(sys.executable), "flowcheck")
    proc = subprocess.run([exe, "demo", "--workdir", str(workdir), "--steps", "40", "--local-every", "10",
                           "--object-seconds", "0.5"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bit for bit: True" in proc.stdout and "audit OK" in proc.stdout
    # a trainer process pushed to a node process, was killed, restored and resumed with identical losses
    assert "then killed (SIGKILL)" in proc.stdout
    assert "losses identical to the uninterrupted run bit for bit: True" in proc.stdout
    # mirror capture: a simulated DP ring's state rebuilt from mirrored frames equals the trainer's
    assert "== trainer's state bit for bit: True" in proc.stdout
    return workdir


def _run(*args, env=None):
    return CliRunner().invoke(main, list(args), env=env)


def test_demo_leaves_a_config_every_command_accepts(demo_dir):
    cfg = str(demo_dir / "flowcheck.yaml")
    ls = _run("ls", "--config", cfg, "--json")
    rows = json.loads(ls.output)
    assert {r["tier"] for r in rows} == {"local", "object"} and all(r["status"] == "committed" for r in rows)
    assert _run("audit", "--config", cfg).exit_code == 0
    show = _run("show", "--step", "latest", "--config", cfg)
    assert show.exit_code == 0 and "source=push" in show.output
    assert "step 40" in _run("lineage", "--config", cfg).output
    assert "digraph" in _run("lineage", "--format", "dot", "--config", cfg).output
    assert _run("gc", "--dry-run", "--config", cfg).exit_code == 0


def test_export_is_loadable_by_safetensors(demo_dir, tmp_path):
    out = tmp_path / "model.safetensors"
    result = _run("export", "--step", "40", "--format", "safetensors", "--out", str(out), "--no-optim",
                  "--config", str(demo_dir / "flowcheck.yaml"))
    assert result.exit_code == 0, result.output
    tensors = load_file(str(out))
    assert "head.weight" in tensors and not any(k.startswith("optimizer.") for k in tensors)


def test_demo_refuses_a_non_empty_foreign_folder(tmp_path):
    (tmp_path / "precious.txt").write_text("do not touch")
    result = _run("demo", "--workdir", str(tmp_path), "--steps", "1")
    assert result.exit_code == 2 and "expected a new or empty folder" in result.output
    assert (tmp_path / "precious.txt").read_text() == "do not touch"


def test_audit_exits_1_on_a_flipped_byte(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: r\ntiers:\n  local: {{root: {tmp_path / 'l'}}}\n  object: {{url: 'file://{tmp_path / 'o'}'}}\n")
    import torch

    torch.save({"w": torch.ones(64, 64)}, tmp_path / "state.pt")
    assert _run("snapshot", "--state", str(tmp_path / "state.pt"), "--step", "5", "--config", str(cfg)).exit_code == 0
    assert _run("promote", "--config", str(cfg)).exit_code == 0
    assert _run("audit", "--config", str(cfg)).exit_code == 0
    shard = tmp_path / "o" / "r" / "step-000000005" / "shard-00000-of-00001.safetensors"
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
    assert result.exit_code == 2 and "step 7 is not committed" in result.output


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


@pytest.mark.s3
def test_demo_with_an_s3_object_store_over_http(tmp_path, s3_env):
    """`demo --object-url s3://bucket/prefix` against the moto server, AWS settings from the environment."""
    exe = os.path.join(os.path.dirname(sys.executable), "flowcheck")
    proc = subprocess.run([exe, "demo", "--workdir", str(tmp_path / "w"), "--steps", "20", "--local-every", "10",
                           "--object-seconds", "0.5", "--object-url", "s3://demo-bucket/ckpt"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "from the object tier" in proc.stdout and "bit for bit: True" in proc.stdout
    assert "s3://demo-bucket/ckpt" in (tmp_path / "w" / "flowcheck.yaml").read_text()
