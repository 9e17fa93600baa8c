"""Secrets never leave the environment: S3 keys and the HMAC key are absent from logs (text and JSON),
manifests, stored files and error messages of a snapshot -> promote to S3 -> audit -> failure flow."""
from __future__ import annotations

import logging

import pytest
import yaml
from click.testing import CliRunner

from flowcheck.cli import main
from tests.helpers import make_snapshot

SECRETS = {
    "AWS_ACCESS_KEY_ID": "AKIAFAKEFLOWCHECK7Q2Z",
    "AWS_SECRET_ACCESS_KEY": "fake/Secret+Key/For/Flowcheck/Tests/0123456789",
    "FLOWCHECK_HMAC_KEY": "fake-hmac-signing-key-5f3c9a1e77b2",
}


@pytest.fixture
def secret_env(s3_bucket, monkeypatch):
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)  # moto accepts any credentials
    return s3_bucket


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_secrets_never_appear_in_logs_manifests_files_or_errors(tmp_path, secret_env, log_format):
    from flowcheck.config import load
    from flowcheck.store import Store

    cfg_path = tmp_path / "fc.yaml"
    cfg_path.write_text(yaml.safe_dump({"run": "r1", "signing": {"required": True}, "tiers": {
        "local": {"root": str(tmp_path / "local")}, "object": {"url": secret_env, "max_file_mib": 1}}}))
    store = Store(load(str(cfg_path)))
    store.push(make_snapshot(step=10))
    store.snapshot()
    runner = CliRunner()
    outputs = []
    for argv in (["promote", "--step", "10"], ["audit"], ["show", "--step", "10", "--json", "--verify"], ["ls", "--json"],
                 ["show", "--step", "99"],  # an induced error
                 ["restore", "--step", "10", "--from", "object", "--out", str(tmp_path / "restored")]):
        res = runner.invoke(main, ["--no-progress", "--log-format", log_format, "-vv", argv[0], "--config", str(cfg_path), *argv[1:]])
        outputs.append(res.output + (repr(res.exception) if res.exception and not isinstance(res.exception, SystemExit) else ""))
    assert "error:" in outputs[4]
    # an error that carries the key in its text (a bad endpoint URL with credentials) is masked in the log
    logging.getLogger("flowcheck.test").error("upload failed with key %s", SECRETS["AWS_SECRET_ACCESS_KEY"])
    stored = []
    for path in sorted(p for p in (tmp_path / "local").rglob("*") if p.is_file()):
        stored.append(path.read_bytes().decode("latin-1"))
    import fsspec

    fs, root = fsspec.core.url_to_fs(secret_env)
    for path in fs.find(root):
        stored.append(fs.cat_file(path).decode("latin-1"))
    assert any('"signature"' in s for s in stored), "the flow did not sign its manifests"
    texts = outputs + stored
    for name, value in SECRETS.items():
        leaks = [t[max(0, t.find(value) - 80): t.find(value) + 80] for t in texts if value in t]
        assert not leaks, f"{name} leaked: {leaks[:2]}"
    print(f"\nsecrets test: {len(SECRETS)} secrets, {len(outputs)} CLI outputs ({log_format}) + {len(stored)} stored files: 0 leaks")


def test_secrets_never_appear_in_a_nodes_metrics_or_status(tmp_path, secret_env):
    """A running node (in-process, the fake secrets in its environment) after a snapshot and a promotion to S3:
    /metrics, /status and /steps carry none of them."""
    import urllib.request

    from flowcheck.config import load
    from flowcheck.node.service import Node

    cfg_path = tmp_path / "node.yaml"
    cfg_path.write_text(yaml.safe_dump({"run": "r1", "signing": {"required": True}, "tiers": {
        "local": {"root": str(tmp_path / "local")}, "object": {"url": secret_env, "max_file_mib": 1}},
        "serve": {"push": "127.0.0.1:0", "http": "127.0.0.1:0"}}))
    node = Node(load(str(cfg_path))).start()
    try:
        node.store.push(make_snapshot(step=10))
        node.store.snapshot()
        node.store.promote(10)
        pages = {}
        for page in ("metrics", "status", "steps"):
            with urllib.request.urlopen("http://%s:%d/%s" % (*node.api.address, page), timeout=10) as r:
                pages[page] = r.read().decode()
    finally:
        node.stop()
    assert "flowcheck_" in pages["metrics"] and '"object"' in pages["steps"], pages
    for name, value in SECRETS.items():
        leaks = {page: text[max(0, text.find(value) - 80): text.find(value) + 80] for page, text in pages.items() if value in text}
        assert not leaks, f"{name} leaked: {leaks}"


def test_a_symlink_out_of_the_store_root_is_refused_on_read_and_flagged_by_audit_even_to_an_identical_copy(tmp_path):
    import shutil

    from flowcheck.audit import audit
    from flowcheck.config import Config, LocalConfig, TiersConfig
    from flowcheck.errors import IntegrityError
    from flowcheck.store import Store

    store = Store(Config(run="r1", tiers=TiersConfig(local=LocalConfig(root=str(tmp_path / "local")))))
    store.push(make_snapshot(step=10))
    m = store.snapshot()
    tensor = next(iter(m.tensors))
    chunk = next(f.path for f in m.files if f.path.startswith(m.tensors[tensor].shards[0].location[0].path + "/c"))
    inside = tmp_path / "local" / "r1" / chunk
    outside = tmp_path / "elsewhere" / "chunk"  # the same bytes, outside the root
    outside.parent.mkdir()
    shutil.copyfile(inside, outside)
    inside.unlink()
    inside.symlink_to(outside)

    with pytest.raises(IntegrityError, match="symlink out of the store root") as e:
        store.local.read(10, tensor)
    assert str(inside) in str(e.value) and str(outside) in str(e.value)
    report = audit(store)
    assert not report.ok
    assert any(p.severity == "error" and "symlink out of the store root" in p.what and p.path == str(inside)
               for p in report.problems), report.problems
    inside.unlink()
    shutil.copyfile(outside, inside)  # the file back in place: reads and audit are clean again
    assert store.local.read(10, tensor).shape == tuple(m.tensors[tensor].global_shape) and audit(store).ok
