"""Promotion to S3 streams each file's parts from the step's arrays: no staging file, bounded parts in flight,
the same bytes a staged write would upload, a failed part sent again whole (tiers/s3_upload.py)."""
from __future__ import annotations

import os
import threading

import boto3
import numpy as np
import pytest

from flowcheck.config import Config, LocalConfig, ObjectConfig, TiersConfig
from flowcheck.digest import data_digest
from flowcheck.state import Shard, TensorSpec
from flowcheck.store import Store
from flowcheck.tiers import safetensors_io as st
from flowcheck.tiers.s3_upload import PartBody, PartStreams, part_size
from tests.helpers import make_custom_snapshot

MIB = 1 << 20
SPECS = [TensorSpec("w", "float32", (3 * 1024, 1024)), TensorSpec("b", "float32", (5,)),
         TensorSpec("e", "float16", (1000, 2048))]  # 12 MiB + 20 B + ~3.9 MiB: parts cut inside tensors


def snapshot(step: int = 7):
    rng = np.random.default_rng(step)
    arrays = {Shard(s.name, (0,) * len(s.shape), s.shape): rng.standard_normal(s.shape).astype(s.dtype)
              for s in SPECS}
    return make_custom_snapshot(SPECS, arrays, step=step), arrays


def store(tmp_path, url: str, **obj) -> Store:
    cfg = ObjectConfig(url=url, **{"part_mib": 5, "upload_workers": 2, **obj})
    return Store(Config(run="r1", tiers=TiersConfig(local=LocalConfig(root=str(tmp_path / "local")), object=cfg)))


def _objects(url: str) -> dict[str, bytes]:
    bucket, _, prefix = url[len("s3://"):].partition("/")
    s3 = boto3.client("s3")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]
    return {k: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys if k.endswith(".safetensors")}


def test_part_body_reads_views_across_buffers_and_seeks_back():
    a, b, c = np.arange(10, dtype=np.uint8), np.arange(10, 13, dtype=np.uint8), np.arange(20, 30, dtype=np.uint8)
    whole = np.concatenate([a, b, c]).tobytes()
    body = PartBody([memoryview(a), memoryview(b)[0:3], memoryview(c)])
    assert len(body) == 23 and body.tell() == 0
    assert bytes(body.read(4)) == whole[:4]
    assert bytes(body.read(9)) == whole[4:13]  # across the first two buffers: joined
    assert bytes(body.read()) == whole[13:] and body.read(5) == b""
    assert body.seek(0) == 0 and bytes(body.read(-1)) == whole
    assert body.seek(-3, os.SEEK_END) == 20 and bytes(body.read(10)) == whole[20:]
    body.seek(5)
    chunks = iter(lambda: body.read(7), b"")  # how botocore hashes a body, then seeks back
    assert b"".join(bytes(c) for c in chunks) == whole[5:]


def test_part_sizes_keep_every_worker_busy_within_s3_limits():
    assert part_size(1 * MIB, 8, 64) == 5 * MIB  # S3's smallest part
    assert part_size(800 * MIB, 8, 64) == 64 * MIB
    assert part_size(200 * MIB, 8, 64) == 25 * MIB
    assert part_size(10_000 * 64 * MIB, 8, 5) == 64 * MIB  # no more than 10,000 parts


def test_a_streamed_promotion_stages_nothing_and_uploads_what_a_staged_write_would(tmp_path, object_bucket,
                                                                                     monkeypatch):
    snap, arrays = snapshot()
    s = store(tmp_path, object_bucket)
    staging_seen = []
    original = st.write

    def no_staging(*args, **kw):  # the staged path would write files here
        staging_seen.append(args[0])
        return original(*args, **kw)

    monkeypatch.setattr(st, "write", no_staging)
    m = s.write(snap, "object")
    assert staging_seen == [] and not os.path.exists(tmp_path / "local" / ".staging")
    stored = _objects(object_bucket)
    assert len(stored) == len(m.files) == 1  # one file: a streamed write is not cut for pipelining
    (key, body), = stored.items()
    entry = m.files[0]
    assert len(body) == entry.bytes and data_digest(np.frombuffer(body, np.uint8)) == entry.digest
    # byte for byte what the staged path writes for the same plan
    local = tmp_path / "staged.safetensors"
    planned = s.object._plan(snap, list(snap.data), staged=False)
    entries = [s.object._entry(snap, p) for p in planned[0]]
    meta = {"run": "r1", "step": "7", "manifest_id": st.parse_header(lambda a, b: body[a:b], len(body), key)
            .metadata["manifest_id"], "format": "flowcheck-v1"}
    original(str(local), entries, meta)
    assert local.read_bytes() == body
    back = store(tmp_path / "reader", object_bucket).object.load(7)
    for shard, want in arrays.items():
        assert np.array_equal(back.array(shard), want)


