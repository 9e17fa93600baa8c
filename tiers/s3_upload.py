"""Uploads to S3 through boto3: a staged file through the transfer manager, or a file streamed from memory.

s3fs's ``put_file(max_concurrency=N)`` sends parts in lock-step batches of N
and spends its client CPU in one asyncio thread; on the promotion benchmark it
reached 0.74x of boto3's TransferManager, and a continuous asyncio window over
s3fs's client 0.7x (BENCHMARKS.md).  boto3 keeps N parts in flight on N
threads, so S3 uploads go through it; listing, reads and the exclusive
manifest commit stay on fsspec.

A promotion streams (``PartStreams``): each file's bytes are produced in order (header, then tensor after
tensor) and sent as multipart parts, each a view of those arrays (no copy), while the next ones are produced, so
no staging file is written and read back (BENCHMARKS.md, "The object tier on SeaweedFS vs boto3").
"""
from __future__ import annotations

import bisect
import itertools
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

MIN_PART = 5 << 20  # S3's smallest part but the last
MAX_PARTS = 10_000  # S3's most parts of one upload


def s3_client(endpoint_url: str | None, region: str | None, storage_options: dict[str, Any],
              config_kwargs: dict[str, Any] | None = None):
    """A boto3 S3 client for the same endpoint, credentials and botocore settings (timeouts,
    retries) as the tier's s3fs filesystem."""
    import boto3
    import botocore.session
    from botocore.config import Config

    creds = {
        "aws_access_key_id": storage_options.get("key"),
        "aws_secret_access_key": storage_options.get("secret"),
        "aws_session_token": storage_options.get("token"),
    }
    core = botocore.session.Session()
    with _LOADER_LOCK:  # the service models, parsed once a process (~60 ms a client otherwise); never credentials
        if not _LOADER:
            _LOADER.append(core.get_component("data_loader"))
    core.register_component("data_loader", _LOADER[0])
    session = boto3.session.Session(botocore_session=core, profile_name=storage_options.get("profile"),
                                    **{k: v for k, v in creds.items() if v})
    return session.client("s3", endpoint_url=endpoint_url, region_name=region, config=Config(**(config_kwargs or {})))


_LOADER: list = []  # botocore's loader of service models (immutable data), shared by every client this module makes
_LOADER_LOCK = threading.Lock()


def upload_file(client, local: str, remote: str, config, progress: Callable[[int], None] | None = None) -> None:
    """Upload ``local`` to ``remote`` (``bucket/key``) as boto3's TransferConfig ``config`` says.

    Each request is retried by the client's botocore config; a part that runs out of attempts
    fails the upload, which the transfer manager then aborts (best effort: GC aborts what is left).
    The caller retries the whole file."""
    bucket, key = remote.split("/", 1)
    client.upload_file(os.fspath(local), bucket, key, Config=config, Callback=progress)


