"""The object tier's write path: plan files, upload each (on S3 streamed from memory, elsewhere staged locally
first), commit the manifest last.

Each write uploads into its own attempt folder (``step-…/attempt-<12 hex>/``), so two writers of one step
never overwrite each other's files: the manifest's exclusive create picks the winner, whose manifest names its
folder, and the loser removes its own folder (GC removes one a killed loser left, after the grace period).
Staging (no S3) holds at most two files at a time, in a folder of this write alone that is removed whatever happens
(and the staging root too when it is flowcheck's own default, ``<local root>/.staging``, and nothing else uses
it; a configured ``tiers.object.staging_dir`` is the user's folder and stays).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import uuid
from dataclasses import dataclass

import numpy as np

from flowcheck import dtypes
from flowcheck.digest import DataHasher
from flowcheck.errors import IntegrityError, StepExistsError, TierError
from flowcheck.manifest import INCREMENTAL_VERSION, FileEntry, Manifest, ParentRef, Piece, parse
from flowcheck.progress import Progress
from flowcheck.state import Shard, Snapshot
from flowcheck.tiers import object_refs
from flowcheck.tiers import safetensors_io as st
from flowcheck.tiers.base import MANIFEST, make_manifest, shard_digests, step_dir

log = logging.getLogger(__name__)

ATTEMPT = "attempt-"
PIPELINE_MIN_FILE = 256 << 20
UPLOADS_IN_FLIGHT = 2  # files of one write uploading at once (the next is staged meanwhile)


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


@dataclass(frozen=True)
class _Planned:
    """A piece of a shard placed in a planned file."""

    shard: Shard
    key: str
    rows: tuple[int, int] | None


class ObjectWriter:
    """The write half of ObjectTier (a mixin: it uses the tier's ``call``, ``backend`` and paths)."""

    def _write(self, snapshot: Snapshot, parent: ParentRef | None, progress: Progress | None = None) -> Manifest:
        if self.cluster is not None:
            return self.commit_cluster_step(snapshot, parent)
        try:
            if self._exists(f"{step_dir(snapshot.step)}/{MANIFEST}"):
                return self._already_committed(snapshot, f"object tier {self.url}: step {snapshot.step}")
            attempt = attempt_dir(step_dir(snapshot.step))
            m = self._commit_attempt(self.store_files(snapshot, parent, attempt, progress, incremental=True),
                                     attempt)
        except TierError as e:  # the same kind (TierMissingError, TierAccessError), saying what it left
            raise type(e)(f"object tier {self.url}: step {snapshot.step} was not committed (no part of it is "
                          f"visible; GC removes its uploaded files): {e}") from e
        try:
            self.publish_latest(snapshot.step)
        except TierError as e:  # the step is committed; "latest" is a hint that the next commit moves on
            log.warning("object tier %s: step %d committed, but updating 'latest' failed: %s", self.url, snapshot.step, e)
        return m

    def identity(self, snapshot: Snapshot, parent: ParentRef | None) -> tuple[dict[Shard, str], Manifest]:
        """(shard digests, the manifest without locations): what the stored files will name as their manifest."""
        digests = self._digests(snapshot)
        return digests, make_manifest(snapshot, node=self.node, parent=parent, digests=digests,
                                      locations={s: () for s in snapshot.data}, files=())

    def store_files(self, snapshot: Snapshot, parent: ParentRef | None, prefix: str,
                    progress: Progress | None = None, *, incremental: bool = False) -> Manifest:
        """Upload a snapshot's files under ``prefix`` (relative to the run root: a folder of this write
        alone, see ``attempt_dir``); return the (signed, not yet committed) manifest naming them.
        ``progress`` counts the file bytes uploaded (else the tier's own bar, when it was opened with
        ``progress=True``).  ``incremental``: the shards the parent's committed copy in this tier holds with the
        same digest are not uploaded; the manifest references them (v4, tiers/object_refs.py)."""
        digests, identity = self.identity(snapshot, parent)
        skip, refs = object_refs.reusable(self, snapshot, parent, digests) if incremental else ({}, ())
        todo = [s for s in snapshot.data if s not in skip]
        with self.backend.streams() as streams:
            plan = self._plan(snapshot, todo, staged=streams is None) if todo or not skip else []
            if streams is not None:  # S3: parts sent as they are filled, no staging file
                files, locations = self._upload_files(snapshot, plan, identity.digest(), prefix, progress,
                                                      streams=streams)
            else:
                files, locations = self._staged(snapshot, plan, identity.digest(), prefix, progress)
        locations.update(skip)
        m = make_manifest(snapshot, node=self.node, parent=parent, digests=digests, locations=locations, files=files)
        if refs:
            m = dataclasses.replace(m, format_version=INCREMENTAL_VERSION, refs=refs)
        m = self.sign(dataclasses.replace(m, created_at=identity.created_at))  # the identity the files name
        if m.digest() != identity.digest():
            raise IntegrityError(f"object tier {self.url}: step {m.step}: manifest identity changed while writing")
        return m

    def _digests(self, snapshot: Snapshot) -> dict[Shard, str]:
        if snapshot.origin is not None:  # promotion: digests travel with the step, checked as shards are read
            o = snapshot.origin
            return {Shard(n, s.offsets, s.shape): s.digest for n, t in o.tensors.items() for s in t.shards}
        return {s: shard_digests(snapshot, {s: snapshot.array(s)})[s] for s in snapshot.data}

    def _plan(self, snapshot: Snapshot, shards: list[Shard], *, staged: bool) -> list[list[_Planned]]:
        """Pack shards into files of at most max_file_mib, splitting larger shards by rows.

        A ``staged`` step smaller than four full files is cut into about four (of at least 256 MiB): staging file
        i+1 then overlaps uploading file i instead of preceding all of it (BENCHMARKS.md, "P5 — promotion to
        object storage"); a streamed one needs no such cut (its parts go out as they are filled).
        """
        limit = self.config.max_file_mib << 20
        if staged:
            limit = min(limit, max(PIPELINE_MIN_FILE, -(-_nbytes(snapshot, shards) // 4)))
        files: list[list[_Planned]] = [[]]
        used = 0
        counters: dict[str, int] = {}
        wanted = set(shards)
        for shard in snapshot.data:
            index = counters[shard.tensor] = counters.get(shard.tensor, -1) + 1  # keys number every shard of a tensor
            if shard not in wanted:
                continue
            spec = snapshot.layout.spec(shard.tensor)
            itemsize = dtypes.dtype(spec.dtype).itemsize
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

    def _staged(self, snapshot: Snapshot, plan, manifest_id: str, prefix: str, progress):
        """``_upload_files`` through a staging folder of this write alone, removed whatever happens."""
        staging = os.path.join(self.staging_dir, f"{self.run}-{step_dir(snapshot.step)}-{uuid.uuid4().hex[:8]}")
        try:
            _make_staging(staging)
            return self._upload_files(snapshot, plan, manifest_id, prefix, progress, staging=staging)
        except TierError:
            raise
        except OSError as e:  # a full or read-only staging disk
            raise TierError(e.errno, f"object tier {self.url}: step {snapshot.step}: staging its files in {self.staging_dir} "
                            f"failed: {e.strerror or e} (errno {e.errno}); free space there or set tiers.object.staging_dir") from e
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            if self.own_staging:  # flowcheck's own staging root is not left behind empty (a failed write included)
                with contextlib.suppress(OSError):  # not empty: another write is using it
                    os.rmdir(self.staging_dir)

    def _upload_files(self, snapshot, plan, manifest_id, sd, progress=None, *, staging=None, streams=None):
        """Upload the planned files: streamed (``streams``, see ``s3_upload.PartStreams``) or staged in ``staging``
        (file i+1 staged while files i-1 and i upload); returns (file entries, each shard's pieces)."""
        from tqdm.auto import tqdm

        names = [f"shard-{i:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
        meta = {"run": snapshot.run, "step": str(snapshot.step), "manifest_id": manifest_id, "format": "flowcheck-v1"}
        files, locations = [], {p.shard: [] for planned in plan for p in planned}

        def entries(i: int) -> list[st.Entry]:
            return [self._entry(snapshot, p) for p in plan[i]]

        def record(i: int, size: int, digest: str) -> None:
            files.append(FileEntry(f"{sd}/{names[i]}", size, digest))
            for p in plan[i]:
                locations[p.shard].append(Piece(f"{sd}/{names[i]}", p.key, p.rows))

        total = _nbytes(snapshot, list(locations))
        if progress is not None:
            progress.total = total  # each file's header bytes are added as it is staged
        own = tqdm(total=total, unit="B", unit_scale=True, desc=f"upload {sd}",
                   disable=not self.progress or progress is not None)
        with own, contextlib.nullcontext(own if progress is None else progress) as bar:
            if streams is not None:
                self._stream_files(streams, [f"{sd}/{n}" for n in names], meta, entries, record, bar)
            else:
                self._stage_files(staging, [f"{sd}/{n}" for n in names], meta, entries, record, bar)
        return files, {s: tuple(v) for s, v in locations.items()}

    def _stream_files(self, streams, rels: list[str], meta: dict, entries, record, bar) -> None:
        """Each file's bytes produced on this thread (header, then the tensors as the snapshot reads them, hashed
        on the way) and sent as parts while the next are produced; UPLOADS_IN_FLIGHT files are waited for in order.
        A file whose upload failed is sent again, whole, under the tier's retries (its bytes read again: the
        local tier checks every shard's digest as it reads)."""
        from collections import deque

        from flowcheck.tiers.s3_upload import Skipped

        in_flight: deque = deque()

        def produce(i: int, files: list[st.Entry], head: bytes, size: int):
            hasher = DataHasher()
            return streams.send(self._p(rels[i]), size, _hashed(st.pieces(rels[i], head, files), hasher),
                                bar.update), hasher

        def settle(i: int, files: list[st.Entry], head: bytes, size: int, first, digest: str) -> None:
            tries = iter([first])
            sent_digest = [digest]  # the digest of the bytes of the attempt that succeeded

            def attempt() -> None:
                sent = next(tries, None)
                if sent is not None:
                    try:
                        return sent.result()
                    except Skipped:  # not a failure of its own: sent now, the failure before it dealt with
                        pass
                streams.failed.clear()
                sent, hasher = produce(i, files, head, size)
                sent_digest[0] = hasher.hexdigest()
                sent.result()

            self.call(f"uploading {rels[i]}", attempt)
            record(i, size, sent_digest[0])

        for i in range(len(rels)):
            files = entries(i)
            head = st.encode_header(files, meta)
            size = len(head) + sum(e.nbytes for e in files)
            bar.total += len(head)
            sent, hasher = produce(i, files, head, size)
            in_flight.append((i, files, head, size, sent, hasher.hexdigest()))
            while in_flight and (len(in_flight) > UPLOADS_IN_FLIGHT or streams.failed.is_set()):
                settle(*in_flight.popleft())  # a failure: dealt with before more is sent
        while in_flight:
            settle(*in_flight.popleft())

    def _stage_files(self, staging: str, rels: list[str], meta: dict, entries, record, bar) -> None:
        """Stage file i+1 while files i-1 and i upload (through the backend's ``uploads``: on S3 without boto3, one
        file after another); staging holds at most two files at a time, three while the next is staged."""
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        def stage(i: int) -> tuple[str, int, str, int]:
            local = os.path.join(staging, os.path.basename(rels[i]))
            files = entries(i)
            size, digest = st.write(local, files, meta)
            return local, size, digest, size - sum(e.nbytes for e in files)

        def settle(i: int, local: str, size: int, digest: str, uploading) -> None:
            uploading.result()
            os.unlink(local)
            record(i, size, digest)

        with ThreadPoolExecutor(1, "fc-stage") as stager, self.backend.uploads() as up:
            ahead = stager.submit(stage, 0) if rels else None
            in_flight: deque = deque()
            for i in range(len(rels)):
                local, size, digest, header_bytes = ahead.result()
                bar.total += header_bytes
                in_flight.append((i, local, size, digest,
                                  up.submit(local, self._p(rels[i]), size, bar, f"uploading {rels[i]}")))
                if len(in_flight) == UPLOADS_IN_FLIGHT:
                    settle(*in_flight.popleft())
                if i + 1 < len(rels):
                    ahead = stager.submit(stage, i + 1)
            while in_flight:
                settle(*in_flight.popleft())

    def _entry(self, snapshot: Snapshot, p: _Planned) -> st.Entry:
        spec = snapshot.layout.spec(p.shard.tensor)
        shape = p.shard.shape if p.rows is None else (p.rows[1] - p.rows[0], *p.shard.shape[1:])

        def data() -> np.ndarray:
            arr = snapshot.array(p.shard)
            return arr if p.rows is None else arr[p.rows[0]:p.rows[1]]

        return st.Entry(p.key, spec.dtype, shape, data)

    def boto3_client(self):
        """boto3 for S3 uploads when installed (the s3 extra); None falls back to s3fs put_file."""
        if not hasattr(self, "_boto3"):
            try:
                from flowcheck.tiers.object_backend import botocore_options
                from flowcheck.tiers.s3_upload import s3_client

                opts = self.config.storage_options
                self._boto3 = s3_client(opts.get("endpoint_url") or self.endpoint, self._region, opts,
                                        {**botocore_options(self.config), **opts.get("config_kwargs", {})})
            except ImportError:
                self._boto3 = None
        return self._boto3

    def create_exclusive(self, rel: str, data: bytes, what: str = "committing the manifest") -> None:
        """Create ``rel`` with ``data`` only if it does not exist (FileExistsError if it does): S3
        ``If-None-Match``, a hard link on local disks. Every commit in this tier goes through here."""
        self.backend.create_exclusive(self._p(rel), data, what)

    def read_bytes(self, rel: str, what: str) -> bytes:
        """A small file under the run root (FileNotFoundError if absent)."""
        return self.call(what, self.fs.cat_file, self._p(rel))

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
            self.remove_tree(attempt, f"removing {attempt}")
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
                    existing = parse(self.call_once("reading back the manifest", self.fs.cat_file, self._p(rel)), rel)
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


def _hashed(chunks, hasher):
    """``chunks``, each hashed as it passes."""
    for chunk in chunks:
        hasher.update(chunk)
        yield chunk


def _nbytes(snapshot: Snapshot, shards: list[Shard]) -> int:
    return sum(math.prod(s.shape) * dtypes.dtype(snapshot.layout.spec(s.tensor).dtype).itemsize for s in shards)


def _make_staging(path: str) -> None:
    """Create a write's staging folder; a concurrent write removing the (then empty) staging root between
    the two mkdirs makes the second fail once: try again."""
    for attempt in range(3):
        try:
            os.makedirs(path, exist_ok=True)
            return
        except FileNotFoundError:
            if attempt == 2:
                raise
