"""Config dataclasses and YAML: defaults equal configs/hourly.yaml, bad input named precisely."""
from __future__ import annotations

import dataclasses
import os

import pytest
import yaml

from flowcheck import config
from flowcheck.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_hourly_yaml_equals_embedded_defaults():
    with open(os.path.join(ROOT, "configs", "hourly.yaml")) as f:
        raw = yaml.safe_load(f)
    defaults = dataclasses.asdict(config.Config())
    defaults.pop("node")
    assert raw == defaults


def test_hourly_policy_is_local_every_k_steps_and_object_hourly():
    p = config.load(os.path.join(ROOT, "configs", "hourly.yaml")).policy
    assert p.local.every_steps and p.local.keep_last == 3
    assert p.object.every_seconds == 3600 and (p.object.keep_hourly, p.object.keep_daily) == (24, 7)


def test_relative_paths_are_anchored_at_the_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("tiers:\n  local: {root: data}\n  object: {url: 'file://obj'}\n")
    cfg = config.load(str(path))
    assert cfg.tiers.local.root == str(tmp_path / "data")
    assert cfg.tiers.object.url == "file://" + str(tmp_path / "obj")


@pytest.mark.parametrize(
    "text, field",
    [
        ("tiers: {local: {codec: brotli}}", "tiers.local.codec"),
        ("tiers: {local: {chunk_mib: -1}}", "chunk_mib"),
        ("policy: {local: {keep_last: 0}}", "keep_last"),
        ("policy: {object: {every_seconds: soon}}", "policy.object.every_seconds"),
        ("tiers: {lokal: {}}", "tiers.lokal"),
        ("run: ../escape", "run"),
        ("tiers: {object: {url: not-a-url}}", "tiers.object.url"),
        ("tiers: {object: {part_mib: 1}}", "part_mib"),
        ("tiers: [1, 2]", "tiers"),
        # cluster: what was expected and what was found
        ("node: n9\ncluster: {nodes: [n0, n1]}", "node: expected one of cluster.nodes ['n0', 'n1'], found 'n9'"),
        ("node: n0\ncluster: {nodes: [n0, n0]}", "cluster.nodes: expected each node once, found ['n0']"),
        ("node: n0\ncluster: {nodes: [n0, ../x]}", "cluster.nodes[1]"),
        ("node: n0\ncluster: {nodes: n0}", "cluster.nodes"),
        ("node: n0\ncluster: {nodes: [n0, 3]}", "cluster.nodes"),
        ("node: n0\ncluster: {nodes: [n0], commit_wait_s: 0}", "cluster.commit_wait_s"),
        ("node: n0\ncluster: {nodes: [n0]}\ntiers: {object: {enabled: false}}", "tiers.object.enabled is false"),
        # the token's variable, never the token itself
        ("serve: {auth_token_env: 'my secret token'}", "serve.auth_token_env: expected the name of an environment variable"),
        ("serve: {auth_token_env: ''}", "serve.auth_token_env"),
    ],
)
def test_bad_config_names_file_and_field(tmp_path, text, field):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        config.load(str(path))
    assert field in str(e.value) and "bad.yaml" in str(e.value)


def test_invalid_yaml_and_missing_file_are_config_errors(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("tiers: {local: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml"):
        config.load(str(path))
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(str(tmp_path / "nope.yaml"))


def test_flowcheck_config_env_is_used(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("run: from-env\n")
    monkeypatch.setenv("FLOWCHECK_CONFIG", str(path))
    assert config.load().run == "from-env"


def test_cluster_node_yaml_loads_as_one_node_of_three():
    cfg = config.load(os.path.join(ROOT, "configs", "cluster-node.yaml"))
    assert cfg.node in cfg.cluster.nodes and len(cfg.cluster.nodes) == 3
    assert cfg.tiers.object.url.startswith("s3://")


@pytest.mark.parametrize("local, url, how", [
    ("store", "file://store", "are the same folder"),
    ("store", "file://./store/", "are the same folder"),
    ("store", "file://store/object", "are nested"),  # the object folder inside the local root
    ("store/local", "file://store", "are nested"),  # the local root inside the object folder
])
def test_tiers_sharing_one_folder_are_refused_naming_both_paths(tmp_path, monkeypatch, local, url, how):
    monkeypatch.chdir("/")  # relative paths are the config file's, wherever the command runs
    path = tmp_path / "shared.yaml"
    path.write_text(yaml.safe_dump({"tiers": {"local": {"root": local}, "object": {"url": url}}}))
    with pytest.raises(ConfigError, match=how) as e:
        config.load(str(path))
    message = str(e.value)
    assert "shared.yaml" in message and f"tiers.local.root ({tmp_path / local})" in message
    assert f"folder {os.path.normpath(tmp_path / url.split('://')[1])})" in message and "separate folders" in message


def test_the_same_folder_is_refused_on_construction_too_and_through_a_symlink(tmp_path):
    (tmp_path / "data").mkdir()
    os.symlink(tmp_path / "data", tmp_path / "alias")
    with pytest.raises(ConfigError, match="are the same folder"):
        config.Config(tiers=config.TiersConfig(local=config.LocalConfig(root=str(tmp_path / "alias")),
                                               object=config.ObjectConfig(url=f"file://{tmp_path}/data")))


def test_separate_folders_s3_and_a_disabled_object_tier_are_accepted(tmp_path):
    path = tmp_path / "ok.yaml"
    for tiers in ({"local": {"root": "local"}, "object": {"url": "file://object"}},
                  {"local": {"root": "local"}, "object": {"url": "file://local-copy"}},  # a shared prefix is no overlap
                  {"local": {"root": "store"}, "object": {"url": "s3://bucket/store"}},
                  {"local": {"root": "store"}, "object": {"url": "file://store", "enabled": False}}):
        path.write_text(yaml.safe_dump({"tiers": tiers}))
        config.load(str(path))


@pytest.mark.parametrize("staging, refused", [
    ("local/gpt/staging", "lies in"),  # in the run's folder of the local tier
    ("object/gpt", "lies in"),  # the object tier's run folder
    ("local/other-run", "lies in"),  # a folder the tier would take for a run
    ("local", "is that tier's root"),
    ("local/.staging", None),  # the default place
    ("staging", None),  # outside the tiers
])
def test_a_staging_folder_inside_a_tiers_run_folder_is_refused(tmp_path, monkeypatch, staging, refused):
    monkeypatch.chdir("/")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"run": "gpt", "tiers": {
        "local": {"root": "local"}, "object": {"url": "file://object", "staging_dir": staging}}}))
    if refused is None:
        assert config.load(str(path)).tiers.object.staging_dir == str(tmp_path / staging)  # anchored like the rest
        return
    with pytest.raises(ConfigError, match=refused) as e:
        config.load(str(path))
    assert f"tiers.object.staging_dir ({tmp_path / staging})" in str(e.value)


@pytest.mark.parametrize("field, value", [("header_timeout_s", 0), ("idle_timeout_s", -1), ("max_connections", 0)])
def test_connection_limits_must_be_positive(tmp_path, field, value):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"serve": {field: value}}))
    with pytest.raises(ConfigError, match=f"serve.{field}"):
        config.load(str(path))
