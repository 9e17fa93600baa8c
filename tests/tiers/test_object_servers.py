"""Where S3 servers differ, on each of them (moto's mock of AWS, a real SeaweedFS cluster): each test names the
difference and shows the object tier behaves the same on both.

- A conditional create (``If-None-Match: *``) of an existing key: AWS answers 412 PreconditionFailed naming the
  condition, which s3fs turns into FileExistsError; SeaweedFS answers 412 without naming it (s3fs: EINVAL).
- Deleting the last object under a prefix: S3 has no folders, so the prefix is gone; SeaweedFS's filer keeps the
  empty folder and lists it as a prefix until ``<folder>/`` itself is deleted.
"""
from __future__ import annotations

import os

import boto3
import pytest
from click.testing import CliRunner

from flowcheck.cli import main
from flowcheck.config import ObjectConfig
from flowcheck.store import open_store
from flowcheck.tiers.object import ObjectTier, attempt_dir
from tests.helpers import make_snapshot

pytestmark = pytest.mark.s3


def _config(tmp_path, url: str) -> str:
    cfg = tmp_path / "flowcheck.yaml"
    cfg.write_text(f"run: r1\ntiers:\n  local: {{root: '{tmp_path / 'local'}'}}\n  object: {{url: '{url}'}}\n"
                   "policy:\n  object: {keep_last: 1}\n")
    return str(cfg)


def _prefixes(endpoint: str, url: str, under: str = "r1/") -> list[str]:
    """The step prefixes a delimited listing of the run shows, as the tier lists its steps."""
    bucket, prefix = url[len("s3://"):].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    resp = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{under}step-", Delimiter="/")
    return [p["Prefix"][len(prefix) + 1 + len(under):].rstrip("/") for p in resp.get("CommonPrefixes", [])]


def _ls_and_audit(cfg: str) -> tuple[str, str]:
    ls = CliRunner().invoke(main, ["--config", cfg, "ls"])
    checked = CliRunner().invoke(main, ["--config", cfg, "audit"])
    assert ls.exit_code == 0 and checked.exit_code == 0, ls.output + checked.output
    return ls.output, checked.output


def test_a_conditional_create_of_an_existing_key_is_file_exists_on_every_server(object_bucket, tmp_path, request):
    tier = ObjectTier(ObjectConfig(url=object_bucket), "r1", staging_dir=str(tmp_path / "s"))
    tier.create_exclusive("step-000000001/manifest.json", b"first")
    raw = None
    try:  # what s3fs itself makes of the server's refusal
        tier.fs.pipe_file(tier._p("step-000000001/manifest.json"), b"second", mode="create")
    except OSError as e:
        raw = e
    assert raw is not None  # refused on both: the condition holds
    seaweedfs = request.node.callspec.params["object_server"] == "seaweedfs"
    assert isinstance(raw, FileExistsError) != seaweedfs, f"{type(raw).__name__}: {raw}"  # the difference
    with pytest.raises(FileExistsError):
        tier.create_exclusive("step-000000001/manifest.json", b"second")
    assert tier.read_bytes("step-000000001/manifest.json", "reading") == b"first"


def test_after_gc_deletes_a_step_ls_and_audit_are_clean_and_its_prefix_is_gone(object_bucket, object_server,
                                                                               tmp_path):
    cfg = _config(tmp_path, object_bucket)
    store = open_store(cfg)
    for step in (1, 2):
        store.local.write(make_snapshot(step=step))
        store.promote(step)
    assert _prefixes(object_server, object_bucket) == ["step-000000001", "step-000000002"]
    assert store.gc(tiers=["object"]).deleted["object"] and store.object.steps() == [2]
    # the step's folders went with its objects: SeaweedFS lists nothing of step 1 either
    assert _prefixes(object_server, object_bucket) == ["step-000000002"]
    listing, checked = _ls_and_audit(cfg)
    assert "incomplete" not in listing and "0 errors, 0 warnings" in checked, listing + checked
    assert store.gc(tiers=["object"]).cleaned["object"] == []


def test_an_empty_step_folder_is_no_incomplete_write_and_gc_removes_it_silently(object_bucket, object_server,
                                                                                tmp_path, request):
    """A folder emptied by hand (or by a GC that removed objects only): SeaweedFS lists it, S3 does not."""
    cfg = _config(tmp_path, object_bucket)
    store = open_store(cfg)
    store.local.write(make_snapshot(step=1))
    store.promote(1)
    bucket, prefix = object_bucket[len("s3://"):].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=object_server, region_name="us-east-1")
    key = f"{prefix}/r1/{attempt_dir('step-000000009')}/shard-00000-of-00001.safetensors"
    s3.put_object(Bucket=bucket, Key=key, Body=b"x")
    s3.delete_object(Bucket=bucket, Key=key)
    seaweedfs = request.node.callspec.params["object_server"] == "seaweedfs"
    assert ("step-000000009" in _prefixes(object_server, object_bucket)) == seaweedfs  # the difference
    assert store.object.incomplete() == []
    listing, checked = _ls_and_audit(cfg)
    assert "incomplete" not in listing and "0 errors, 0 warnings" in checked, listing + checked
    assert store.gc(tiers=["object"]).cleaned["object"] == []  # nothing worth reporting
    assert _prefixes(object_server, object_bucket) == ["step-000000001"]  # yet the empty folders went
    assert store.object.steps() == [1] and store.object.verify(1) == []


def test_a_step_with_parts_and_no_manifest_is_still_an_incomplete_write(object_bucket, object_server, tmp_path):
    cfg = _config(tmp_path, object_bucket)
    store = open_store(cfg)
    bucket, prefix = object_bucket[len("s3://"):].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=object_server, region_name="us-east-1")
    s3.put_object(Bucket=bucket, Body=b"a part",
                  Key=f"{prefix}/r1/{attempt_dir('step-000000007')}/shard-00000-of-00001.safetensors")
    assert store.object.incomplete() == ["step-000000007"]
    listing, checked = _ls_and_audit(cfg)
    assert "incomplete (step-000000007)" in listing, listing
    assert "incomplete write (not visible; GC removes it)" in checked and "0 errors, 1 warnings" in checked, checked
    cleaned = store.object.clean_incomplete(older_than_s=-1)  # GC past the grace period
    assert [os.path.basename(c) for c in cleaned] == ["step-000000007"], cleaned
    assert store.object.incomplete() == [] and _prefixes(object_server, object_bucket) == []
