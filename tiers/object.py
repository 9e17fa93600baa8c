"""The object tier: safetensors files + manifest.json under any fsspec URL (s3://, file://, ...).

Layout: ``<url>/<run>/step-<step:09d>/attempt-<12 hex>/shard-00000-of-000NN.safetensors``
(files cut at ``max_file_mib``; a larger shard is split by rows) and ``step-…/manifest.json``.
Files are staged locally and uploaded with parallel multipart (``put_file``);
the manifest is committed last with an exclusive create (S3 ``If-None-Match``,
a hard link on local disks), so a step without a manifest does not exist.
Reads fetch the header, then only the byte ranges of the rows asked for.

This module holds the tier's own state, calls and listings; the write path is in object_write.py, the read
path in object_read.py, verification and cleanup in object_verify.py, and what differs between stores
(file://, S3, other fsspec URLs) in object_backend.py, chosen once when the tier opens.
"""
from __future__ import annotations

import logging

from flowcheck.config import ClusterConfig, ObjectConfig, TierPolicy
from flowcheck.errors import FlowcheckError, StepNotFoundError, TierError
from flowcheck.tiers import object_refs
from flowcheck.tiers.base import MANIFEST, Tier, parse_step_dir, step_dir
from flowcheck.tiers.object_cluster import ObjectCluster
from flowcheck.tiers.object_backend import aws_endpoint_region, backend_for, botocore_options, filesystem
from flowcheck.tiers.object_read import READ_AHEAD, ObjectReader
from flowcheck.tiers.object_verify import ObjectChecks
from flowcheck.tiers.object_write import ATTEMPT, ObjectWriter, attempt_dir, attempt_of
from flowcheck.tiers.retry import RetryPolicy, access_problem, server_error_hint

log = logging.getLogger(__name__)

_NETWORK_MODULES = ("botocore", "aiobotocore", "aiohttp", "boto3", "s3transfer", "urllib3")


