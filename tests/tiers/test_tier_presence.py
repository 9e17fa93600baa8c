"""A configured tier that does not exist is an error, an empty one says so, and what no retry can fix fails at once.

S3 runs against moto servers on 127.0.0.1: the shared one (a missing bucket, no credentials) and one of this
module's own that checks signatures (an access key it does not know is refused with 403 InvalidAccessKeyId).
"""
from __future__ import annotations

import logging
import os
import subprocess
import time
import uuid

import pytest

from flowcheck.audit import audit
from flowcheck.config import Config, LocalConfig, ObjectConfig, TiersConfig
from flowcheck.errors import TierAccessError, TierMissingError
from flowcheck.store import Store
from flowcheck.tiers.object import ObjectTier
from flowcheck.tiers.retry import AWS_CREDENTIALS_HINT
from tests.conftest import _answers_http, _free_port, _moto_server_command
from tests.helpers import make_snapshot


def make_store(tmp_path, url: str, **object_kw) -> Store:
    obj = ObjectConfig(url=url, max_file_mib=1, **object_kw)
    return Store(Config(run="r1", tiers=TiersConfig(local=LocalConfig(root=str(tmp_path / "local")), object=obj)))


def counting(monkeypatch, fs, *methods: str) -> list[str]:
    """Count the calls of filesystem methods (each attempt of a listing is one call)."""
    calls: list[str] = []

    def wrap(method: str):
        real = getattr(fs, method)

        def wrapper(*args, **kwargs):
            calls.append(method)
            return real(*args, **kwargs)

        return wrapper

    for method in methods:
        monkeypatch.setattr(fs, method, wrap(method))
    return calls


def retries_logged(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == "object_retry"]


# ---- local and file:// tiers: "not created yet" versus missing ------------------------------------
def test_a_new_store_is_not_created_yet_and_empty_not_an_error(tmp_path):
    store = make_store(tmp_path, f"file://{tmp_path / 'object'}")
    states = {s.tier: s for s in store.check_tiers()}
    assert not states["local"].created and states["local"].empty and states["local"].field == "tiers.local.root"
    assert not states["object"].created and states["object"].empty
    assert "not created yet" in states["object"].describe()


def test_an_existing_tier_without_steps_of_the_run_says_it_exists_and_is_empty(tmp_path):
    (tmp_path / "object").mkdir()
    store = make_store(tmp_path, f"file://{tmp_path / 'object'}")
    store.local.write(make_snapshot(step=1))
    states = {s.tier: s for s in store.check_tiers()}
    assert states["local"].created and states["local"].states == 1 and not states["local"].empty
    assert states["object"].created and states["object"].empty
    assert states["object"].describe() == f"object tier file://{tmp_path / 'object'} exists and holds no steps of run r1"


def test_a_file_url_whose_parent_folder_is_missing_too_is_an_error_naming_it(tmp_path):
    url = f"file://{tmp_path / 'no-such-mount' / 'object'}"
    store = make_store(tmp_path, url)
    with pytest.raises(TierMissingError, match=r"no-such-mount.*tiers\.object\.url.*found neither") as err:
        store.check_tiers()
    assert "mkdir -p" in str(err.value)


def test_a_file_where_a_tier_folder_should_be_is_an_error(tmp_path):
    (tmp_path / "local").write_text("not a folder")
    store = make_store(tmp_path, f"file://{tmp_path / 'object'}")
    with pytest.raises(TierMissingError, match=r"tiers\.local\.root\), found a file"):
        store.check_tiers()


# ---- S3: a missing bucket is an error at once, an empty prefix an empty store ---------------------
@pytest.mark.s3
def test_a_missing_bucket_is_an_error_naming_it_not_an_empty_store(tmp_path, object_server, monkeypatch, caplog):
    bucket = f"nosuchbucket-{uuid.uuid4().hex[:8]}"
    store = make_store(tmp_path, f"s3://{bucket}/prefix", retries=4)
    calls = counting(monkeypatch, store.object.fs, "glob", "ls")
    with pytest.raises(TierMissingError) as err:
        store.history()  # what `flowcheck ls` lists first
    assert bucket in str(err.value) and "tiers.object.url" in str(err.value) and f"aws s3 mb s3://{bucket}" in str(err.value)
    assert len(calls) == 1 and not retries_logged(caplog)
    with pytest.raises(TierMissingError, match=bucket):
        store.check_tiers()
    with pytest.raises(TierMissingError, match=bucket):
        audit(store)  # no more "audit OK: 0 step copies"


