"""What differs between object stores, chosen once per tier: local folders (``file://``), S3, any other fsspec URL.

A backend says how a file is uploaded, how a small record is replaced, how the manifest is created exclusively,
what "the configured root does not exist" means, and what a refused access says to do.  The tier itself
(tiers/object.py) never tests the protocol.
"""
from __future__ import annotations

import errno
import os
import shutil
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timezone
from typing import Any, Protocol

from flowcheck.config import ObjectConfig
from flowcheck.errors import TierAccessError, TierError, TierMissingError
from flowcheck.tiers.durable import commit_file_exclusive, fsync_dir, fsync_file, replace_file
from flowcheck.tiers.retry import AWS_CREDENTIALS_HINT, access_problem, refused_create

S3_PROTOCOLS = ("s3", "s3a")
READERS = 4  # threads reading a local folder's files (streams of a fetch at once)
S3_READERS = 8  # ranged GETs in flight at once for one tier's reads
# the largest ranged GET: a stream of one file is cut into requests this long (a read-ahead or restore batch of
# 256 MiB, with the next one in flight, keeps S3_READERS busy; a store that reads a whole object per ranged GET,
# as moto does, sees few requests per object)
S3_REQUEST = 64 << 20


class TierIO(Protocol):
    """What a backend uses of its object tier: the configured store, its fsspec filesystem, and the tier's retried
    call (a backend is the byte layer under the tier: it never reads or writes a step's meaning)."""

    config: ObjectConfig
    fs: Any
    url: str
    boto: Any
    endpoint: str | None

    def call(self, what: str, fn: Callable, *args: Any, **kwargs: Any) -> Any: ...
    def call_once(self, what: str, fn: Callable, *args: Any, **kwargs: Any) -> Any: ...


def bar_callback(bar):
    """An fsspec callback feeding one shared tqdm bar (parts of many files count toward one total)."""
    from fsspec.callbacks import Callback

    class _Bar(Callback):
        seen = 0

        def call(self, *args, **kwargs) -> None:
            if self.value > self.seen:
                bar.update(self.value - self.seen)
                self.seen = self.value

    return _Bar()


@dataclass(frozen=True)
class Uploads:
    """A write's uploads: ``submit(local, remote, size, bar, what)`` starts one and returns its future."""

    submit: Callable[..., Future]


def aws_endpoint_region(config: ObjectConfig) -> tuple[str | None, str | None]:
    """The S3 endpoint and region: the config's, else the standard AWS environment's."""
    endpoint = config.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = config.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    return endpoint, region


def filesystem(config: ObjectConfig):
    """(fsspec filesystem, root path) for the configured URL; S3 follows the AWS environment."""
    import fsspec

    options = dict(config.storage_options)
    protocol = config.url.split("://", 1)[0]
    if protocol in S3_PROTOCOLS:
        try:
            import s3fs  # noqa: F401
        except ImportError as e:
            raise TierError("tiers.object.url is s3:// but s3fs is not installed: pip install 'flowcheck[s3]'") from e
        endpoint, region = aws_endpoint_region(config)
        if endpoint:
            options.setdefault("endpoint_url", endpoint)
        if region:
            options.setdefault("client_kwargs", {}).setdefault("region_name", region)
        # bounded requests: botocore retries each one (standard mode, backoff + jitter); the options win
        options["config_kwargs"] = {**botocore_options(config), **options.get("config_kwargs", {})}
    try:
        fs, root = fsspec.core.url_to_fs(config.url, **options)
    except (ImportError, ValueError) as e:
        raise TierError(f"tiers.object.url {config.url!r}: cannot open ({e}); install the fsspec backend for it") from e
    if protocol in S3_PROTOCOLS:
        # s3fs would retry botocore's retries again (5 times, multiplying read timeouts); the tier's
        # own loop retries whole operations instead, within retry_deadline_s
        fs.retries = 1
    return fs, root.rstrip("/")