class ObjectTier(ObjectCluster, ObjectWriter, ObjectReader, ObjectChecks, Tier):
    name = "object"

    def __init__(self, config: ObjectConfig, run: str, *, staging_dir: str, progress: bool = False,
                 cluster: ClusterConfig | None = None, grace_s: float = TierPolicy.tmp_grace_seconds,
                 own_staging: bool = False, **kw) -> None:
        """``own_staging``: ``staging_dir`` is flowcheck's own (the default ``<local root>/.staging``), removed
        when a write leaves it empty; a configured one is the user's and stays."""
        super().__init__(run, **kw)
        self.config = config
        self.own_staging = own_staging
        # a file no manifest names may be a concurrent writer's upload in progress for this long;
        # verify flags it as an error only once it is older (GC passes its own grace to clean_incomplete)
        self.grace_s = grace_s
        self.cluster = cluster if cluster is not None and cluster.nodes else None  # several nodes write each step
        self.fs, self.base = filesystem(config)
        self.endpoint, self._region = aws_endpoint_region(config)
        self.root = f"{self.base}/{self.rel}"
        self.staging_dir = staging_dir
        self.progress = progress
        self.backend = backend_for(self)
        self.protocol = self.backend.protocol
        self._init_reads()
        # local disks do not heal by trying again; a network store's transient faults do
        self._first_contact = RetryPolicy(self.backend.retries, config.retry_deadline_s)
        self._reconnecting = RetryPolicy(self.backend.retries, config.retry_deadline_s,
                                         reconnect_s=config.reconnect_s if self.backend.retries else 0.0)
        self._reached = False  # the endpoint answered a call: a refused connection now is an outage, not a typo

    @property
    def _retry(self) -> RetryPolicy:
        return self._reconnecting if self._reached else self._first_contact

    def at_branch(self, branch: str) -> ObjectTier:
        return ObjectTier(self.config, self.run, staging_dir=self.staging_dir, progress=self.progress,
                          cluster=self.cluster, grace_s=self.grace_s, own_staging=self.own_staging, branch=branch,
                          **self._same_kw())

    @property
    def url(self) -> str:
        return self.config.url.rstrip("/") + "/" + self.rel

    def _p(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def call(self, what: str, fn, *args, **kwargs):
        """Run one idempotent fsspec call, retried on transient failures (tiers/retry.py)."""
        return self._retry.run(f"object tier {self.url}: {what}", lambda: self.call_once(what, fn, *args, **kwargs))

    def call_once(self, what: str, fn, *args, **kwargs):
        """Run one fsspec call, turning transport failures into a TierError that names the URL, and what no
        retry can fix (no credentials, access denied, no such bucket) into TierAccessError / TierMissingError."""
        try:
            out = fn(*args, **kwargs)
            self._reached = True
            return out
        except FlowcheckError:
            raise  # already said (a nested call's TierAccessError is a PermissionError too)
        except FileNotFoundError as e:
            if access_problem(e) == "no-bucket":
                raise self.backend.missing_error(e) from e
            raise
        except PermissionError as e:
            raise self.backend.access_error(what, e) from e
        except FileExistsError:
            raise
        except OSError as e:
            if access_problem(e) is not None:
                raise self.backend.access_error(what, e) from e
            raise TierError(f"object tier {self.url}: {what} failed: {e}; check the endpoint and credentials"
                            f"{server_error_hint(e)}") from e
        except Exception as e:  # botocore raises its own tree for endpoint/credential trouble
            if not type(e).__module__.startswith(_NETWORK_MODULES):
                raise
            if access_problem(e) == "no-bucket":
                raise self.backend.missing_error(e) from e
            if access_problem(e) is not None:
                raise self.backend.access_error(what, e) from e
            raise TierError(f"object tier {self.url}: {what} failed: {type(e).__name__}: {e}{server_error_hint(e)}") from e

    def exists(self) -> bool:
        """Whether the configured store exists: True; False when it is not created yet (a ``file://`` folder
        whose parent exists: the first write creates it). Raises TierMissingError when it cannot be written
        without fixing the config (no such S3 bucket; a ``file://`` folder whose parent is missing too) and
        TierAccessError when credentials are missing or refused. An S3 prefix needs no creating: a bucket
        that exists is an existing (maybe empty) store."""
        return self.backend.root_exists(self.base)

    # ---- listing / manifests ---------------------------------------------
    def _committed_steps(self) -> list[int]:
        self._forget_listings()
        try:
            found = self.call("listing", self.fs.glob, self._p(f"step-*/{MANIFEST}"))
        except FileNotFoundError:
            return []
        steps = {parse_step_dir(p.rstrip("/").split("/")[-2]) for p in found}
        return sorted(s for s in steps if s is not None)

    def _forget_listings(self) -> None:
        """Drop every cached listing under the run's prefix (s3fs's ``invalidate_cache(path)`` drops the path and
        its parents only): another process may have deleted a manifest and kept the step's referenced files, and a
        stale listing of that step's folder would still show the manifest."""
        root = self.fs._strip_protocol(self.root).rstrip("/")
        cache = getattr(self.fs, "dircache", None)
        if cache is not None:
            for key in [k for k in list(cache) if k == root or k.startswith(root + "/")]:
                cache.pop(key, None)
        self.fs.invalidate_cache(self.root)

    def _manifest_token(self, step: int) -> object | None:
        # committed manifests are written once (exclusive create) and only deleted by GC: the
        # parsed copy stays valid for this tier object; verify/audit re-read with fresh=True
        return "committed"

    def _manifest_bytes(self, step: int) -> bytes:
        try:
            return self.call("reading a manifest", self.fs.cat_file, self._p(f"{step_dir(step)}/{MANIFEST}"))
        except FileNotFoundError:
            raise StepNotFoundError(f"object tier {self.url}: step {step} is not committed") from None

    def _exists(self, rel: str) -> bool:
        self.fs.invalidate_cache(self._p(rel).rsplit("/", 1)[0])
        return bool(self.call("checking " + rel, self.fs.exists, self._p(rel)))

    def _delete(self, step: int) -> None:
        """Delete a step; the files of it that committed steps of the run reference stay (tiers/object_refs.py)."""
        sd = step_dir(step)
        held = object_refs.held_files(self, exclude=step)  # counted before anything goes
        self.call("deleting a manifest", self.fs.rm, self._p(f"{sd}/{MANIFEST}"))  # the step stops existing first
        self._headers.clear()
        keep = None if held is None else held.get(step, set())
        if keep is None or keep:
            # referenced (or, with a manifest unreadable, maybe referenced): only what nobody references goes;
            # the rest stays in place until a later delete or GC counts it unreferenced
            files = self._files(sd) if keep is not None else {}
            for rel in sorted(f for f in files if not object_refs.holds(f, keep)):
                self.remove_file(rel, "deleting step data")
            log.info("object tier %s: step %d deleted; %s of its files stay: committed steps reference them",
                     self.url, step, "all" if keep is None else len(keep))
            return
        # the whole prefix: the committed attempt's files, and any a losing writer left
        self.remove_tree(sd, "deleting step data")

    def remove_tree(self, rel: str, what: str) -> None:
        """Delete the folder ``rel`` and everything in it (its empty folders too, where the store keeps them)."""
        self.backend.remove_tree(self._p(rel), what)

    # ---- records -------------------------------------------------------------
    def _put_record(self, name: str, data: bytes) -> None:
        self.backend.put_record(self._p(name), data)

    def _get_record(self, name: str) -> bytes | None:
        try:
            return self.call(f"reading {name}", self.fs.cat_file, self._p(name))
        except FileNotFoundError:
            return None

    def _list_records(self, prefix: str) -> list[str]:
        self.fs.invalidate_cache(self._p(prefix))
        try:
            return sorted(p.rstrip("/").split("/")[-1] for p in self.call("listing", self.fs.ls, self._p(prefix), detail=False))
        except FileNotFoundError:
            return []


__all__ = ["ObjectTier", "filesystem", "aws_endpoint_region", "botocore_options", "attempt_dir", "attempt_of",
           "ATTEMPT", "MANIFEST", "READ_AHEAD"]
