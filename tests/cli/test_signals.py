"""Issue 16's signals as a user meets them through the CLI: every bad argument is one line and exit 2, verification
exits 1 on damage, a no-op says so, and what a file holds is kept or named."""
from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from flowcheck.cli import main
from flowcheck.restore.arch import ModelArch
from flowcheck.restore.megatron_map import model_params

from tests.capture.conftest import node_token  # noqa: F401 - an autouse fixture: the node runs with a token
from tests.node.test_api_access import bearer, call, node  # noqa: F401 - the node fixture


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def one_error_line(result) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


@pytest.fixture
def store(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: r\ntiers:\n  local: {{root: {tmp_path / 'l'}}}\n  object: {{url: 'file://{tmp_path / 'o'}'}}\n")
    torch.save({"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}, tmp_path / "state.pt")
    assert run("snapshot", "--state", str(tmp_path / "state.pt"), "--step", "5", "--config", str(cfg)).exit_code == 0
    return tmp_path, str(cfg)


@pytest.mark.parametrize("step", ["abc", "1e3", "-1", "5x"])
@pytest.mark.parametrize("command", ["show", "promote", "export", "restore", "diff"])
def test_a_malformed_step_is_one_line_and_exit_2(store, command, step):
    tmp, cfg = store
    extra = {"export": ["--out", str(tmp / "x.safetensors")], "restore": ["--out", str(tmp / "ckpt")],
             "diff": ["--against", str(tmp / "state.pt")]}.get(command, [])
    line = one_error_line(run(command, "--step", step, "--config", cfg, *extra))
    assert "expected a step number" in line and repr(step) in line


def test_latest_in_capitals_means_latest(store):
    _, cfg = store
    result = run("show", "--step", "LATEST", "--config", cfg)
    assert result.exit_code == 0 and "step 5" in result.output


def test_a_missing_option_is_one_line_naming_it(store):
    _, cfg = store
    assert "Missing option '--step'" in one_error_line(run("show", "--config", cfg))


def test_config_is_accepted_on_the_group_too(store):
    _, cfg = store
    result = run("--config", cfg, "audit")
    assert result.exit_code == 0 and "audit OK: 1 step copies" in result.output
    assert run("--config", cfg, "ls").output.count("committed") == 1


def test_the_commands_own_config_wins_over_the_groups(store, tmp_path):
    _, cfg = store
    other = tmp_path / "other.yaml"
    other.write_text(f"run: r\ntiers:\n  local: {{root: {tmp_path / 'elsewhere'}}}\n  object: {{url: 'file://{tmp_path / 'o2'}'}}\n")
    result = run("--config", str(other), "ls", "--config", cfg)
    assert result.exit_code == 0 and result.output.count("committed") == 1


@pytest.mark.parametrize("content,found", [(b"", "an empty file (0 bytes)"), (b"step: 5\nlr: 0.1\n", "a text file")])
def test_snapshot_of_a_text_or_empty_file_says_what_was_expected(store, content, found):
    tmp, cfg = store
    bad = tmp / "bad.pt"
    bad.write_bytes(content)
    line = one_error_line(run("snapshot", "--state", str(bad), "--step", "6", "--config", cfg))
    assert "expected a torch.save file" in line and found in line and "weights_only" not in line


def test_snapshot_keeps_json_scalars_and_names_what_it_drops(store, caplog):
    tmp, cfg = store
    torch.save({"model": {"w": torch.ones(3), "iteration": 7, "config": {"lr": 0.1}, "odd": {1, 2}}, "epoch": 2},
               tmp / "s.pt")
    result = run("snapshot", "--state", str(tmp / "s.pt"), "--step", "6", "--config", cfg)
    assert result.exit_code == 0, result.output
    assert any("not stored" in r.getMessage() and "odd (set)" in r.getMessage() for r in caplog.records)
    extra = json.loads(run("show", "--step", "6", "--json", "--config", cfg).output)["scalars"]["extra"]
    assert extra == {"iteration": 7, "config": {"lr": 0.1}, "epoch": 2}


def _safetensors_with_arch(path) -> None:
    arch = ModelArch.from_mapping({"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                   "ffn_hidden_size": 64, "vocab_size": 100, "max_position_embeddings": 16})
    gen = torch.Generator().manual_seed(0)
    save_file({p.name: torch.randn(*p.shape, generator=gen) for p in model_params(arch)}, str(path),
              metadata={k: json.dumps(v) for k, v in arch.to_json().items()})


def test_snapshot_keeps_the_model_description_of_a_safetensors_file_and_is_labelled_snapshot(store):
    tmp, cfg = store
    _safetensors_with_arch(tmp / "m.safetensors")
    assert run("snapshot", "--state", str(tmp / "m.safetensors"), "--step", "6", "--config", cfg).exit_code == 0
    m = json.loads(run("show", "--step", "6", "--json", "--config", cfg).output)
    assert m["producer"]["source"] == "snapshot" and m["scalars"]["extra"]["model"]["num_layers"] == 2
    listing = json.loads(run("ls", "--json", "--config", cfg).output)
    assert {r["step"]: r["source"] for r in listing} == {5: "snapshot", 6: "snapshot"}
    restored = run("restore", "--step", "6", "--tp", "2", "--format", "megatron", "--out", str(tmp / "ckpt"),
                   "--config", cfg)
    assert restored.exit_code == 0, restored.output


def test_the_same_content_again_is_a_no_op_that_says_so(store):
    tmp, cfg = store
    _safetensors_with_arch(tmp / "m.safetensors")
    first = run("import", "--step", "20", str(tmp / "m.safetensors"), "--config", cfg)
    assert first.exit_code == 0 and first.output.startswith("committed step 20"), first.output
    again = run("import", "--step", "20", str(tmp / "m.safetensors"), "--config", cfg)
    assert again.exit_code == 0 and "of run r is already committed in the local tier with this content: nothing written" in again.output
    snap = run("snapshot", "--state", str(tmp / "state.pt"), "--step", "5", "--config", cfg)
    assert snap.exit_code == 0 and "step 5 of run r is already committed" in snap.output


def test_export_takes_the_format_from_the_extension_and_refuses_a_mismatch(store):
    tmp, cfg = store
    assert run("export", "--step", "5", "--out", str(tmp / "x.pt"), "--config", cfg).exit_code == 0
    assert torch.equal(torch.load(tmp / "x.pt", weights_only=True)["w"], torch.arange(4096.0).reshape(64, 64))
    line = one_error_line(run("export", "--step", "5", "--format", "torch", "--out", str(tmp / "y.safetensors"),
                              "--config", cfg))
    assert "names a safetensors file" in line and not (tmp / "y.safetensors").exists()


def _flip_local_shard_byte(tmp) -> None:
    chunks = [os.path.join(d, f) for d, _, fs in os.walk(tmp / "l" / "r" / "step-000000005") for f in fs
              if "/c/" in os.path.join(d, f) or f.startswith("c")]
    data = max(chunks, key=os.path.getsize)
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


def test_show_verify_and_lineage_verify_exit_1_on_damage(store):
    tmp, cfg = store
    assert run("show", "--step", "5", "--verify", "--config", cfg).exit_code == 0
    assert run("lineage", "--verify", "--config", cfg).exit_code == 0
    _flip_local_shard_byte(tmp)
    shown = run("show", "--step", "5", "--verify", "--config", cfg)
    assert shown.exit_code == 1 and "status     FAILED" in shown.output
    drawn = run("lineage", "--verify", "--config", cfg)
    assert drawn.exit_code == 1 and "DAMAGED" in drawn.output


def test_gc_dry_run_with_nothing_to_delete_says_so(store):
    _, cfg = store
    result = run("gc", "--dry-run", "--config", cfg)
    assert result.exit_code == 0 and "local: nothing to delete; keeps [5]" in result.output
    assert "none" not in result.output


def test_post_snapshot_on_an_empty_node_answers_409_and_logs_one_line(node):  # noqa: F811 - the fixture
    status, body = call(node, "POST", "/snapshot", bearer(os.environ["FLOWCHECK_NODE_TOKEN"]))
    assert status == 409 and "holds no state yet" in body["error"]
    log = node.tail()
    assert "snapshot refused" in log and "Traceback" not in log


def test_ci_fails_when_pytest_collects_nothing():
    script = open(os.path.join(os.path.dirname(__file__), "..", "..", ".ci", "run")).read()
    assert "-eq 5" not in script and "rc=0" not in script  # exit 5 is not turned into success any more


def _s3_config(tmp_path, url: str) -> str:
    cfg = tmp_path / "s3.yaml"
    cfg.write_text(f"run: r\ntiers:\n  local: {{root: {tmp_path / 'l3'}}}\n  object: {{url: '{url}'}}\n")
    return str(cfg)


@pytest.mark.parametrize("command", ["ls", "audit"])
def test_a_missing_bucket_is_an_error_naming_it_not_an_empty_store(object_server, tmp_path, command):
    cfg = _s3_config(tmp_path, "s3://nosuchbucket-flowcheck/ckpt")
    line = one_error_line(run(command, "--config", cfg))
    assert "nosuchbucket-flowcheck" in line and "tiers.object.url" in line


@pytest.mark.parametrize("command", ["ls", "audit"])
def test_an_existing_empty_bucket_says_so(object_bucket, tmp_path, command):
    cfg = _s3_config(tmp_path, f"{object_bucket}/ckpt")
    result = run(command, "--config", cfg)
    assert result.exit_code == 0, result.output
    assert f"object tier {object_bucket}/ckpt exists and holds no steps of run r" in result.output


def test_delete_leaves_a_pruned_record_and_refuses_the_head_without_force(store):
    tmp, cfg = store
    torch.save({"w": torch.zeros(8)}, tmp / "s6.pt")
    assert run("snapshot", "--state", str(tmp / "s6.pt"), "--step", "6", "--config", cfg).exit_code == 0
    line = one_error_line(run("delete", "--step", "6", "--config", cfg))
    assert "--force" in line
    deleted = run("delete", "--step", "5", "--config", cfg)
    assert deleted.exit_code == 0 and deleted.output.startswith("deleted step 5 of run r from the local tier"), deleted.output
    assert run("audit", "--config", cfg).exit_code == 0  # a deliberate gap, not a lost step
    shown = one_error_line(run("show", "--step", "5", "--config", cfg))
    assert "was deleted on request at 20" in shown  # and when (an ISO date)
    forced = run("delete", "--step", "6", "--force", "--config", cfg)
    assert forced.exit_code == 0 and "it was the current branch's head" in forced.output


def test_show_of_a_step_gc_removed_says_pruned_by_gc_and_when(store):
    tmp, cfg = store
    with open(cfg, "a") as f:
        f.write("policy:\n  local: {keep_last: 1, keep_hourly: 0, keep_daily: 0}\n")
    torch.save({"w": torch.zeros(8)}, tmp / "s6.pt")
    assert run("snapshot", "--state", str(tmp / "s6.pt"), "--step", "6", "--config", cfg).exit_code == 0
    gc = run("gc", "--config", cfg)
    assert gc.exit_code == 0 and "local: deleted steps [5]" in gc.output, gc.output
    assert "was pruned by GC at 20" in one_error_line(run("show", "--step", "5", "--config", cfg))
    missing = one_error_line(run("show", "--step", "4", "--config", cfg))
    assert "pruned" not in missing


def test_restore_force_replaces_only_a_checkpoint_directory(store):
    tmp, cfg = store
    _safetensors_with_arch(tmp / "m.safetensors")
    assert run("import", "--step", "20", str(tmp / "m.safetensors"), "--config", cfg).exit_code == 0
    precious = tmp / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    args = ["restore", "--step", "20", "--tp", "2", "--config", cfg, "--force", "--out"]
    line = one_error_line(run(*args, str(precious)))
    assert "expected a directory holding a Megatron checkpoint" in line and "thesis.tex" in line
    assert (precious / "thesis.tex").read_text() == "years of work"
    assert run(*args, str(tmp / "ckpt")).exit_code == 0  # a new directory
    again = run(*args, str(tmp / "ckpt"))  # a previous restore is replaced
    assert again.exit_code == 0, again.output
    (tmp / "empty").mkdir()
    assert run(*args, str(tmp / "empty")).exit_code == 0


def test_a_weights_only_restore_says_so_and_prints_the_megatron_flags(store):
    tmp, cfg = store
    _safetensors_with_arch(tmp / "m.safetensors")
    assert run("import", "--step", "20", str(tmp / "m.safetensors"), "--config", cfg).exit_code == 0
    result = run("restore", "--step", "20", "--tp", "2", "--format", "megatron", "--out", str(tmp / "c"), "--config", cfg)
    assert result.exit_code == 0, result.output
    assert "resumes: model weights only (no optimizer state)" in result.output
    assert "--no-load-optim" in result.output and "--no-load-rng" in result.output


def test_restore_help_describes_run_from_and_no_optim():
    text = " ".join(run("restore", "--help").output.split())
    assert "--run TEXT The run to read (default: the config's run" in text
    assert "--from [auto|memory|local|object] The tier to read. auto (default): the fastest tier holding the step" in text
    assert "--no-optim Write model weights only" in text and "--no-load-optim" in text


def test_export_of_a_step_damaged_locally_reads_the_object_copy_unless_from_local(store):
    tmp, cfg = store
    assert run("promote", "--step", "5", "--config", cfg).exit_code == 0
    _flip_local_shard_byte(tmp)
    auto = run("export", "--step", "5", "--out", str(tmp / "a.pt"), "--config", cfg)
    assert auto.exit_code == 0, auto.output
    assert "WARNING" in auto.output and "local tier" in auto.output and "object tier" in auto.output
    assert torch.equal(torch.load(tmp / "a.pt", weights_only=True)["w"], torch.arange(4096.0).reshape(64, 64))
    only_local = run("export", "--step", "5", "--from", "local", "--out", str(tmp / "b.pt"), "--config", cfg)
    assert only_local.exit_code == 2 and not (tmp / "b.pt").exists()


def test_missing_credentials_are_one_line_with_the_aws_hint_on_the_first_try(tmp_path, s3_env, monkeypatch):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    cfg = tmp_path / "s3.yaml"
    cfg.write_text(f"run: r\ntiers:\n  local: {{root: {tmp_path / 'l'}}}\n  object:\n    url: s3://some-bucket/p\n"
                   "    retries: 4\n    storage_options: {skip_instance_cache: true}\n")
    line = one_error_line(run("ls", "--config", str(cfg)))
    assert "AWS_ACCESS_KEY_ID" in line and "retry" not in line.lower()


def test_a_failed_snapshot_to_the_object_tier_leaves_no_staging_folder(store):
    tmp, cfg = store
    (tmp / "o" / "r").mkdir(parents=True)
    (tmp / "o" / "r" / "step-000000006").write_text("a file where the step folder should be")
    torch.save({"w": torch.zeros(8)}, tmp / "s6.pt")
    line = one_error_line(run("snapshot", "--state", str(tmp / "s6.pt"), "--step", "6", "--tier", "object", "--config", cfg))
    assert "step 6" in line or "step-000000006" in line
    assert not (tmp / "l" / ".staging").exists()