def botocore_options(config: ObjectConfig) -> dict:
    """botocore client settings for the configured timeouts and per-request attempts."""
    return {"connect_timeout": config.connect_timeout_s, "read_timeout": config.read_timeout_s,
            "retries": {"mode": "standard", "total_max_attempts": config.request_attempts}}


def backend_for(tier: TierIO) -> Backend:
    protocol = tier.fs.protocol if isinstance(tier.fs.protocol, str) else tier.fs.protocol[0]
    if protocol == "file":
        return FileBackend(tier, protocol)
    if protocol in S3_PROTOCOLS:
        return S3Backend(tier, protocol)
    return Backend(tier, protocol)


def _as_tier_error(tier: TierIO, what: str, e: BaseException) -> BaseException:
    """``e``, raised by a call made outside the tier's ``call_once``, as that call would have raised it (a TierError
    naming the tier and ``what``; TierAccessError / TierMissingError for what no retry can fix)."""
    def fail() -> None:
        raise e

    try:
        tier.call_once(what, fail)
    except BaseException as wrapped:  # noqa: BLE001 - returned to be raised where the caller waits
        return wrapped
    return e


class Backend:
    """Any fsspec store: plain puts, and a check-then-write commit (no conditional write is known for it)."""

    readers = READERS  # threads of this backend's streamed reads (``_read_streams``)

    def __init__(self, tier: TierIO, protocol: str) -> None:
        self.tier, self.protocol = tier, protocol
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @property
    def retries(self) -> int:
        return self.tier.config.retries

    def root_exists(self, base: str) -> bool:
        """Whether the configured root exists (False: not created yet; TierMissingError: it cannot be)."""
        return bool(self.tier.call("checking the root", self.tier.fs.exists, base))

    def put_record(self, path: str, data: bytes) -> None:
        self.tier.call(f"writing {path}", self.tier.fs.pipe_file, path, data)

    def remove_tree(self, path: str, what: str) -> None:
        """Delete ``path`` and everything under it (FileNotFoundError when there is nothing)."""
        self.tier.call(what, self.tier.fs.rm, path, recursive=True)

    def create_exclusive(self, path: str, data: bytes, what: str) -> None:
        # no conditional write known for this backend: check-then-write (not race-free)
        if self.tier.call(f"checking {path}", self.tier.fs.exists, path):
            raise FileExistsError(path)
        self.tier.call(what, self.tier.fs.pipe_file, path, data)

    def fetch_into(self, wants: list, dests: list, done=None) -> None:
        """Read every byte range (``range_reads.Want``) into its destination (a writable uint8 array), calling
        ``done(i)`` once want i's bytes are in (here: after all of them came)."""
        import numpy as np

        from flowcheck.tiers import range_reads

        for dest, blob in zip(dests, range_reads.fetch(self.tier.fs, wants)):
            dest[:] = np.frombuffer(blob, np.uint8)
        for i in range(len(wants)) if done is not None else ():
            done(i)

    def reads_whole_files(self) -> bool:
        """Whether ``fetch_into`` takes ``files``: stored files read by one request each, header included."""
        return False

    def _read_streams(self, wants: list, dests: list, done, most: int, read: Callable, files: tuple = (),
                      read_file: Callable | None = None) -> None:
        """The wants as streams of at most ``most`` bytes (``range_reads.streams``), each read by
        ``read(path, pieces, piece_done)`` on this backend's reader threads (one stream: on this thread), and
        each of ``files`` (``(path, size, indices, place)``) by ``read_file(path, size, place, piece_done)``; a
        failed fetch cancels what it still had queued.  ``done(i)`` once all of want i's bytes are in."""
        from flowcheck.tiers.range_reads import streams

        parts = streams(wants, dests, most)
        left = Counter(i for _, pieces in parts for i, _, _ in pieces)  # pieces of each want not read yet
        left.update(i for _, _, indices, _ in files for i in indices)
        lock = threading.Lock()

        def piece_done(i: int) -> None:
            with lock:
                left[i] -= 1
                last = left[i] == 0
            if last and done is not None:
                done(i)

        jobs = [(read, (path, pieces, piece_done)) for path, pieces in parts]
        jobs += [(read_file, (path, size, place, piece_done)) for path, size, _, place in files]
        if len(jobs) <= 1:
            for fn, args in jobs:
                fn(*args)
            return
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.readers, thread_name_prefix="flowcheck-object-read")
        futures = [self._pool.submit(fn, *args) for fn, args in jobs]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()  # a failed fetch leaves nothing queued behind it
            raise

    @contextmanager
    def uploads(self) -> Iterator[Uploads]:
        """Uploads of one write, started in order and waited for in order: each file, one after the other,
        on a thread of its own (staging the next file goes on meanwhile)."""
        with ThreadPoolExecutor(1, "fc-upload") as pool:
            yield Uploads(lambda local, remote, size, bar, what: pool.submit(self.upload, local, remote, size, bar, what))

    @contextmanager
    def streams(self) -> Iterator[Any]:
        """A write's uploads streamed from memory (``s3_upload.PartStreams``: ``send(remote, size, chunks,
        progress) -> Future``), or None where its files are staged locally and uploaded through ``uploads``."""
        yield None

    def upload(self, local: str, remote: str, size: int, bar, what: str) -> None:
        cb = bar_callback(bar)
        self.tier.call(what, self.tier.fs.put_file, local, remote, callback=cb, **self._put_options())
        bar.update(max(0, size - cb.seen))

    def _put_options(self) -> dict:
        return {}

    def abort_multipart(self, cutoff: float, dry_run: bool) -> list[str]:
        return []

    def access_error(self, what: str, e: BaseException) -> TierAccessError:
        return TierAccessError(f"object tier {self.tier.url}: {what}: access refused ({e}); expected this process "
                               f"to be allowed to read and write {self.tier.config.url} (tiers.object.url): check its "
                               "credentials or permissions")

    def missing_error(self, e: BaseException | None) -> TierMissingError:
        return TierMissingError(f"object tier {self.tier.url}: expected the store tiers.object.url = "
                                f"{self.tier.config.url!r} to exist, found nothing there ({e}); fix the URL")