@pytest.mark.s3
def test_an_existing_bucket_without_steps_is_an_empty_store(tmp_path, object_bucket):
    store = make_store(tmp_path, object_bucket)
    obj = {s.tier: s for s in store.check_tiers()}["object"]
    assert obj.created and obj.empty
    assert obj.describe() == f"object tier {object_bucket} exists and holds no steps of run r1"


@pytest.mark.s3
def test_promoting_to_a_missing_bucket_fails_at_once_and_writes_nothing(tmp_path, object_server, caplog):
    store = make_store(tmp_path, f"s3://nosuchbucket-{uuid.uuid4().hex[:8]}/p", retries=4)
    store.local.write(make_snapshot(step=1))
    with pytest.raises(TierMissingError, match="was not promoted"):
        store.promote(1)
    assert not retries_logged(caplog) and store.local.steps() == [1]


# ---- S3: no credentials, a refused key: one attempt, the AWS hint ---------------------------------
@pytest.fixture
def no_credentials(s3_env, monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup either


@pytest.mark.s3
def test_missing_credentials_fail_on_the_first_try_with_the_aws_hint(tmp_path, no_credentials, monkeypatch, caplog):
    # a filesystem of its own: fsspec's instance cache would hand back one opened with credentials
    store = make_store(tmp_path, "s3://some-bucket/p", retries=4, storage_options={"skip_instance_cache": True})
    calls = counting(monkeypatch, store.object.fs, "glob")
    t0 = time.monotonic()
    with pytest.raises(TierAccessError) as err:
        store.object.steps()
    assert len(calls) == 1 and not retries_logged(caplog) and time.monotonic() - t0 < 10
    assert AWS_CREDENTIALS_HINT in str(err.value) and "found no credentials" in str(err.value)
    assert isinstance(err.value, PermissionError)


@pytest.mark.s3
def test_missing_credentials_fail_a_promotion_at_once(tmp_path, no_credentials, caplog):
    store = make_store(tmp_path, "s3://some-bucket/p", retries=4, storage_options={"skip_instance_cache": True})
    store.local.write(make_snapshot(step=1))
    with pytest.raises(TierAccessError, match="AWS_ACCESS_KEY_ID"):
        store.promote(1)
    assert not retries_logged(caplog)


@pytest.fixture(scope="module")
def moto_checking_keys(tmp_path_factory):
    """A moto server of this module that verifies request signatures (INITIAL_NO_AUTH_ACTION_COUNT=0)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("moto-auth") / "moto.log", "wb")
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    proc = subprocess.Popen([_moto_server_command(), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log, env=env)
    try:
        deadline = time.monotonic() + 30
        while not _answers_http(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"moto_server did not start on {url}; see {log.name}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


@pytest.mark.s3
def test_an_access_key_the_store_refuses_fails_on_the_first_try(tmp_path, s3_env, moto_checking_keys, monkeypatch,
                                                              caplog):
    store = make_store(tmp_path, "s3://some-bucket/p", retries=4, endpoint_url=moto_checking_keys)
    calls = counting(monkeypatch, store.object.fs, "glob")
    with pytest.raises(TierAccessError) as err:
        store.object.steps()
    assert len(calls) == 1 and not retries_logged(caplog)
    assert "InvalidAccessKeyId" in str(err.value) or "does not exist in our records" in str(err.value)
    assert AWS_CREDENTIALS_HINT in str(err.value)
    with pytest.raises(TierAccessError):
        store.check_tiers()  # the bucket check says the same


def test_an_object_tier_opened_by_itself_reports_a_missing_parent_folder(tmp_path):
    tier = ObjectTier(ObjectConfig(url=f"file://{tmp_path / 'a' / 'b'}"), "r1", staging_dir=str(tmp_path / "s"))
    with pytest.raises(TierMissingError):
        tier.exists()
    (tmp_path / "a").mkdir()
    assert tier.exists() is False
    (tmp_path / "a" / "b").mkdir()
    assert tier.exists() is True
