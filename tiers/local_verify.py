"""Deletion, verification and cleanup of the local tier (a mixin of LocalTier): a deleted step keeps the bytes
later steps reference (tiers/local_refs.py), nothing is deleted through a symlink, abandoned partial writes go."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable

from flowcheck.digest import file_digest
from flowcheck.errors import FlowcheckError, IntegrityError
from flowcheck.manifest import Manifest
from flowcheck.tiers import local_refs, zarr_pack
from flowcheck.tiers.base import MANIFEST, Problem, file_mismatch, step_dir
from flowcheck.tiers.durable import fsync_dir
from flowcheck.tiers.local_read import check_regular

log = logging.getLogger(__name__)


class LocalChecks:
    """Deletion, verification and cleanup of LocalTier (a mixin: it uses the tier's root, config and manifests)."""

    def _delete(self, step: int) -> None:
        """Delete a step; the bytes of it a committed step of the run references stay (tiers/local_refs.py)."""
        self._refuse_linked_branch()
        path = os.path.join(self.root, step_dir(step))
        if os.path.islink(path):  # never deleted through: the link goes, what it points at stays
            log.warning("local tier %s: step folder %s is a symlink; removing the link only", self.root, step_dir(step))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        if _holds_packs(path):
            refs = local_refs.references(self.search_order(), exclude=(self.branch, step))
            try:
                digest: str | None = self.manifest(step, check_signature=False).digest()
            except FlowcheckError:  # damaged since it was referenced: the references still name its identity
                digest = next((d for (b, n, d) in refs or {} if (b, n) == (self.branch, step)), None)
            needed = None if refs is None else refs.get((self.branch, step, digest))
            if digest is not None and (refs is None or needed):  # None: a manifest unreadable, keep all packs
                local_refs.retain(self.root, step, digest, needed, self.config.fsync)
                return
        trash = f"{path}.{uuid.uuid4().hex[:8]}.deleting.tmp"
        try:
            os.rename(path, trash)  # the step vanishes atomically; the data follows
        except FileNotFoundError:
            return  # another gc or delete took it meanwhile
        fsync_dir(self.root)
        _remove_tree(trash)

    def _verify_files(self, manifest: Manifest, on_bytes: Callable[[int], None] = lambda n: None) -> list[Problem]:
        problems = []
        listed = set()
        for f in manifest.files:
            listed.add(f.path)
            on_bytes(f.bytes)  # before the check: a missing or damaged file still moves the count on
            path = os.path.join(self.root, f.path)
            real = self._outside(f.path)
            if real is not None:
                problems.append(Problem(self.name, manifest.step, f"symlink out of the store root (to {real})", path))
                continue
            try:
                check_regular(path)
                size, digest = file_digest(path)
            except FileNotFoundError:
                problems.append(Problem(self.name, manifest.step, "file listed in the manifest is missing", path))
                continue
            except IntegrityError as e:
                problems.append(Problem(self.name, manifest.step, str(e), path))
                continue
            what = file_mismatch(f, size, digest)
            if what:
                problems.append(Problem(self.name, manifest.step, what, path))
        problems += self._verify_refs(manifest)
        sd = step_dir(manifest.step)
        for dirpath, _dirs, files in os.walk(os.path.join(self.root, sd)):
            for name in files:
                rel = os.path.relpath(os.path.join(dirpath, name), self.root)
                real = self._outside(rel) if rel not in listed else None
                if real is not None:
                    problems.append(Problem(self.name, manifest.step, f"symlink out of the store root (to {real})", rel))
                elif rel not in listed and rel != f"{sd}/{MANIFEST}":
                    problems.append(Problem(self.name, manifest.step, "file not listed in the manifest", rel, "warning"))
        return problems

    def _verify_refs(self, manifest: Manifest) -> list[Problem]:
        """Every file of an earlier step this step references: there (in the run folder), with the size and digest
        recorded when the reference was made.  A finding names both steps."""
        problems = []
        for ref in manifest.refs:
            held = (f"step {ref.step} of branch {ref.branch} ({ref.manifest_digest[:19]}), which step "
                    f"{manifest.step} references")
            folder = os.path.join(local_refs.branch_rel(ref.branch), self._holder_dir(ref))
            for f in ref.files:
                rel = os.path.join(folder, f.path.partition("/")[2])
                path = os.path.join(self._run_root(), rel)
                try:
                    self._check_inside_run(rel)
                    size, digest = file_digest(path)
                except IntegrityError as e:
                    problems.append(Problem(self.name, manifest.step, f"{held}: {e}", path))
                    continue
                except FileNotFoundError:
                    problems.append(Problem(self.name, manifest.step, f"file of {held} is missing", path))
                    continue
                what = file_mismatch(f, size, digest)
                if what:
                    problems.append(Problem(self.name, manifest.step, f"file of {held}: {what}", path))
        return problems

    def clean_incomplete(self, older_than_s: float, dry_run: bool = False) -> list[str]:
        """Abandoned ``.tmp`` folders, and retained bytes of deleted steps that no committed step references."""
        removed = []
        if os.path.isdir(os.path.join(self.root, local_refs.RETAINED)):  # the run's references counted only then
            removed = local_refs.sweep(self.root, self.branch, local_refs.references(self.search_order()), dry_run)
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return removed
        cutoff = self._disk_now(dry_run) - older_than_s
        for n in names:
            path = os.path.join(self.root, n)
            if not (n.endswith(".tmp") and n.startswith("step-")):
                continue
            try:
                old = os.lstat(path).st_mtime < cutoff  # a link's own time: never followed
            except FileNotFoundError:
                continue  # removed meanwhile by another gc
            if old:
                removed.append(path)
                if not dry_run:
                    _remove_tree(path)
        return removed

    def _disk_now(self, dry_run: bool) -> float:
        """Now, never later than the disk's clock: the earlier of this host's time and the time the disk stamps
        on a file written now (+50 ms: file times tick coarsely). Another writer's .tmp is judged on the clock
        that stamped it (a shared disk's server), not on this host's, which may run ahead."""
        if dry_run:
            return time.time()
        probe = os.path.join(self.root, ".clock")
        try:
            with open(probe, "wb"):
                pass
            return min(time.time(), os.stat(probe).st_mtime + 0.05)
        except OSError as e:
            log.info("local tier %s: cannot probe the disk's clock (%s); using this host's", self.root, e)
            return time.time()

    def incomplete(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.root) if n.endswith(".tmp"))
        except FileNotFoundError:
            return []


def _remove_tree(path: str) -> None:
    """Remove a folder being deleted; a symlink is unlinked, never followed (rmtree refuses links, which would
    leave one behind for every GC to report cleaned)."""
    if os.path.islink(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)

def _holds_packs(folder: str) -> bool:
    """Whether a step folder holds packs a later step may reference: its own, or a DCP step's per part
    (``nodes/<part>/packs``)."""
    if os.path.isdir(os.path.join(folder, zarr_pack.PACKS)):
        return True
    nodes = os.path.join(folder, "nodes")
    return os.path.isdir(nodes) and not os.path.islink(nodes) and any(
        os.path.isdir(os.path.join(nodes, part, zarr_pack.PACKS)) for part in os.listdir(nodes))