def part_size(size: int, workers: int, part_mib: int) -> int:
    """The part size for a file of ``size`` bytes: small enough that its parts keep ``workers`` requests busy, at
    most ``part_mib`` MiB, at least S3's 5 MiB and large enough for S3's 10,000 parts."""
    return max(MIN_PART, -(-size // MAX_PARTS), min(part_mib << 20, -(-size // workers)))


class Skipped(Exception):
    """A file not sent (whole) because another file of the write failed first: send it again once that is settled."""


class PartBody:
    """A part's bytes as a seekable file over views of the caller's buffers (no copy: botocore hashes it and
    http.client sends it by reading blocks, each a view). The buffers must not change while it is sent."""

    def __init__(self, views: list[memoryview]) -> None:
        self._views = views
        self._starts = list(itertools.accumulate((len(v) for v in views), initial=0))
        self._size = self._starts[-1]
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        self._pos = min(max(0, base + offset), self._size)
        return self._pos

    def read(self, n: int | None = -1):
        """Up to ``n`` bytes (all that is left when ``n`` is None or negative): a view where they lie in one buffer,
        else a copy joining them; ``b""`` at the end."""
        left = self._size - self._pos
        n = left if n is None or n < 0 else min(n, left)
        if n <= 0:
            return b""
        i = bisect.bisect_right(self._starts, self._pos) - 1
        at = self._pos - self._starts[i]
        self._pos += n
        if at + n <= len(self._views[i]):
            return self._views[i][at:at + n]
        out = bytearray()
        while len(out) < n:
            out += self._views[i][at:at + n - len(out)]
            i, at = i + 1, 0
        return bytes(out)


class PartStreams:
    """One write's streamed uploads: ``workers`` part requests in flight across its files, at most ``workers + 1``
    parts (views of the caller's buffers, see ``PartBody``) held at once; ``send`` blocks while that many are.

    Each file is a multipart upload (one ``put_object`` when it fits one part) with the checksum the transfer
    manager would ask for (botocore's default, CRC32, unless the client says ``when_required``), completed once its
    last part is in; a file whose part failed (after botocore's own retries) is aborted (best effort: GC aborts
    what is left) and its future fails: the caller sends it again, whole, or gives up. Once a file failed
    (``failed`` is set), files being fed stop and fail with ``Skipped``; the caller clears ``failed`` when it has
    dealt with it."""

    def __init__(self, client, workers: int, part_mib: int) -> None:
        from botocore.httpchecksum import DEFAULT_CHECKSUM_ALGORITHM

        self.client, self.workers, self.part_mib = client, workers, part_mib
        wanted = getattr(client.meta.config, "request_checksum_calculation", "when_supported")
        self.checksum = DEFAULT_CHECKSUM_ALGORITHM.upper() if wanted == "when_supported" else None
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="fc-part")
        self._slots = threading.Semaphore(workers + 1)
        self._closing = threading.Event()
        self.failed = threading.Event()
        self._open: set[_Upload] = set()  # multipart uploads started and neither completed nor aborted
        self._open_lock = threading.Lock()

    def send(self, remote: str, size: int, chunks: Iterable, progress: Callable[[int], None]) -> Future:
        """Upload the ``size`` bytes ``chunks`` yields (buffers, in order, unchanged until the upload is done) to
        ``remote`` (``bucket/key``); the future is done once the object is complete. Raises ValueError (nothing
        left behind) when the chunks are not ``size`` bytes."""
        bucket, key = remote.split("/", 1)
        part = part_size(size, self.workers, self.part_mib)
        upload = _Upload(self, bucket, key, size, part, progress)
        try:
            upload.feed(chunks)
        except BaseException:
            upload.failure = upload.failure or RuntimeError("abandoned")  # parts still in flight stop there
            upload.abandon()
            raise
        return upload.done

    def close(self, failed: bool) -> None:
        """Wait for what is in flight (``failed``: cancel what has not started; its uploads are aborted)."""
        if failed:
            self._closing.set()
        self._pool.shutdown(wait=True, cancel_futures=failed)
        with self._open_lock:
            left = list(self._open)  # a file whose queued parts were cancelled never finishes: abort it here
        for upload in left:
            upload.abandon()


class _Upload:
    """One file of a ``PartStreams``: its parts as they are filled, its completion after the last."""

    def __init__(self, streams: PartStreams, bucket: str, key: str, size: int, part: int, progress) -> None:
        self.s, self.bucket, self.key, self.size, self.part, self.progress = streams, bucket, key, size, part, progress
        self.done: Future = Future()
        self.parts: dict[int, dict] = {}
        self.upload_id: str | None = None
        self.pending = 0  # parts submitted and not finished
        self.fed = False  # every part submitted
        self.failure: BaseException | None = None
        self.lock = threading.Lock()

    def _extra(self) -> dict:
        return {"ChecksumAlgorithm": self.s.checksum} if self.s.checksum else {}

    def feed(self, chunks: Iterable) -> None:
        """Cut ``chunks`` into parts and submit each as it is whole (waiting for a slot); a part that failed
        meanwhile stops the feeding (the future then carries its error)."""
        multipart = self.size > self.part
        if multipart:
            try:
                self.upload_id = self.s.client.create_multipart_upload(Bucket=self.bucket, Key=self.key,
                                                                       **self._extra())["UploadId"]
                with self.s._open_lock:
                    self.s._open.add(self)
            except Exception as e:  # noqa: BLE001 - the file's failure, handed to whoever waits for it
                self.failure = e
                self.s.failed.set()
        number, views, filled, sent = 1, [], 0, 0
        for chunk in chunks if self.failure is None else ():
            view = memoryview(chunk).cast("B")
            offset = 0
            while offset < len(view) and self.failure is None:
                if self.s._closing.is_set():
                    raise RuntimeError(f"s3://{self.bucket}/{self.key}: not sent: the write was given up")
                if self.s.failed.is_set():
                    self.failure = Skipped(f"s3://{self.bucket}/{self.key}: not sent: another file failed first")
                    break
                want = min(self.part, self.size - sent)
                if want <= 0:
                    raise ValueError(f"s3://{self.bucket}/{self.key}: expected {self.size} bytes, found more")
                n = min(want - filled, len(view) - offset)
                views.append(view[offset:offset + n])
                filled, offset = filled + n, offset + n
                if filled == want:
                    self.s._slots.acquire()  # may wait for a part in flight
                    self._submit(number, PartBody(views), multipart)
                    number, views, filled, sent = number + 1, [], 0, sent + filled
            if self.failure is not None:
                break
        if self.failure is None and sent != self.size:
            raise ValueError(f"s3://{self.bucket}/{self.key}: expected {self.size} bytes, found {sent + filled}")
        with self.lock:
            self.fed = True
            last = self.pending == 0
        if last:
            self._finish()

    def _submit(self, number: int, body: PartBody, multipart: bool) -> None:
        with self.lock:
            self.pending += 1
        try:
            self.s._pool.submit(self._send, number, body, multipart)
        except RuntimeError:  # the pool is shut down: the write was given up
            with self.lock:
                self.pending -= 1
            self.s._slots.release()
            raise

    def _send(self, number: int, body: PartBody, multipart: bool) -> None:
        try:
            if self.failure is None and self.s.failed.is_set():  # queued behind a failure: not sent either
                self.failure = Skipped(f"s3://{self.bucket}/{self.key}: part {number} not sent: another file failed")
            if self.failure is None and not self.s._closing.is_set():
                if multipart:
                    resp = self.s.client.upload_part(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                                                     PartNumber=number, Body=body, **self._extra())
                    entry = {"PartNumber": number, "ETag": resp["ETag"]}
                    if self.s.checksum and f"Checksum{self.s.checksum}" in resp:
                        entry[f"Checksum{self.s.checksum}"] = resp[f"Checksum{self.s.checksum}"]
                    self.parts[number] = entry
                else:
                    self.s.client.put_object(Bucket=self.bucket, Key=self.key, Body=body, **self._extra())
                self.progress(len(body))
            elif self.failure is None:
                self.failure = RuntimeError(f"s3://{self.bucket}/{self.key}: the write was given up")
        except BaseException as e:  # noqa: BLE001 - the file's failure, handed to whoever waits for it
            self.failure = self.failure or e
            self.s.failed.set()
        finally:
            self.s._slots.release()
        with self.lock:
            self.pending -= 1
            last = self.fed and self.pending == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        try:
            if self.failure is None and self.s._closing.is_set():
                self.failure = RuntimeError(f"s3://{self.bucket}/{self.key}: not completed: the write was given up")
            if self.failure is not None:
                raise self.failure
            if self.upload_id is not None:
                parts = [self.parts[i] for i in sorted(self.parts)]
                self.s.client.complete_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                                                        MultipartUpload={"Parts": parts})
                with self.s._open_lock:
                    self.s._open.discard(self)
            self.done.set_result(None)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for this file
            if not isinstance(e, Skipped):
                self.s.failed.set()
            self.abandon()
            self.done.set_exception(e)

    def abandon(self) -> None:
        """Abort the multipart upload (best effort: GC aborts what a failed abort leaves)."""
        with self.s._open_lock:
            if self.upload_id is None:
                return
            upload_id, self.upload_id = self.upload_id, None
            self.s._open.discard(self)
        try:
            self.s.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=upload_id)
        except Exception:  # noqa: BLE001, S110 - GC's abort_multipart removes it after the grace period
            pass