def test_parts_in_flight_stay_bounded_and_each_body_is_a_view_not_a_copy(object_bucket):
    client = boto3.client("s3")
    bucket = object_bucket[len("s3://"):].split("/")[0]
    live, most, lock = [0], [0], threading.Lock()
    upload_part = client.upload_part

    def counting(**kw):
        with lock:
            live[0] += 1
            most[0] = max(most[0], live[0])
        try:
            assert isinstance(kw["Body"], PartBody)
            return upload_part(**kw)
        finally:
            with lock:
                live[0] -= 1

    client.upload_part = counting
    data = np.random.default_rng(1).integers(0, 255, 37 * MIB, dtype=np.uint8)
    streams = PartStreams(client, workers=2, part_mib=5)
    sent = []
    try:
        chunks = [data[i:i + 3 * MIB] for i in range(0, data.size, 3 * MIB)]  # parts span several chunks
        streams.send(f"{bucket}/big.bin", data.size, iter(chunks), sent.append).result()
        streams.send(f"{bucket}/small.bin", 100, iter([b"x" * 100]), sent.append).result()  # one put_object
    finally:
        streams.close(failed=False)
    assert most[0] <= 2 and sum(sent) == data.size + 100
    got = client.get_object(Bucket=bucket, Key="big.bin")["Body"].read()
    assert got == data.tobytes()
    assert client.get_object(Bucket=bucket, Key="small.bin")["Body"].read() == b"x" * 100
    with pytest.raises(ValueError, match="expected 10 bytes"):
        PartStreams(client, 2, 5).send(f"{bucket}/short.bin", 10, iter([b"123"]), sent.append)


def test_a_part_that_fails_is_sent_again_whole_and_nothing_half_written_is_visible(tmp_path, object_bucket):
    snap, arrays = snapshot(9)
    s = store(tmp_path, object_bucket, request_attempts=1)
    client = s.object.boto3_client()
    calls = []
    upload_part = client.upload_part

    def flaky(**kw):
        calls.append(kw["PartNumber"])
        if len(calls) == 2:  # the second part of the first attempt
            raise ConnectionResetError("injected reset mid-part")
        return upload_part(**kw)

    client.upload_part = flaky
    m = s.write(snap, "object")
    assert len(calls) > 4 and calls.count(1) == 2  # the file was sent again from its first part
    bucket, _, prefix = object_bucket[len("s3://"):].partition("/")
    assert client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) == []  # aborted
    back = store(tmp_path / "reader", object_bucket).object.load(m.step)
    for shard, want in arrays.items():
        assert np.array_equal(back.array(shard), want)


def test_part_body_goes_through_the_aws_chunked_encoding_botocore_uses_over_https():
    """Over TLS botocore sends a streaming body aws-chunked with a trailing checksum; it reads the body in chunks
    (views, here) and formats each into the stream."""
    import base64
    import zlib

    from botocore.httpchecksum import AwsChunkedWrapper, Crc32Checksum

    data = np.random.default_rng(2).integers(0, 255, 100_000, dtype=np.uint8)
    body = PartBody([memoryview(data)[:70_000], memoryview(data)[70_000:]])
    wire = AwsChunkedWrapper(body, checksum_cls=Crc32Checksum, checksum_name="x-amz-checksum-crc32",
                             chunk_size=65_536).read()
    crc = base64.b64encode(zlib.crc32(data.tobytes()).to_bytes(4, "big"))
    assert wire == (b"10000\r\n" + data[:65_536].tobytes() + b"\r\n" + b"%x\r\n" % (100_000 - 65_536)
                    + data[65_536:].tobytes() + b"\r\n0\r\nx-amz-checksum-crc32:" + crc + b"\r\n\r\n")


def test_a_write_given_up_with_parts_still_queued_leaves_no_multipart_upload_open(object_bucket):
    """Closing a failed write cancels the parts that have not started; the file they belonged to never completes,
    so closing aborts its multipart upload (nothing for GC to find)."""
    import time

    client = boto3.client("s3")
    bucket = object_bucket[len("s3://"):].split("/")[0]
    upload_part = client.upload_part

    def slow(**kw):
        time.sleep(0.5)
        return upload_part(**kw)

    client.upload_part = slow
    streams = PartStreams(client, workers=1, part_mib=5)
    data = np.zeros(10 * MIB, np.uint8)  # two parts: one in flight, one queued behind it
    done = streams.send(f"{bucket}/given-up.bin", data.size, iter([data]), lambda n: None)
    streams.close(failed=True)
    assert not done.done() or done.exception() is not None
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="given-up.bin")