class FileBackend(Backend):
    """A local or mounted folder: fsync'd copies, a hard-link commit, no retries (a disk does not heal by
    trying again)."""

    retries = 0

    def root_exists(self, base: str) -> bool:
        """A missing folder whose parent exists is a store not created yet (the first write creates it);
        with its parent missing too it is a typo or an unmounted volume: TierMissingError."""
        if os.path.isdir(base):
            return True
        if os.path.exists(base):
            raise TierMissingError(f"object tier {self.tier.config.url}: expected a folder at {base} "
                                   "(tiers.object.url), found a file; point tiers.object.url at a folder")
        parent = os.path.dirname(base.rstrip("/")) or "/"
        if os.path.isdir(parent):
            return False
        raise TierMissingError(
            f"object tier {self.tier.config.url}: expected the folder {base} (tiers.object.url) or at least its "
            f"parent {parent} to exist, found neither; check the path (a typo, or a volume not mounted), or create "
            f"it: mkdir -p {base}")

    def put_record(self, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        replace_file(path, data)

    def fetch_into(self, wants: list, dests: list, done=None) -> None:
        """Ranges read straight into their destinations (no bytes objects, no copy) as a few sequential streams on
        threads shared by this tier's fetches (one reader alone does not keep a disk busy; a read-ahead fetch
        queues behind the one before it, so the disk does not wait between them); ``done(i)`` runs on the
        reading thread as soon as want i's bytes are in."""
        from flowcheck.tiers.range_reads import read_stream

        total = sum(w.end - w.start for w in wants)
        self._read_streams(wants, dests, done, max(16 << 20, -(-total // READERS)), read_stream)

    def create_exclusive(self, path: str, data: bytes, what: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        commit_file_exclusive(path, data)

    def upload(self, local: str, remote: str, size: int, bar, what: str) -> None:
        try:
            os.makedirs(os.path.dirname(remote), exist_ok=True)
            shutil.copyfile(local, remote)
            fsync_file(remote)  # the manifest must not be durable before the data it names
            fsync_dir(os.path.dirname(remote))
            fsync_dir(os.path.dirname(os.path.dirname(remote)))  # the attempt folder's entry, beside the manifest
        except OSError as e:  # the target refused it (read-only, full, no permission): not the staging disk
            raise TierError(f"object tier {self.tier.url}: {what} failed: {e.strerror or e} (errno {e.errno}, "
                            f"{e.filename or remote}); check that tiers.object.url {self.tier.config.url} is a "
                            "writable folder with free space") from e
        bar.update(size)

    def access_error(self, what: str, e: BaseException) -> TierAccessError:
        return TierAccessError(f"object tier {self.tier.url}: {what}: permission denied ({e}); expected a folder "
                               f"this user may read and write (tiers.object.url {self.tier.config.url}): check "
                               "its owner and mode")


class S3Backend(Backend):
    """S3: parallel multipart through boto3, ``If-None-Match`` commits, a bucket that must exist."""

    def root_exists(self, base: str) -> bool:
        """The bucket must exist (TierMissingError names it); a prefix needs no creating (S3 has no folders:
        an empty prefix is an empty store). Asked with a one-key listing of the prefix, not HeadBucket: a policy
        may allow listing a prefix and refuse the bucket-wide call."""
        bucket, _, prefix = base.partition("/")
        try:
            self.tier.call_once(f"checking bucket {bucket!r}", self.tier.fs.call_s3, "list_objects_v2",
                                 Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=1)
        except FileNotFoundError as e:
            raise self.missing_error(e) from e
        return True

    def create_exclusive(self, path: str, data: bytes, what: str) -> None:
        try:  # once: a retried create whose first answer was lost is refused; the caller decides
            self.tier.call_once(what, self.tier.fs.pipe_file, path, data, mode="create")
        except TierError as e:
            if getattr(e.__cause__, "errno", None) == errno.EBUSY:  # 409 ConditionalRequestConflict:
                raise FileExistsError(path) from e  # a concurrent create of the same key is in flight
            if refused_create(e):  # 412 without AWS's <Condition> element (SeaweedFS): the key exists
                raise FileExistsError(path) from e
            raise

    def remove_tree(self, path: str, what: str) -> None:
        """Every object under ``path``, then the folders they were in, deepest first, in batched deletes.
        SeaweedFS's filer keeps a folder whose last object went (a delimited listing still shows it as a prefix)
        until ``<folder>/`` itself is deleted, and never deletes one that still holds something; on AWS no such
        key exists and deleting it does nothing. With no object under ``path``, its empty folders go."""
        t = self.tier
        t.fs.invalidate_cache(path)
        try:
            found = t.call(f"listing {path}", t.fs.find, path, detail=True)
        except FileNotFoundError:
            found = {}
        # an empty SeaweedFS folder answers a HEAD as itself, which s3fs's find reports as a directory entry
        files = [f for f, info in found.items() if f.startswith(path + "/") and info.get("type") != "directory"]
        folders = _folders_of(path, files) if files else self._empty_folders(path)
        bucket = path.split("/", 1)[0]
        keys = [f.split("/", 1)[1] for f in files] + [f.split("/", 1)[1] + "/" for f in folders]
        for i in range(0, len(keys), 1000):  # S3's limit per request; folders come after what they held
            batch = {"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True}
            resp = t.call(what, t.fs.call_s3, "delete_objects", Bucket=bucket, Delete=batch)
            failed = [f"{e.get('Key')}: {e.get('Code')}" for e in resp.get("Errors", []) if not e["Key"].endswith("/")]
            if failed:
                raise TierError(f"object tier {t.url}: {what}: {len(failed)} objects were not deleted: {failed[:3]}")
        t.fs.invalidate_cache(path)

    def _empty_folders(self, path: str, depth: int = 4) -> list[str]:
        """``path`` and the (empty) folders a delimited listing shows under it, deepest first."""
        t = self.tier
        try:
            entries = t.call(f"listing {path}", t.fs.ls, path, detail=True, refresh=True)
        except FileNotFoundError:
            entries = []
        subs = [e["name"].rstrip("/") for e in entries if e.get("type") == "directory"] if depth else []
        return [f for s in subs for f in self._empty_folders(s, depth - 1)] + [path]

    readers = S3_READERS

    def fetch_into(self, wants: list, dests: list, done=None, files: tuple = ()) -> None:
        """Ranges read through boto3 straight into their destinations: ranges that follow each other in one file
        join into one ranged GET (of at most S3_REQUEST bytes; S3_READERS in flight), each body read into place as
        it arrives (no bytes objects, no copy); ``done(i)`` on the reading thread.  Each of ``files`` (``(path,
        size, indices, place)``, see ``range_reads.get_file``) is read by one GET, its pieces indexed after the
        wants."""
        client = self.tier.boto3_client()
        if client is None:
            return super().fetch_into(wants, dests, done)
        from flowcheck.tiers.range_reads import get_file, get_stream

        self._read_streams(wants, dests, done, S3_REQUEST, lambda path, pieces, piece_done: get_stream(
            client, path, pieces, piece_done), files, lambda path, size, place, piece_done: get_file(
            client, path, size, place, piece_done))

    def reads_whole_files(self) -> bool:
        return self.tier.boto3_client() is not None

    def upload(self, local: str, remote: str, size: int, bar, what: str) -> None:
        client = self.tier.boto3_client()
        if client is None:
            return super().upload(local, remote, size, bar, what)
        from flowcheck.tiers.s3_upload import upload_file

        self.tier.call(what, upload_file, client, local, remote, self._transfer_config(size), progress=bar.update)

    @contextmanager
    def uploads(self) -> Iterator[Uploads]:
        """Every file of one write through one boto3 transfer manager: ``upload_workers`` requests in flight in
        all, so the next file's parts go out while the previous file's last parts and its completion (seconds for
        a multi-GiB object) are still under way. A file whose transfer failed is uploaded again, whole, through
        ``upload`` (the tier's retries and error messages)."""
        client = self.tier.boto3_client()
        if client is None:
            with super().uploads() as up:
                yield up
            return
        from boto3.s3.transfer import create_transfer_manager
        from s3transfer.subscribers import BaseSubscriber

        tier = self.tier
        managers: list = []  # made for the first file: its part size keeps every worker busy on it
        closing = threading.Event()  # the write is over (failed elsewhere): what fails now is not retried
        retries: list[threading.Thread] = []  # joined before the write returns: nothing uploads after it

        def submit(local: str, remote: str, size: int, bar, what: str) -> Future:
            if not managers:
                managers.append(create_transfer_manager(client, self._transfer_config(size)))
            out: Future = Future()

            def again() -> None:  # the whole file once more, through the retrying path
                try:
                    if closing.is_set():
                        raise TierError(f"object tier {self.tier.url}: {what}: not retried: the write failed")
                    self.upload(local, remote, size, bar, what)
                    out.set_result(None)
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits for this file
                    out.set_exception(e)

            class Watch(BaseSubscriber):
                def on_progress(self, future, bytes_transferred, **kwargs) -> None:
                    bar.update(bytes_transferred)

                def on_done(self, future, **kwargs) -> None:
                    try:
                        future.result()
                        out.set_result(None)
                    except Exception as e:  # noqa: BLE001 - retried whole, unless the write is being given up
                        if closing.is_set():
                            out.set_exception(e)
                        elif not tier.config.retries:  # retries: 0, the first failure is the answer
                            out.set_exception(_as_tier_error(tier, what, e))
                        else:
                            retries.append(threading.Thread(target=again, name="fc-upload-retry", daemon=True))
                            retries[-1].start()

            bucket, key = remote.split("/", 1)
            managers[0].upload(os.fspath(local), bucket, key, subscribers=[Watch()])
            return out

        failed: BaseException | None = None
        try:
            yield Uploads(submit)
        except BaseException as e:  # the write failed: the manager cancels what is still in flight
            failed = e
            closing.set()
            raise
        finally:
            for m in managers:
                m.__exit__(type(failed) if failed else None, failed, None)
            for t in list(retries):  # bounded by the tier's retry deadline
                t.join()

    @contextmanager
    def streams(self) -> Iterator[Any]:
        """With boto3: each file sent as multipart parts cut from the write's arrays as they are read (views, no
        staging file, no copy), ``upload_workers`` requests in flight across the write's files; what is queued when
        the write fails is cancelled and its uploads aborted."""
        client = self.tier.boto3_client()
        if client is None:
            yield None
            return
        from flowcheck.tiers.s3_upload import PartStreams

        streams = PartStreams(client, self.tier.config.upload_workers, self.tier.config.part_mib)
        failed = True
        try:
            yield streams
            failed = False
        finally:
            streams.close(failed)

    def _transfer_config(self, size: int):
        """``upload_workers`` requests in flight, of parts no larger than needed to keep every worker busy on a
        file of ``size`` bytes (S3's minimum part is 5 MiB)."""
        from boto3.s3.transfer import TransferConfig

        from flowcheck.tiers.s3_upload import part_size

        workers = self.tier.config.upload_workers
        part = part_size(size, workers, self.tier.config.part_mib)
        return TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=workers,
                              use_threads=True)

    def _put_options(self) -> dict:
        return {"chunksize": self.tier.config.part_mib << 20, "max_concurrency": self.tier.config.upload_workers}

    def abort_multipart(self, cutoff: float, dry_run: bool) -> list[str]:
        t = self.tier
        bucket, _, prefix = t.root.partition("/")
        resp = t.call("listing multipart uploads", t.fs.call_s3, "list_multipart_uploads",
                       Bucket=bucket, Prefix=prefix + "/")
        aborted = []
        for up in resp.get("Uploads", []):
            started = up["Initiated"]
            if started.replace(tzinfo=started.tzinfo or timezone.utc).timestamp() < cutoff:
                aborted.append(f"multipart:{bucket}/{up['Key']}")
                if not dry_run:
                    try:
                        t.call("aborting a multipart upload", t.fs.call_s3, "abort_multipart_upload",
                                Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
                    except FileNotFoundError:  # NoSuchUpload: completed or aborted meanwhile
                        aborted.pop()
        return aborted

    def access_error(self, what: str, e: BaseException) -> TierAccessError:
        if access_problem(e) == "credentials":
            found, more = "no credentials", ""
        else:
            found = f"access refused ({type(e).__name__}: {e})"
            more = "; or check the bucket policy / IAM permissions of these credentials for that bucket and prefix"
        return TierAccessError(
            f"object tier {self.tier.url}: {what}: expected credentials allowed to read and write "
            f"{self.tier.config.url} (tiers.object.url), found {found}; {AWS_CREDENTIALS_HINT}{more}")

    def missing_error(self, e: BaseException | None) -> TierMissingError:
        bucket = self.tier.config.url.split("://", 1)[-1].split("/", 1)[0]
        endpoint = self.tier.endpoint or "AWS"
        return TierMissingError(
            f"object tier {self.tier.config.url}: expected the bucket {bucket!r} (tiers.object.url) to exist at "
            f"{endpoint}, found no such bucket; fix tiers.object.url (or tiers.object.endpoint_url / "
            f"AWS_ENDPOINT_URL), or create it: aws s3 mb s3://{bucket}")


def _folders_of(root: str, files: list[str]) -> list[str]:
    """``root`` and every folder between it and ``files``, deepest first."""
    folders = {root}
    for f in files:
        parent = f.rsplit("/", 1)[0]
        while parent.startswith(root + "/"):
            folders.add(parent)
            parent = parent.rsplit("/", 1)[0]
    return sorted(folders, key=lambda f: (-f.count("/"), f))
