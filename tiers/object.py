"""The object tier: safetensors files + manifest.json under any fsspec URL (s3://, file://, ...).

Layout: ``<url>/<run>/step-<step:09d>/attempt-<12 hex>/shard-00000-of-000NN.safetensors``
(files cut at ``max_file_mib``; a larger shard is split by rows) and ``step-…/manifest.json``.
Files are staged locally and uploaded with parallel multipart (``put_file``);
the manifest is committed last with an exclusive create (S3 ``If-None-Match``,
a hard link on local disks), so a step without a manifest does not exist.
Each write uploads into its own attempt folder, so two writers of one step never
overwrite each other's files: the manifest create picks the winner, whose manifest
names its folder, and the loser removes its own folder (GC removes one a killed
loser left, after the grace period).
Reads fetch the header, then only the byte ranges of the rows asked for.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import math
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np

from flowcheck import dtypes
from flowcheck.config import ClusterConfig, ObjectConfig, TierPolicy
from flowcheck.errors import FlowcheckError, FormatError, IntegrityError, StepExistsError, StepNotFoundError, TierError
from flowcheck.manifest import FileEntry, Manifest, ParentRef, Piece, ShardEntry, parse
from flowcheck.progress import Progress
from flowcheck.state import Shard, Snapshot
from flowcheck.tiers import range_reads
from flowcheck.tiers import safetensors_io as st
from flowcheck.tiers.base import Problem, Tier, make_manifest, parse_step_dir, shard_digests, step_dir
from flowcheck.tiers.durable import commit_file_exclusive, fsync_dir, fsync_file, replace_file
from flowcheck.tiers.retry import RetryPolicy

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
ATTEMPT = "attempt-"
PIPELINE_MIN_FILE = 256 << 20
READ_AHEAD = 256 << 20  # bytes of whole shards fetched together when a step is read shard by shard


def attempt_dir(prefix: str) -> str:
    """A folder under ``prefix`` that no other writer picks: one write's files go there, and the
    manifest that wins the commit names them (48 random bits; two writers colliding is negligible)."""
    return f"{prefix}/{ATTEMPT}{uuid.uuid4().hex[:12]}"


def attempt_of(rel: str) -> str | None:
    """The attempt folder holding a stored file (``…/attempt-<hex>/…``), else None (an older layout)."""
    parts = rel.split("/")
    for i, part in enumerate(parts[:-1]):
        if part.startswith(ATTEMPT):
            return "/".join(parts[:i + 1])
    return None


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
    if protocol in ("s3", "s3a"):
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
    if protocol in ("s3", "s3a"):
        # s3fs would retry botocore's retries again (5 times, multiplying read timeouts); the tier's
        # own loop retries whole operations instead, within retry_deadline_s
        fs.retries = 1
    return fs, root.rstrip("/")


def botocore_options(config: ObjectConfig) -> dict:
    """botocore client settings for the configured timeouts and per-request attempts."""
    return {"connect_timeout": config.connect_timeout_s, "read_timeout": config.read_timeout_s,
            "retries": {"mode": "standard", "total_max_attempts": config.request_attempts}}


@dataclass(frozen=True)
class _Planned:
    """A piece of a shard placed in a planned file."""

    shard: Shard
    key: str
    rows: tuple[int, int] | None


class ObjectTier(Tier):
    name = "object"

    def __init__(self, config: ObjectConfig, run: str, *, staging_dir: str, progress: bool = False,
                 cluster: ClusterConfig | None = None, grace_s: float = TierPolicy.tmp_grace_seconds, **kw) -> None:
        super().__init__(run, **kw)
        self.config = config
        # a file no manifest names may be a concurrent writer's upload in progress for this long;
        # verify flags it as an error only once it is older (GC passes its own grace to clean_incomplete)
        self.grace_s = grace_s
        self.cluster = cluster if cluster is not None and cluster.nodes else None  # several nodes write each step
        self.fs, base = filesystem(config)
        self._endpoint, self._region = aws_endpoint_region(config)
        self.protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.root = f"{base}/{self.rel}"
        self.staging_dir = staging_dir
        self.progress = progress
        self._headers: OrderedDict[str, st.Header] = OrderedDict()
        self._window: dict[tuple, np.ndarray] = {}
        self._expected: tuple | None = None  # the shard a sequential reader asks for next
        self._window_lock = threading.Lock()
        # local disks do not heal by trying again; a network store's transient faults do
        self._retry = RetryPolicy(0 if self.protocol == "file" else config.retries, config.retry_deadline_s)

    def at_branch(self, branch: str) -> ObjectTier:
        return ObjectTier(self.config, self.run, staging_dir=self.staging_dir, progress=self.progress,
                          cluster=self.cluster, grace_s=self.grace_s, branch=branch, **self._same_kw())

    @property
    def url(self) -> str:
        return self.config.url.rstrip("/") + "/" + self.rel

    def _p(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def _call(self, what: str, fn, *args, **kwargs):
        """Run one idempotent fsspec call, retried on transient failures (tiers/retry.py)."""
        return self._retry.run(f"object tier {self.url}: {what}", lambda: self._call_once(what, fn, *args, **kwargs))

    def _call_once(self, what: str, fn, *args, **kwargs):
        """Run one fsspec call, turning transport failures into a TierError that names the URL."""
        try:
            return fn(*args, **kwargs)
        except (FileNotFoundError, FileExistsError, PermissionError):
            raise
        except OSError as e:
            raise TierError(f"object tier {self.url}: {what} failed: {e}; check the endpoint and credentials") from e
        except Exception as e:  # botocore raises its own tree for endpoint/credential trouble
            if type(e).__module__.startswith(("botocore", "aiobotocore", "aiohttp", "boto3", "s3transfer", "urllib3")):
                raise TierError(f"object tier {self.url}: {what} failed: {type(e).__name__}: {e}") from e
            raise

    # ---- listing / manifests ---------------------------------------------
    def _committed_steps(self) -> list[int]:
        self.fs.invalidate_cache(self.root)
        try:
            found = self._call("listing", self.fs.glob, self._p(f"step-*/{MANIFEST}"))
        except FileNotFoundError:
            return []
        steps = {parse_step_dir(p.rstrip("/").split("/")[-2]) for p in found}
        return sorted(s for s in steps if s is not None)

    def _manifest_token(self, step: int) -> object | None:
        # committed manifests are written once (exclusive create) and only deleted by GC: the
        # parsed copy stays valid for this tier object; verify/audit re-read with fresh=True
        return "committed"

    def _manifest_bytes(self, step: int) -> bytes:
        try:
            return self._call("reading a manifest", self.fs.cat_file, self._p(f"{step_dir(step)}/{MANIFEST}"))
        except FileNotFoundError:
            raise StepNotFoundError(f"object tier {self.url}: step {step} is not committed") from None

    # ---- write -------------------------------------------------------------
    def _write(self, snapshot: Snapshot, parent: ParentRef | None, progress: Progress | None = None) -> Manifest:
        if self.cluster is not None:
            from flowcheck.tiers import cluster

            return cluster.write(self, snapshot, parent)
        try:
            if self._exists(f"{step_dir(snapshot.step)}/{MANIFEST}"):
                return self._already_committed(snapshot)
            attempt = attempt_dir(step_dir(snapshot.step))
            m = self._commit_attempt(self.store_files(snapshot, parent, attempt, progress), attempt)
        except TierError as e:
            raise TierError(f"object tier {self.url}: step {snapshot.step} was not committed (no part of it is "
                            f"visible; GC removes its uploaded files): {e}") from e
        try:
            self._publish_latest(snapshot.step)
        except TierError as e:  # the step is committed; "latest" is a hint that the next commit moves on
            log.warning("object tier %s: step %d committed, but updating 'latest' failed: %s", self.url, snapshot.step, e)
        return m

    def identity(self, snapshot: Snapshot, parent: ParentRef | None) -> tuple[dict[Shard, str], Manifest]:
        """(shard digests, the manifest without locations): what the stored files will name as their manifest."""
        digests = self._digests(snapshot)
        return digests, make_manifest(snapshot, node=self.node, parent=parent, digests=digests,
                                      locations={s: () for s in snapshot.data}, files=())

    def store_files(self, snapshot: Snapshot, parent: ParentRef | None, prefix: str,
                    progress: Progress | None = None) -> Manifest:
        """Upload a snapshot's files under ``prefix`` (relative to the run root: a folder of this write
        alone, see ``attempt_dir``); return the (signed, not yet committed) manifest naming them.
        ``progress`` counts the file bytes uploaded (else the tier's own bar, when it was opened with
        ``progress=True``)."""
        digests, identity = self.identity(snapshot, parent)
        plan = self._plan(snapshot)
        staging = os.path.join(self.staging_dir, f"{self.run}-{step_dir(snapshot.step)}-{uuid.uuid4().hex[:8]}")
        try:
            os.makedirs(staging, exist_ok=True)
            files, locations = self._stage_and_upload(snapshot, plan, staging, identity.digest(), prefix, progress)
        except TierError:
            raise
        except OSError as e:  # a full or read-only staging disk
            raise TierError(e.errno, f"object tier {self.url}: step {snapshot.step}: staging its files in {self.staging_dir} "
                            f"failed: {e.strerror or e} (errno {e.errno}); free space there or set tiers.object.staging_dir") from e
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        m = make_manifest(snapshot, node=self.node, parent=parent, digests=digests, locations=locations, files=files)
        m = self._sign(dataclasses.replace(m, created_at=identity.created_at))  # the identity the files name
        if m.digest() != identity.digest():
            raise IntegrityError(f"object tier {self.url}: step {m.step}: manifest identity changed while writing")
        return m

    def _digests(self, snapshot: Snapshot) -> dict[Shard, str]:
        if snapshot.origin is not None:  # promotion: digests travel with the step, checked as shards are read
            o = snapshot.origin
            return {Shard(n, s.offsets, s.shape): s.digest for n, t in o.tensors.items() for s in t.shards}
        return {s: shard_digests(snapshot, {s: snapshot.array(s)})[s] for s in snapshot.data}

    def _plan(self, snapshot: Snapshot) -> list[list[_Planned]]:
        """Pack shards into files of at most max_file_mib, splitting larger shards by rows.

        A step smaller than four full files is cut into about four (of at least
        256 MiB): staging file i+1 then overlaps uploading file i instead of
        preceding all of it (BENCHMARKS.md, P5).
        """
        limit = min(self.config.max_file_mib << 20, max(PIPELINE_MIN_FILE, -(-snapshot.nbytes // 4)))
        files: list[list[_Planned]] = [[]]
        used = 0
        counters: dict[str, int] = {}
        for shard in snapshot.data:
            spec = snapshot.layout.spec(shard.tensor)
            itemsize = dtypes.dtype(spec.dtype).itemsize
            index = counters[shard.tensor] = counters.get(shard.tensor, -1) + 1
            nbytes = math.prod(shard.shape) * itemsize
            if nbytes <= limit or not shard.shape or shard.shape[0] <= 1:
                pieces = [(None, nbytes)]
            else:
                row = nbytes // shard.shape[0]
                per = max(1, limit // row)
                pieces = [((r, min(r + per, shard.shape[0])), (min(r + per, shard.shape[0]) - r) * row)
                          for r in range(0, shard.shape[0], per)]
            for rows, size in pieces:
                if files[-1] and used + size > limit:
                    files.append([])
                    used = 0
                key = f"{shard.tensor}#{index}" + (f"#rows{rows[0]}-{rows[1]}" if rows else "")
                files[-1].append(_Planned(shard, key, rows))
                used += size
        return [f for f in files if f] or [[]]

    def _stage_and_upload(self, snapshot, plan, staging, manifest_id, sd, progress=None):
        """Stage file i+1 while file i uploads; staging holds at most two files at a time."""
        from concurrent.futures import ThreadPoolExecutor

        from tqdm.auto import tqdm

        names = [f"shard-{i:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
        meta = {"run": snapshot.run, "step": str(snapshot.step), "manifest_id": manifest_id, "format": "flowcheck-v1"}

        def stage(i: int) -> tuple[str, int, str, int]:
            local = os.path.join(staging, names[i])
            entries = [self._entry(snapshot, p) for p in plan[i]]
            size, digest = st.write(local, entries, meta)
            return local, size, digest, size - sum(e.nbytes for e in entries)

        files, locations = [], {s: [] for s in snapshot.data}
        if progress is not None:
            progress.total = snapshot.nbytes  # each file's header bytes are added as it is staged
        own = tqdm(total=snapshot.nbytes, unit="B", unit_scale=True, desc=f"upload {sd}",
                   disable=not self.progress or progress is not None)
        with ThreadPoolExecutor(1, "fc-stage") as stager, own, contextlib.nullcontext(own if progress is None else progress) as bar:
            ahead = stager.submit(stage, 0)
            for i, planned in enumerate(plan):
                local, size, digest, header_bytes = ahead.result()
                if i + 1 < len(plan):
                    ahead = stager.submit(stage, i + 1)
                bar.total += header_bytes
                self._upload(local, f"{sd}/{names[i]}", size, bar)
                os.unlink(local)
                files.append(FileEntry(f"{sd}/{names[i]}", size, digest))
                for p in planned:
                    locations[p.shard].append(Piece(f"{sd}/{names[i]}", p.key, p.rows))
        return files, {s: tuple(v) for s, v in locations.items()}

    def _entry(self, snapshot: Snapshot, p: _Planned) -> st.Entry:
        spec = snapshot.layout.spec(p.shard.tensor)
        shape = p.shard.shape if p.rows is None else (p.rows[1] - p.rows[0], *p.shard.shape[1:])

        def data() -> np.ndarray:
            arr = snapshot.array(p.shard)
            return arr if p.rows is None else arr[p.rows[0]:p.rows[1]]

        return st.Entry(p.key, spec.dtype, shape, data)

    def _upload(self, local: str, rel: str, size: int, bar) -> None:
        remote = self._p(rel)
        if self.protocol == "file":
            os.makedirs(os.path.dirname(remote), exist_ok=True)
            shutil.copyfile(local, remote)
            fsync_file(remote)  # the manifest must not be durable before the data it names
            fsync_dir(os.path.dirname(remote))
            fsync_dir(os.path.dirname(os.path.dirname(remote)))  # the attempt folder's entry, beside the manifest
            bar.update(size)
            return
        if self.protocol in ("s3", "s3a") and self._boto3_client() is not None:
            from flowcheck.tiers.s3_upload import upload_file

            # parts no larger than needed to keep every worker busy on this file (S3's minimum is 5 MiB)
            workers = self.config.upload_workers
            part = max(5 << 20, min(self.config.part_mib << 20, -(-size // workers)))
            self._call(f"uploading {rel}", upload_file, self._boto3_client(), local, remote,
                       part_bytes=part, concurrency=workers, progress=bar.update)
            return
        cb = _bar_callback(bar)
        kwargs = {}
        if self.protocol in ("s3", "s3a"):
            kwargs = {"chunksize": self.config.part_mib << 20, "max_concurrency": self.config.upload_workers}
        self._call(f"uploading {rel}", self.fs.put_file, local, remote, callback=cb, **kwargs)
        bar.update(max(0, size - cb.seen))

    def _boto3_client(self):
        """boto3 for S3 uploads when installed (the s3 extra); None falls back to s3fs put_file."""
        if not hasattr(self, "_boto3"):
            try:
                from flowcheck.tiers.s3_upload import s3_client

                opts = self.config.storage_options
                self._boto3 = s3_client(opts.get("endpoint_url") or self._endpoint, self._region, opts,
                                        {**botocore_options(self.config), **opts.get("config_kwargs", {})})
            except ImportError:
                self._boto3 = None
        return self._boto3

    def create_exclusive(self, rel: str, data: bytes, what: str = "committing the manifest") -> None:
        """Create ``rel`` with ``data`` only if it does not exist (FileExistsError if it does): S3
        ``If-None-Match``, a hard link on local disks. Every commit in this tier goes through here."""
        if self.protocol == "file":
            os.makedirs(os.path.dirname(self._p(rel)), exist_ok=True)
            commit_file_exclusive(self._p(rel), data)
        elif self.protocol in ("s3", "s3a"):
            try:  # once: a retried create whose first answer was lost is refused; the caller decides
                self._call_once(what, self.fs.pipe_file, self._p(rel), data, mode="create")
            except TierError as e:
                if getattr(e.__cause__, "errno", None) == errno.EBUSY:  # 409 ConditionalRequestConflict:
                    raise FileExistsError(rel) from e  # a concurrent create of the same key is in flight
                raise
        else:
            # no conditional write known for this backend: check-then-write (not race-free)
            if self._exists(rel):
                raise FileExistsError(rel)
            self._call(what, self.fs.pipe_file, self._p(rel), data)

    def read_bytes(self, rel: str, what: str) -> bytes:
        """A small file under the run root (FileNotFoundError if absent)."""
        return self._call(what, self.fs.cat_file, self._p(rel))

    def _commit_attempt(self, m: Manifest, attempt: str) -> Manifest:
        """Commit the manifest naming one attempt's files; return the committed manifest.

        A writer that loses the race removes its own attempt folder (never the winner's files), then
        raises StepExistsError — or returns the winner's manifest when that holds the identical state."""
        try:
            committed = self._commit_manifest(m)
        except StepExistsError:
            self.discard(attempt)
            raise
        if committed is not m:
            self.discard(attempt)
        return committed

    def discard(self, attempt: str) -> None:
        """Remove a losing attempt's folder; if that fails, GC removes it once it is older than the grace period."""
        try:
            self._call(f"removing {attempt}", self.fs.rm, self._p(attempt), recursive=True)
        except FileNotFoundError:
            pass
        except TierError as e:
            log.warning("object tier %s: could not remove %s, which no manifest names (%s); GC removes it after "
                        "the grace period", self.url, attempt, e)

    def _commit_manifest(self, m: Manifest) -> Manifest:
        """The exclusive create of the manifest, retried; "exists" after a lost answer is checked, not believed.
        Returns ``m``, or the identical state another writer committed first (its own files)."""
        rel = f"{step_dir(m.step)}/{MANIFEST}"

        def attempt() -> Manifest:
            try:
                self.create_exclusive(rel, m.to_bytes())
                return m
            except FileExistsError as e:
                try:
                    existing = parse(self._call_once("reading back the manifest", self.fs.cat_file, self._p(rel)), rel)
                except FileNotFoundError:  # 409: a create still in flight; look again
                    raise TierError(f"object tier {self.url}: {rel}: create refused but no manifest yet") from e
                if existing.digest() != m.digest():
                    raise StepExistsError(
                        f"object tier {self.url}: step {m.step} was committed first by another writer (manifest "
                        f"digest {existing.digest()}, this writer's {m.digest()}); this state was not stored "
                        "and its uploaded files are removed — write it as another step or on a branch") from e
                if existing.files == m.files:
                    # our own create landed with its answer lost (a reset or timeout, then a retry refused)
                    log.info("object tier %s: step %d: the manifest create was answered 'exists'; it is ours",
                             self.url, m.step)
                    return m
                log.info("object tier %s: step %d: another writer committed the identical state first", self.url, m.step)
                return existing

        return self._retry.run(f"object tier {self.url}: step {m.step}: committing the manifest", attempt)

    def _already_committed(self, snapshot: Snapshot) -> Manifest:
        existing = self.manifest(snapshot.step)
        if snapshot.origin is not None and snapshot.origin.digest() == existing.digest():
            return existing
        raise StepExistsError(f"object tier {self.url}: step {snapshot.step} is already committed with different content")

    def _exists(self, rel: str) -> bool:
        self.fs.invalidate_cache(self._p(rel).rsplit("/", 1)[0])
        return bool(self._call("checking " + rel, self.fs.exists, self._p(rel)))

    # ---- read --------------------------------------------------------------
    def header(self, rel: str) -> st.Header:
        """The parsed safetensors header of a stored file (two small range reads, cached)."""
        if rel in self._headers:
            self._headers.move_to_end(rel)
            return self._headers[rel]
        path = self._p(rel)
        size = self._call(f"stat {rel}", self.fs.size, path)
        h = st.parse_header(lambda a, b: self._call(f"reading {rel}", self.fs.cat_file, path, start=a, end=b), size, f"{self.url}/{rel}")
        self._headers[rel] = h
        while len(self._headers) > 256:
            self._headers.popitem(last=False)
        return h

    def _piece_info(self, manifest: Manifest, tensor: str, shard: ShardEntry, piece: Piece):
        """(header entry, row range) of one stored piece, checked against the manifest."""
        dt = dtypes.dtype(manifest.tensors[tensor].dtype)
        rows = piece.rows or ((0, shard.shape[0]) if shard.shape else (0, 1))
        info = self.header(piece.path).tensors.get(piece.key or "")
        want_shape = shard.shape if piece.rows is None else (rows[1] - rows[0], *shard.shape[1:])
        if info is None or info.dtype != dt.name or info.shape != tuple(want_shape):
            raise FormatError(
                f"{self.url}/{piece.path}: tensor {piece.key!r}: expected {dt.name}{list(want_shape)}, "
                f"found {'nothing' if info is None else f'{info.dtype}{list(info.shape)}'}"
            )
        return info, rows

    def read_shard(self, manifest: Manifest, tensor: str, entry: ShardEntry, *, verify: bool = True) -> np.ndarray:
        # a body cut short or garbled in transit fails its length or digest check: read it again
        return self._retry.run(f"object tier {self.url}: step {manifest.step}: reading {tensor} {list(entry.offsets)}",
                               lambda: super(ObjectTier, self).read_shard(manifest, tensor, entry, verify=verify),
                               retry_on=(TierError, IntegrityError))

    def _read_shard(self, manifest: Manifest, tensor: str, shard: ShardEntry, region) -> np.ndarray:
        return self._retry.run(f"object tier {self.url}: step {manifest.step}: reading {tensor} {list(shard.offsets)}",
                               lambda: self._read_shard_once(manifest, tensor, shard, region),
                               retry_on=(TierError, IntegrityError))

    def _read_shard_once(self, manifest: Manifest, tensor: str, shard: ShardEntry, region) -> np.ndarray:
        if all(r.start == 0 and r.stop == n for r, n in zip(region, shard.shape)):
            return self._whole_shard(manifest, tensor, shard)
        dt = dtypes.dtype(manifest.tensors[tensor].dtype)
        out = np.empty(tuple(s.stop - s.start for s in region), dtype=dt.storage)
        for piece in shard.location:
            info, rows = self._piece_info(manifest, tensor, shard, piece)
            self._read_piece(piece, info, rows, region, shard.shape, out, dt)
        return out

    def _whole_shard(self, manifest: Manifest, tensor: str, shard: ShardEntry) -> np.ndarray:
        """A whole shard, from a read-ahead window: this shard and the next ones of the manifest
        (up to READ_AHEAD bytes) are fetched together, so reading a step shard after shard costs a
        few large concurrent requests instead of one round trip per shard."""
        key = (manifest.step, manifest.created_at, tensor, shard.offsets)
        with self._window_lock:
            hit = self._window.pop(key, None)
        if hit is not None:
            return hit
        order = [(n, e) for n, t in manifest.tensors.items() for e in t.shards]
        first = next(i for i, (n, e) in enumerate(order) if n == tensor and e.offsets == shard.offsets)
        # read ahead only when the reader goes through the step in manifest order (like OS readahead):
        # a reader in another order would otherwise fetch a window per shard and use one entry of it
        sequential = key == self._expected
        batch, total = [], 0
        for n, e in order[first:] if sequential else order[first:first + 1]:
            size = math.prod(e.shape) * dtypes.dtype(manifest.tensors[n].dtype).itemsize
            if batch and total + size > READ_AHEAD:
                break
            batch.append((n, e))
            total += size
        arrays = self._fetch_whole(manifest, batch)
        nxt = first + len(batch)
        with self._window_lock:
            self._window = {(manifest.step, manifest.created_at, n, e.offsets): a for (n, e), a in zip(batch[1:], arrays[1:])}
            self._expected = (manifest.step, manifest.created_at, order[nxt][0], order[nxt][1].offsets) if nxt < len(order) else None
        return arrays[0]

    def _fetch_whole(self, manifest: Manifest, batch) -> list[np.ndarray]:
        wants, places, outs = [], [], []
        for name, entry in batch:
            out = np.empty(entry.shape, dtype=dtypes.dtype(manifest.tensors[name].dtype).storage)
            outs.append(out)
            flat = out.reshape(-1).view(np.uint8)
            for piece in entry.location:
                info, rows = self._piece_info(manifest, name, entry, piece)
                row_bytes = (info.end - info.begin) // max(1, rows[1] - rows[0])
                start = self.header(piece.path).data_start + info.begin
                wants.append(range_reads.Want(self._p(piece.path), start, start + info.end - info.begin))
                places.append((flat, rows[0] * row_bytes))
        blobs = self._call("reading shards", range_reads.fetch, self.fs, wants)
        for (flat, offset), blob in zip(places, blobs):
            flat[offset:offset + len(blob)] = np.frombuffer(blob, np.uint8)
        return outs

    def _read_piece(self, piece, info, rows, region, shape, out, dt) -> None:
        lo = region[0].start if region else 0
        hi = region[0].stop if region else 1
        r0, r1 = max(lo, rows[0]), min(hi, rows[1])
        row_bytes = (info.end - info.begin) // max(1, rows[1] - rows[0])
        if (r0 >= r1 and shape) or row_bytes == 0:
            return  # nothing to fetch (an empty range is refused by S3)
        start = self.header(piece.path).data_start + info.begin + (r0 - rows[0]) * row_bytes
        raw = self._call(f"reading {piece.path}", self.fs.cat_file, self._p(piece.path),
                         start=start, end=start + (r1 - r0) * row_bytes)
        if len(raw) != (r1 - r0) * row_bytes:
            raise IntegrityError(f"{self.url}/{piece.path}: short read ({len(raw)} of {(r1 - r0) * row_bytes} bytes); file truncated?")
        if not shape:
            out[...] = np.frombuffer(raw, dt.storage).reshape(())
            return
        block = np.frombuffer(raw, dt.storage).reshape((r1 - r0, *shape[1:]))
        out[(slice(r0 - lo, r1 - lo),)] = block[(slice(None), *region[1:])]

    # ---- delete / verify / clean -------------------------------------------
    def _delete(self, step: int) -> None:
        sd = step_dir(step)
        self._call("deleting a manifest", self.fs.rm, self._p(f"{sd}/{MANIFEST}"))  # the step stops existing first
        # the whole prefix: the committed attempt's files, and any a losing writer left
        self._call("deleting step data", self.fs.rm, self._p(sd), recursive=True)
        self._headers.clear()

    def _verify_files(self, manifest: Manifest, on_bytes: Callable[[int], None] = lambda n: None) -> list[Problem]:
        from flowcheck.tiers import cluster

        problems = cluster.verify_parts(self, manifest) if manifest.nodes else []
        for f in manifest.files:
            on_bytes(f.bytes)
            what = self._check_file(manifest, f, cluster.expected_manifest_id(manifest, f.path))
            if what:
                node = cluster.node_of(f.path) if manifest.nodes else None
                # a multi-node step names the node whose file is damaged
                problems.append(Problem(self.name, manifest.step, f"node {node}: {what}" if node else what, f.path))
        return problems + self._stray_problems(manifest)

    def _stray_problems(self, manifest: Manifest) -> list[Problem]:
        """What under a committed step its manifest does not name. Another writer's attempt folder is its
        upload in progress (a warning) until untouched for the grace period, then abandoned (an error);
        a stray file outside any attempt (a killed commit's manifest temporary) is never data: a warning."""
        now, problems = time.time(), []
        for rel, newest in sorted(self._strays(manifest, self._files(step_dir(manifest.step))).items()):
            age = now - newest
            if rel.rsplit("/", 1)[-1].startswith(ATTEMPT) and age >= self.grace_s:
                problems.append(Problem(self.name, manifest.step, f"another writer's files, not named by the manifest "
                                        f"and untouched for {age:.0f}s (grace {self.grace_s:g}s): an abandoned write; "
                                        "run `flowcheck gc`", rel))
            else:
                problems.append(Problem(self.name, manifest.step, "not named by the manifest: another writer's upload "
                                        "in progress, or its leftovers (GC removes them after the grace period)",
                                        rel, "warning"))
        return problems

    def _strays(self, manifest: Manifest, files: dict[str, float]) -> dict[str, float]:
        """What under a committed step its manifest does not name -> newest mtime: whole attempt folders
        of other writers, else single files (manifest temporaries, files of an older layout)."""
        sd = step_dir(manifest.step)
        named = {f.path for f in manifest.files} | {f"{sd}/{MANIFEST}"}
        if manifest.nodes:
            from flowcheck.tiers.cluster import part_manifest

            named |= {part_manifest(manifest.step, n.node) for n in manifest.nodes}
        used = {attempt_of(p) for p in named}
        out: dict[str, float] = {}
        for rel, mtime in files.items():
            if rel not in named:
                folder = attempt_of(rel)
                unit = folder if folder is not None and folder not in used else rel
                out[unit] = max(out.get(unit, 0.0), mtime)
        return out

    def _files(self, rel: str) -> dict[str, float]:
        """Every file under ``rel`` (relative to the run root) -> its modification time (one listing)."""
        path = self._p(rel)
        self.fs.invalidate_cache(path)
        try:
            found = self._call("listing", self.fs.find, path, detail=True)
        except FileNotFoundError:
            return {}
        return {p[len(self.root) + 1:]: _mtime(info) for p, info in found.items()
                if p.startswith(self.root + "/") and info.get("type") != "directory"}

    def _check_file(self, manifest: Manifest, f: FileEntry, manifest_id: str) -> str | None:
        """What is wrong with one stored file (size, digest, safetensors header, the manifest it names), or None.

        A mismatch is read again before it is believed: a body cut short in transit looks the same."""
        try:
            return self._retry.run(f"object tier {self.url}: checking {f.path}",
                                   lambda: self._check_file_once(manifest, f, manifest_id),
                                   retry_on=(TierError, IntegrityError))
        except IntegrityError as e:
            return str(e)
        except TierError as e:
            return f"cannot be read: {e}"

    def _check_file_once(self, manifest: Manifest, f: FileEntry, manifest_id: str) -> str | None:
        path = self._p(f.path)
        self.fs.invalidate_cache(path)
        try:
            size = self._call(f"stat {f.path}", self.fs.size, path)
        except FileNotFoundError:
            return "file listed in the manifest is missing"
        if size != f.bytes:
            raise IntegrityError(f"size {size} != manifest {f.bytes}")
        digest = self._call_once(f"reading {f.path}", self._stream_digest, path)
        if digest != f.digest:
            raise IntegrityError(f"digest {digest} != manifest {f.digest}")
        try:
            meta = self.header(f.path).metadata
        except FormatError as e:
            return str(e)
        if meta.get("manifest_id") != manifest_id or meta.get("step") != str(manifest.step):
            return "safetensors __metadata__ names another step/manifest"
        return None

    def _stream_digest(self, path: str) -> str:
        from flowcheck.digest import DataHasher

        h = DataHasher()
        with self.fs.open(path, "rb", block_size=16 << 20) as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
        return h.hexdigest()

    def clean_incomplete(self, older_than_s: float, dry_run: bool = False) -> list[str]:
        """Delete step prefixes that never got a manifest, abort stale multipart uploads, and remove
        staging folders a killed upload left behind (each may hold two whole files)."""
        removed = self._clean_staging(time.time() - older_than_s, dry_run)
        cutoff = self._store_now(dry_run) - older_than_s  # the store stamps the times compared with it
        self.fs.invalidate_cache(self.root)
        try:
            entries = self._call("listing", self.fs.ls, self.root, detail=False)
        except FileNotFoundError:
            entries = []
        for path in entries:
            name = path.rstrip("/").split("/")[-1]
            step = parse_step_dir(name)
            if step is None:
                continue
            files = self._files(name)
            if f"{name}/{MANIFEST}" in files:
                removed += self._clean_strays(step, files, cutoff, dry_run)
            elif max(files.values(), default=0.0) < cutoff:
                removed.append(path)
                if not dry_run:
                    self._call("deleting an abandoned step", self.fs.rm, path, recursive=True)
        if self.protocol in ("s3", "s3a"):
            removed += self._abort_multipart(cutoff, dry_run)
        return removed

    def _store_now(self, dry_run: bool) -> float:
        """Now, never later than the store's clock: the earlier of this host's time and the time the store stamps
        on an object written now (+1 s: S3 keeps whole seconds). Hosts sharing a store need not agree on the
        time; one running ahead must not judge another writer's fresh upload abandoned."""
        if dry_run:
            return time.time()
        probe = self._p(".clock")
        try:
            # one attempt each, no retries: if the store does not answer, this host's clock will do
            self._call_once("probing the store's clock", self.fs.pipe_file, probe, b"")
            self.fs.invalidate_cache(self.root)
            return min(time.time(), _mtime(self._call_once("probing the store's clock", self.fs.info, probe)) + 1.0)
        except (OSError, FlowcheckError, ValueError, TypeError) as e:
            log.info("object tier %s: cannot probe the store's clock (%s); using this host's", self.url, e)
            return time.time()

    def _clean_staging(self, cutoff: float, dry_run: bool) -> list[str]:
        try:
            names = os.listdir(self.staging_dir)
        except FileNotFoundError:
            return []
        stale = []
        for n in names:  # <run>-step-<step:09d>-<8 hex>, see store_files
            path = os.path.join(self.staging_dir, n)
            try:
                ours = n.startswith(f"{self.run}-") and parse_step_dir(n[len(self.run) + 1:-9]) is not None
                if ours and os.path.getmtime(path) < cutoff:
                    stale.append(path)
            except FileNotFoundError:  # an upload finished meanwhile
                continue
        for path in stale if not dry_run else ():
            shutil.rmtree(path, ignore_errors=True)
        return stale

    def _clean_strays(self, step: int, files: dict[str, float], cutoff: float, dry_run: bool) -> list[str]:
        """Remove what a committed step's manifest does not name and nobody touched since ``cutoff``:
        the attempt folders of writers that lost the commit and died before removing them."""
        try:
            m = self.manifest(step, check_signature=False)
        except FlowcheckError as e:  # never delete what cannot be classified
            log.warning("object tier %s: step %d: manifest unreadable (%s); its folder is left as it is",
                        self.url, step, e)
            return []
        stale = sorted(rel for rel, newest in self._strays(m, files).items() if newest < cutoff)
        for rel in stale if not dry_run else ():
            try:
                self._call("deleting an abandoned attempt", self.fs.rm, self._p(rel), recursive=True)
            except FileNotFoundError:  # its writer removed it meanwhile
                pass
        return [self._p(rel) for rel in stale]

    def _abort_multipart(self, cutoff: float, dry_run: bool) -> list[str]:
        bucket, _, prefix = self.root.partition("/")
        resp = self._call("listing multipart uploads", self.fs.call_s3, "list_multipart_uploads",
                          Bucket=bucket, Prefix=prefix + "/")
        aborted = []
        for up in resp.get("Uploads", []):
            started = up["Initiated"]
            if started.replace(tzinfo=started.tzinfo or timezone.utc).timestamp() < cutoff:
                aborted.append(f"multipart:{bucket}/{up['Key']}")
                if not dry_run:
                    try:
                        self._call("aborting a multipart upload", self.fs.call_s3, "abort_multipart_upload",
                                   Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
                    except FileNotFoundError:  # NoSuchUpload: completed or aborted meanwhile
                        aborted.pop()
        return aborted

    def incomplete(self) -> list[str]:
        try:
            entries = self._call("listing", self.fs.ls, self.root, detail=False)
        except FileNotFoundError:
            return []
        names = [p.rstrip("/").split("/")[-1] for p in entries]
        return sorted(n for n in names if parse_step_dir(n) is not None and not self._exists(f"{n}/{MANIFEST}"))

    # ---- records -------------------------------------------------------------
    def _put_record(self, name: str, data: bytes) -> None:
        if self.protocol == "file":
            os.makedirs(os.path.dirname(self._p(name)), exist_ok=True)
            replace_file(self._p(name), data)
        else:
            self._call(f"writing {name}", self.fs.pipe_file, self._p(name), data)

    def _get_record(self, name: str) -> bytes | None:
        try:
            return self._call(f"reading {name}", self.fs.cat_file, self._p(name))
        except FileNotFoundError:
            return None

    def _list_records(self, prefix: str) -> list[str]:
        self.fs.invalidate_cache(self._p(prefix))
        try:
            return sorted(p.rstrip("/").split("/")[-1] for p in self._call("listing", self.fs.ls, self._p(prefix), detail=False))
        except FileNotFoundError:
            return []


def _mtime(info: dict) -> float:
    """A listing entry's modification time (S3 ``LastModified``, a local file's ``mtime``), in seconds."""
    t = info.get("LastModified") or info.get("mtime") or info.get("created")
    if isinstance(t, datetime):
        t = t.timestamp()
    return float(t or 0)


def _bar_callback(bar):
    """An fsspec callback feeding one shared tqdm bar (parts of many files count toward one total)."""
    from fsspec.callbacks import Callback

    class _Bar(Callback):
        seen = 0

        def call(self, *args, **kwargs) -> None:
            if self.value > self.seen:
                bar.update(self.value - self.seen)
                self.seen = self.value

    return _Bar()


__all__ = ["ObjectTier", "filesystem"]
