"""The object tier's checks and cleanup: verify stored files, find another writer's leftovers, clean abandoned writes.

A file no manifest names may be a concurrent writer's upload in progress: verify calls it a warning until it is
older than the grace period, and GC removes it only then (on the store's clock, which hosts need not agree with).
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from datetime import datetime

from flowcheck.errors import FlowcheckError, FormatError, IntegrityError, TierError
from flowcheck.manifest import FileEntry, Manifest, StepRef
from flowcheck.tiers import object_refs
from flowcheck.tiers.base import MANIFEST, Problem, file_mismatch, parse_step_dir, step_dir
from flowcheck.tiers.object_write import ATTEMPT, attempt_of

log = logging.getLogger(__name__)


class ObjectChecks:
    """Verification and cleanup of ObjectTier (a mixin: it uses the tier's ``call``, ``backend`` and paths)."""

    def _verify_files(self, manifest: Manifest, on_bytes: Callable[[int], None] = lambda n: None) -> list[Problem]:
        from flowcheck.tiers import cluster

        problems = self.verify_parts(manifest) if manifest.nodes else []
        for f in manifest.files:
            on_bytes(f.bytes)
            what = self._check_file(manifest, f, cluster.expected_manifest_id(manifest, f.path))
            if what:
                node = cluster.node_of(f.path) if manifest.nodes else None
                # a multi-node step names the node whose file is damaged
                problems.append(Problem(self.name, manifest.step, f"node {node}: {what}" if node else what, f.path))
        return problems + self._verify_refs(manifest, on_bytes) + self._stray_problems(manifest)

    def _verify_refs(self, manifest: Manifest, on_bytes: Callable[[int], None]) -> list[Problem]:
        """Every referenced file (manifest v4) where the holder's branch folder has it, with the size and digest
        the holder committed it with and a header naming the holder: a missing or damaged one is an error on this
        step that names the referenced step."""
        problems = []
        for ref in manifest.refs:
            for f in ref.files:
                what = self._check_file(manifest, f, ref.manifest_digest, holder=ref)
                if what:
                    problems.append(Problem(self.name, manifest.step, f"file of referenced step {ref.step} (branch "
                                            f"{ref.branch}), which holds bytes of this step: {what}", f.path))
        return problems

    def _stray_problems(self, manifest: Manifest) -> list[Problem]:
        """What under a committed step its manifest does not name. Another writer's attempt folder is its
        upload in progress (a warning) until untouched for the grace period, then abandoned (an error);
        a stray file outside any attempt (a killed commit's manifest temporary) is never data: a warning.
        The files of an earlier, deleted state at this step number that kept steps reference are not strays."""
        now, problems = time.time(), []
        strays = self._strays(manifest, self._files(step_dir(manifest.step)))
        for rel, newest in sorted(self._unreferenced(manifest.step, strays, None).items()):
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
            found = self.call("listing", self.fs.find, path, detail=True)
        except FileNotFoundError:
            return {}
        return {p[len(self.root) + 1:]: _mtime(info) for p, info in found.items()
                if p.startswith(self.root + "/") and info.get("type") != "directory"}

    def _check_file(self, manifest: Manifest, f: FileEntry, manifest_id: str, holder: StepRef | None = None
                    ) -> str | None:
        """What is wrong with one stored file (size, digest, safetensors header, the manifest it names), or None.
        ``holder``: the file is that referenced step's (manifest v4), in its branch folder.

        A mismatch is read again before it is believed: a body cut short in transit looks the same."""
        try:
            return self._retry.run(f"object tier {self.url}: checking {f.path}",
                                   lambda: self._check_file_once(manifest, f, manifest_id, holder),
                                   retry_on=(TierError, IntegrityError))
        except IntegrityError as e:
            return str(e)
        except TierError as e:
            return f"cannot be read: {e}"

    def _check_file_once(self, manifest: Manifest, f: FileEntry, manifest_id: str, holder: StepRef | None = None
                         ) -> str | None:
        path = self._p(f.path) if holder is None else object_refs.holder_path(self, holder, f.path)
        self.fs.invalidate_cache(path)
        try:
            size = self.call(f"stat {f.path}", self.fs.size, path)
        except FileNotFoundError:
            return "file listed in the manifest is missing"
        what = file_mismatch(f, size)  # the size first: a file of the wrong size is not read
        if what is None:
            what = file_mismatch(f, size, self.call_once(f"reading {f.path}", self._stream_digest, path))
        if what:
            raise IntegrityError(what)
        try:
            meta = self.header(f.path, path).metadata
        except FormatError as e:
            return str(e)
        if meta.get("manifest_id") != manifest_id or meta.get("step") != str(manifest.step if holder is None
                                                                             else holder.step):
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
            entries = self.call("listing", self.fs.ls, self.root, detail=False)
        except FileNotFoundError:
            entries = []
        for path in entries:
            name = path.rstrip("/").split("/")[-1]
            step = parse_step_dir(name)
            if step is None:
                continue
            files = self._files(name)
            if not files:  # an empty prefix (SeaweedFS keeps folders): nothing was written there, nothing to report
                if not dry_run:
                    self.remove_tree(name, "deleting an empty step folder")
            elif f"{name}/{MANIFEST}" in files:
                removed += self._clean_strays(step, files, cutoff, dry_run)
            elif max(files.values(), default=0.0) < cutoff:
                removed += self._clean_step_folder(name, step, files, dry_run)
        removed += self.backend.abort_multipart(cutoff, dry_run)
        return removed

    def _clean_step_folder(self, name: str, step: int, files: dict[str, float], dry_run: bool) -> list[str]:
        """Remove a step folder without a manifest (an abandoned write, or a deleted step) less the files kept
        steps reference (all of it stays when some manifest cannot be read)."""
        if not self._unreferenced(step, {name: 0.0}, {}):
            gone = sorted(self._unreferenced(step, dict.fromkeys(files, 0.0), {}))
            for rel in gone if not dry_run else ():
                self.remove_file(rel, "deleting an unreferenced file of a deleted step")
            return [self._p(rel) for rel in gone]
        if not dry_run:
            self.remove_tree(name, "deleting an abandoned step")
        return [self._p(name)]

    def remove_file(self, rel: str, what: str) -> None:
        try:
            self.call(what, self.fs.rm, self._p(rel))
        except FileNotFoundError:
            pass

    def _store_now(self, dry_run: bool) -> float:
        """Now, never later than the store's clock: the earlier of this host's time and the time the store stamps
        on an object written now (+1 s: S3 keeps whole seconds). Hosts sharing a store need not agree on the
        time; one running ahead must not judge another writer's fresh upload abandoned."""
        if dry_run:
            return time.time()
        probe = self._p(".clock")
        try:
            # one attempt each, no retries: if the store does not answer, this host's clock will do
            self.call_once("probing the store's clock", self.fs.pipe_file, probe, b"")
            self.fs.invalidate_cache(self.root)
            return min(time.time(), _mtime(self.call_once("probing the store's clock", self.fs.info, probe)) + 1.0)
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
        strays = self._strays(m, files)
        stale = sorted(rel for rel, newest in self._unreferenced(step, strays, {}).items() if newest < cutoff)
        for rel in stale if not dry_run else ():
            try:
                self.remove_tree(rel, "deleting an abandoned attempt")
            except FileNotFoundError:  # its writer removed it meanwhile
                pass
        return [self._p(rel) for rel in stale]

    def _unreferenced(self, step: int, units: dict[str, float], unknown: dict[str, float] | None
                      ) -> dict[str, float]:
        """``units`` (files or folders under step ``step``) less those holding a file a committed manifest of the run
        references (manifest v4: a deleted holder's referenced files stay in place); ``unknown`` (None: ``units``)
        when some manifest cannot be read."""
        if not units:
            return units
        held = object_refs.held_files(self)
        if held is None:
            return units if unknown is None else unknown
        keep = held.get(step, set())
        return {u: t for u, t in units.items() if not object_refs.holds(u, keep)}

    def incomplete(self) -> list[str]:
        try:
            entries = self.call("listing", self.fs.ls, self.root, detail=False)
        except FileNotFoundError:
            return []
        names = [p.rstrip("/").split("/")[-1] for p in entries]
        # a prefix with no object under it is no write at all: S3 lists no such prefix, SeaweedFS lists a folder
        # whose last object was deleted until the folder itself is
        found = {n: 0.0 for n in names if parse_step_dir(n) is not None and not self._exists(f"{n}/{MANIFEST}")
                 and self._files(n)}
        # a deleted step whose files kept steps reference is no incomplete write
        return sorted(n for n in found if self._unreferenced(parse_step_dir(n), {n: 0.0}, None))


def _mtime(info: dict) -> float:
    """A listing entry's modification time (S3 ``LastModified``, a local file's ``mtime``), in seconds."""
    t = info.get("LastModified") or info.get("mtime") or info.get("created")
    if isinstance(t, datetime):
        t = t.timestamp()
    return float(t or 0)
