"""The tier interface: write a snapshot, read a step's tensors, list, describe, delete.

A tier implements a handful of primitives (``_committed_steps``,
``_manifest_bytes``, ``_write``, ``_read_shard``, ``_delete``, ``_verify_files``,
``_put_record``/``_get_record``); manifests, signing, region reads across
shards, lazy snapshots and pruning records are written once, here.
"""
from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from flowcheck import dtypes
from flowcheck.branches import MAIN, RECORD, BranchRecord, branch_root
from flowcheck.digest import data_digest
from flowcheck.errors import (
    FlowcheckError,
    IntegrityError,
    ManifestError,
    StepExistsError,
    StepNotFoundError,
    TensorNotFoundError,
)
from flowcheck.manifest import FileEntry, Manifest, ParentRef, ShardEntry, check_parent, parse, validated_bytes
from flowcheck.progress import Progress
from flowcheck.state import Shard, Snapshot, check_branch
from flowcheck.tiers import records
from flowcheck.tiers.records import PrunedRecord
# re-exported: tiers import these from here
from flowcheck.tiers.regions import allocate, full_region, normalize_region, too_large  # noqa: F401
from flowcheck.tiers.step_manifest import make_manifest, shard_digests, shard_files, with_origin  # noqa: F401

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"  # a committed step's manifest, in its step folder, in every tier

STEP_DIR = "step-{step:09d}"
MAX_STEP = 999_999_999  # what STEP_DIR's nine digits hold (a wider number would be invisible to listings)


def step_dir(step: int) -> str:
    return STEP_DIR.format(step=step)


def file_mismatch(entry: FileEntry, size: int, digest: str | None = None) -> str | None:
    """How a stored file differs from its manifest entry: its size, else (when it was read) its digest; None if
    neither does."""
    if size != entry.bytes:
        return f"size {size} != manifest {entry.bytes}"
    if digest is not None and digest != entry.digest:
        return f"digest {digest} != manifest {entry.digest}"
    return None


def parse_step_dir(name: str) -> int | None:
    """The step of a committed step directory name, or None for anything else."""
    if len(name) == 14 and name.startswith("step-") and name[5:].isdigit():
        return int(name[5:])
    return None


@dataclass(frozen=True)
class Problem:
    """One finding of a verification: where, what, and how bad."""

    tier: str
    step: int | None
    what: str
    path: str = ""
    severity: str = "error"  # error | warning | info

    def __str__(self) -> str:
        where = f"step {self.step}" if self.step is not None else "tier"
        return f"[{self.severity}] {self.tier} {where}: {self.what}{' (' + self.path + ')' if self.path else ''}"


class Tier(ABC):
    """A place that stores committed steps of one run."""

    name: str = "tier"
    verifies_reads: bool = True  # read() checks every whole shard it reads against the manifest's digest
    stores: bool = True  # a persistent tier: what it commits is signed (when signing is on) and validated

    def __init__(self, run: str, *, node: str = "", signing_key: bytes | None = None, require_signature: bool = False,
                 branch: str = MAIN):
        self.run = run
        self.branch = branch
        self.rel = branch_root(run, branch)  # this branch's folder under the tier root: <run>[/branches/<name>]
        self.node = node
        self.signing_key = signing_key
        self.require_signature = require_signature
        self._manifest_cache: dict[int, tuple[object, Manifest]] = {}
        self._verified: set[tuple] = set()  # shards read whole with a right digest (region reads trust them)
        self._branch_tiers: dict[str, Tier] = {}

    # ---- primitives ------------------------------------------------------
    @abstractmethod
    def _committed_steps(self) -> list[int]:
        """Steps whose manifest is committed, ascending."""

    @abstractmethod
    def _manifest_bytes(self, step: int) -> bytes:
        """The raw manifest of a committed step; StepNotFoundError if none."""

    @abstractmethod
    def _write(self, snapshot: Snapshot, parent: ParentRef | None, progress: Progress | None = None) -> Manifest:
        """Store data, then commit the manifest last; return the committed manifest.

        ``progress``: set its total to the bytes to write (``snapshot.nbytes``, plus any header bytes) and
        update it per shard or file written."""

    @abstractmethod
    def _read_shard(self, manifest: Manifest, tensor: str, shard: ShardEntry, region: tuple[slice, ...]) -> np.ndarray:
        """Read ``region`` (slices local to the shard) of one shard, in its storage dtype."""

    @abstractmethod
    def _delete(self, step: int) -> None:
        """Remove a committed step (manifest first, so it stops existing before its data goes)."""

    def _verify_files(self, manifest: Manifest, on_bytes: Callable[[int], None] = lambda n: None) -> list[Problem]:
        """Problems with the stored files; ``on_bytes(f.bytes)`` once per listed file checked (or found bad)."""
        on_bytes(manifest.nbytes)
        return []

    def clean_incomplete(self, older_than_s: float, dry_run: bool = False) -> list[str]:
        """Remove abandoned partial writes older than the grace period; return what was (or would be) removed."""
        return []

    def _put_record(self, name: str, data: bytes) -> None:
        """Store a small bookkeeping file (pruning records, latest pointer) under the run root."""

    def _get_record(self, name: str) -> bytes | None:
        return None

    def _list_records(self, prefix: str) -> list[str]:
        return []

    def get_record(self, name: str) -> bytes | None:
        """A small record under the run root by name (e.g. the run's identity, flowcheck/identity.py)."""
        return self._get_record(name)

    def put_record(self, name: str, data: bytes) -> None:
        self._put_record(name, data)

    def list_records(self, prefix: str) -> list[str]:
        """The names of the records under ``prefix`` (e.g. ``pruned``)."""
        return self._list_records(prefix)

    # ---- the interface ---------------------------------------------------
    def steps(self) -> list[int]:
        return self._committed_steps()

    def _manifest_token(self, step: int) -> object | None:
        """Something that changes when a step's manifest file changes (None: do not cache)."""
        return None

    def _already_committed(self, snapshot: Snapshot, where: str) -> Manifest:
        """A write of a step this tier already has: the stored manifest when ``snapshot`` is that very step read
        back (e.g. a retried promotion: nothing to do), else StepExistsError naming ``where``."""
        existing = self.manifest(snapshot.step)
        if snapshot.origin is not None and snapshot.origin.digest() == existing.digest():
            return existing
        raise StepExistsError(f"{where} is already committed with different content; "
                              "delete it first or write a new step")

    def manifest(self, step: int, *, check_signature: bool = True, fresh: bool = False) -> Manifest:
        """The parsed, integrity-checked manifest of a committed step (signature checked per the policy).

        Parsed manifests are cached while the tier says the file is unchanged
        (committed manifests are immutable); ``fresh`` re-reads, as verify does.
        """
        token = None if fresh else self._manifest_token(step)
        cached = self._manifest_cache.get(step)
        if token is not None and cached is not None and cached[0] == token:
            m = cached[1]
        else:
            m = parse(self._manifest_bytes(step), f"{self.name} tier {self.rel}/{step_dir(step)}/manifest.json")
            if token is not None:
                self._manifest_cache[step] = (token, m)
        if check_signature:
            self.check_signature(m)
        if m.step != step or m.run != self.run:
            raise ManifestError(
                f"{self.name} tier {self.rel}/{step_dir(step)}/manifest.json: field 'step'/'run': expected "
                f"{self.run}/{step}, found {m.run}/{m.step}"
            )
        return m

    def write(self, snapshot: Snapshot, parent: ParentRef | None = None, *, progress: Progress | None = None) -> Manifest:
        """Commit a snapshot as a step; ``progress`` (a tqdm bar fits) counts the bytes written."""
        if snapshot.run != self.run:
            raise FlowcheckError(f"{self.name} tier: expected a snapshot of run {self.run!r}, found run {snapshot.run!r}")
        if self.stores:
            self._check_writable(snapshot, parent)
        m = self._write(snapshot, parent, progress=progress)
        log.info("%s tier: committed %s step %d (%d bytes)", self.name, self.run, m.step, m.nbytes)
        return m

    def read(self, step: int, tensor: str, region: Any = None, *, manifest: Manifest | None = None) -> np.ndarray:
        """A region of a tensor in the global index space, assembled from the shards that cover it."""
        m = manifest or self.manifest(step)
        if tensor not in m.tensors:
            raise TensorNotFoundError(f"step {step} has no tensor {tensor!r}; see `flowcheck show --step {step} --json`")
        t = m.tensors[tensor]
        reg = normalize_region(region, t.global_shape, tensor)
        hits = [(entry, hit) for entry in t.shards if (hit := Shard(tensor, entry.offsets, entry.shape).intersect(reg))]
        # checked before allocating: a manifest whose shape outgrows its shards must not size the buffer
        covered = sum(math.prod(s.stop - s.start for s in dest) for _entry, (_local, dest) in hits)
        if covered < math.prod(s.stop - s.start for s in reg):
            raise IntegrityError(f"step {step} tensor {tensor}: the stored shards cover only part of region {reg}")
        out = allocate(tuple(s.stop - s.start for s in reg), t.dtype, f"{self.name} tier step {step} tensor {tensor}")
        for entry, (local, dest) in hits:
            if not self.verifies_reads:
                out[dest] = self._read_stored(m, tensor, entry, local)
            elif local == full_region(entry.shape):  # a whole shard costs no extra I/O to check
                out[dest] = self.read_shard(m, tensor, entry)
            elif self._verified_shard(m, tensor, entry):
                out[dest] = self._read_stored(m, tensor, entry, local)
            else:
                # rows of a shard never checked: only its whole digest can tell a swapped chunk (each with a
                # valid CRC32C) from the real one, so it is read and checked whole once (read_shard keeps the verdict)
                out[dest] = self.read_shard(m, tensor, entry)[local]
        return out

    def _verified_shard(self, m: Manifest, tensor: str, entry: ShardEntry, *, mark: bool = False) -> bool:
        """Whether this tier object has read this shard whole and found its digest right (``mark``: it has)."""
        key = (m.step, tensor, entry.offsets, entry.digest, tuple(p.path for p in entry.location))
        if mark:
            if len(self._verified) > 100_000:  # a bound, not a policy: re-checking costs I/O, never correctness
                self._verified.clear()
            self._verified.add(key)
        return key in self._verified

    def read_shard(self, manifest: Manifest, tensor: str, entry: ShardEntry, *, verify: bool = True) -> np.ndarray:
        """One whole shard, its data digest checked against the manifest."""
        arr, got = self._read_whole(manifest, tensor, entry)
        if verify:
            got = got if got is not None else data_digest(arr)
            if got != entry.digest:
                raise IntegrityError(
                    f"{self.name} tier step {manifest.step} tensor {tensor} shard {list(entry.offsets)} "
                    f"(stored in {', '.join(shard_files(manifest, entry))}): data digest {got} != manifest {entry.digest}; "
                    "this copy is damaged — read the step from another tier"
                )
        if verify:
            self._verified_shard(manifest, tensor, entry, mark=True)  # later region reads of it may trust it
        return arr

    def _read_whole(self, manifest: Manifest, tensor: str, entry: ShardEntry) -> tuple[np.ndarray, str | None]:
        """A whole shard and its data digest when the tier computed it in the same pass as the read (else None)."""
        return self._read_stored(manifest, tensor, entry, full_region(entry.shape)), None

    def _read_stored(self, manifest: Manifest, tensor: str, entry: ShardEntry, region: tuple[slice, ...],
                     read: Callable[[], Any] | None = None) -> Any:
        """``_read_shard`` (or ``read()``), with a file the manifest lists but the tier lacks reported as damage (not
        a bare OSError), and a shard too large to allocate as a TooLargeError."""
        try:
            return read() if read is not None else self._read_shard(manifest, tensor, entry, region)
        except MemoryError as e:
            if isinstance(e, FlowcheckError):
                raise
            shape = tuple(r.stop - r.start for r in region)
            raise too_large(f"{self.name} tier step {manifest.step} tensor {tensor} shard {list(entry.offsets)}", shape,
                            manifest.tensors[tensor].dtype) from e
        except FileNotFoundError as e:
            if isinstance(e, FlowcheckError):
                raise
            raise IntegrityError(
                f"{self.name} tier step {manifest.step} tensor {tensor}: a file listed in the manifest is missing "
                f"({e.filename or e}); this copy is damaged — read the step from another tier"
            ) from e

    def load(self, step: int, *, verify: bool = True) -> Snapshot:
        """A lazy snapshot of a committed step: shards are read (and verified) when asked for."""
        m = self.manifest(step)
        data = {}
        for name, t in m.tensors.items():
            for entry in t.shards:
                data[Shard(name, entry.offsets, entry.shape)] = _Loader(self, m, name, entry, verify)
        from flowcheck.state import Scalars

        return Snapshot(
            m.run, m.step, m.layout(), data, Scalars.from_json(m.scalars), source=m.producer.source, origin=m
        )

    def exists(self) -> bool:
        """Whether the tier's configured root exists: True; False when it is not created yet (a new store: reading
        it finds nothing, the first write creates it); raises TierMissingError when the configuration names
        something that cannot be written without fixing it (see each tier)."""
        return True

    def delete(self, step: int, *, by: str = "gc") -> PrunedRecord:
        """Delete a committed step, leaving a pruning record (``by``: "gc" or "delete") so audit knows the gap is
        deliberate and ``show`` can say when it went; returns the record."""
        if step not in self.steps():
            raise StepNotFoundError(f"{self.name} tier: step {step} is not committed; nothing to delete")
        try:
            m: Manifest | None = self.manifest(step, check_signature=False)
        except FlowcheckError:
            m = None  # unreadable manifest: the record still says the step went on purpose
        body = records.record_body(step, self.branch, m, by)
        name = records.record_name(step, step_dir(step), body["manifest_digest"],
                                   self._get_record(f"{records.PRUNED}/{step_dir(step)}.json"))
        self._put_record(name, self._sealed(body))
        self._manifest_cache.pop(step, None)
        self._delete(step)
        return records.parse_record(body, self.name, self.branch)

    def pruned(self) -> dict[int, str | None]:
        """Steps deleted on purpose (by GC) -> their manifest digests (the newest record per step)."""
        return dict(self.pruned_records())

    def pruned_records(self) -> list[tuple[int, str | None]]:
        """Every deletion on record: (step, manifest digest) — a step number may have been pruned twice."""
        return [(r.step, r.manifest_digest) for r in self.pruned_entries()]

    def pruned_entries(self) -> list[records.PrunedRecord]:
        """Every deletion on record in this branch folder, with when and by what (tiers/records.py)."""
        out = []
        for name in self._list_records(records.PRUNED):
            body = self._unsealed(self._get_record(f"{records.PRUNED}/{name}"), f"{records.PRUNED}/{name}")
            if body is None:
                continue  # unreadable or (signing on) unsigned/forged: it explains no gap
            try:
                out.append(records.parse_record(body, self.name, self.branch))
            except (KeyError, TypeError, ValueError):
                log.warning("%s tier %s: unreadable pruning record %s; it explains no gap", self.name, self.rel, name)
        return out

    # ---- small records: sealed with the signing key when one is set ---------------------
    def _sealed(self, body: dict[str, Any]) -> bytes:
        return records.seal(body, self.signing_key)

    def _unsealed(self, raw: bytes | None, name: str) -> dict[str, Any] | None:
        return records.unseal(raw, self.signing_key, f"{self.name} tier {self.rel}: record {name}")

    # ---- branches (records under the run root; see flowcheck/branches.py) ----------
    def at_branch(self, branch: str) -> Tier:
        """This tier opened at another branch of the same run (a tier object per branch root)."""
        raise NotImplementedError(f"the {self.name} tier holds one state and has no branches")

    def _at(self, branch: str) -> Tier:
        """This run's tier at another branch, kept (its manifest cache serves every reference into it)."""
        if branch == self.branch:
            return self
        t = self._branch_tiers.get(branch)
        if t is None:
            t = self._branch_tiers[branch] = self.at_branch(branch)
        return t

    def search_order(self) -> list[Tier]:
        """This branch, then main, then every other branch of the run (where references between steps are
        looked for: manifest v4, docs/format.md "Incremental steps")."""
        main = self._at(MAIN)
        names = [self.branch] + [b for b in (MAIN, *main.branch_names()) if b != self.branch]
        return [self._at(b) for b in names]

    def _same_kw(self) -> dict[str, Any]:
        return dict(node=self.node, signing_key=self.signing_key, require_signature=self.require_signature)

    def branch_names(self) -> list[str]:
        """The branches other than main this tier holds a folder for (called on the main-branch tier)."""
        out = []
        for name in self._list_records("branches"):
            try:
                out.append(check_branch(name))
            except FlowcheckError:
                log.warning("%s tier: ignoring %s/branches/%s (not a branch name)", self.name, self.rel, name)
        return out

    def branch_record(self) -> BranchRecord | None:
        """This branch's fork record (None on main, or before the branch's first write)."""
        raw = self._get_record(RECORD)
        return None if raw is None else BranchRecord.parse(raw, f"{self.name} tier {self.rel}/{RECORD}")

    def put_branch_record(self, record: BranchRecord) -> None:
        """Write the fork record before the branch's first state (data first, commit last holds for it too)."""
        if self._get_record(RECORD) is None:
            self._put_record(RECORD, record.to_bytes())

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def publish_latest(self, step: int) -> None:
        """Move the 'latest' pointer forward — only ever called after a durable commit."""
        current = self.latest_record()
        if current is not None and current >= step:
            return
        self._put_record("latest", self._sealed({"step": step}))

    def latest_record(self) -> int | None:
        """The newest step this branch folder ever committed, by its 'latest' record (sealed when signing is on;
        a plain number from before records were JSON is read when signing is off).  None when there is no record
        or it is unreadable, unsigned or forged (``has_latest_record`` tells these apart)."""
        raw = self._get_record("latest")
        if raw is None:
            return None
        if raw.strip().isdigit():
            return None if self.signing_key else int(raw)
        body = self._unsealed(raw, "latest")
        step = None if body is None else body.get("step")
        return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None

    def has_latest_record(self) -> bool:
        """Whether a 'latest' record exists at all (readable or not)."""
        return self._get_record("latest") is not None

    def verify(self, step: int, *, data: bool = True, on_bytes: Callable[[int], None] | None = None) -> list[Problem]:
        """Check one step: manifest, every file's size and digest, every shard's data digest.

        ``on_bytes(n)`` is called per file and per shard checked; over a step it adds up to
        ``verify_bytes(manifest, data)`` (whatever is found, so a bar still ends at its total).
        """
        on_bytes = on_bytes or (lambda n: None)
        try:
            m = self.manifest(step, fresh=True)
        except FlowcheckError as e:
            return [Problem(self.name, step, str(e), MANIFEST)]
        problems = self._verify_files(m, on_bytes)
        files_ok = not problems  # damaged files: their data is not re-read, only counted
        for name, t in m.tensors.items() if data else ():
            for entry in t.shards:
                if files_ok:
                    try:
                        self.read_shard(m, name, entry)
                    except Exception as e:  # noqa: BLE001 - every failure is a finding here
                        problems.append(Problem(self.name, step, f"tensor {name}: {e}"))
                on_bytes(math.prod(entry.shape) * dtypes.dtype(t.dtype).itemsize)
        return problems

    def _check_writable(self, snapshot: Snapshot, parent: ParentRef | None) -> None:
        """Refuse, before anything is written, what would commit a manifest no reader accepts."""
        where = f"{self.name} tier {self.rel}/{step_dir(snapshot.step) if 0 <= snapshot.step <= MAX_STEP else '?'}"
        if not 0 <= snapshot.step <= MAX_STEP:
            raise FlowcheckError(f"{where}: step {snapshot.step}: expected a step number from 0 to {MAX_STEP:,} "
                                 "(nine digits in the step folder name); nothing was written")
        if self.require_signature and not self.signing_key:
            raise ManifestError(f"{where}: signing is required (signing.required) but no key is set: export the "
                                "variable signing.key_env names; nothing was written")
        if parent is not None:
            check_parent(parent, f"{where}: the parent given for the new manifest")

    def sign(self, m: Manifest) -> Manifest:
        """The manifest to commit: signed when a key is set, and checked by the readers' own parser."""
        return self.signed_bytes(m)[0]

    def signed_bytes(self, m: Manifest) -> tuple[Manifest, bytes]:
        """``sign``, with the file form it checked (a large manifest is then encoded once, not twice)."""
        m = m.signed(self.signing_key) if self.signing_key else m
        raw = validated_bytes(m, f"{self.name} tier {self.rel}/{step_dir(m.step)}/manifest.json (about to be committed)")
        return m, raw

    def check_signature(self, m: Manifest) -> None:
        where = f"{self.name} tier {self.rel}/{step_dir(m.step)}/manifest.json"
        if m.signature is not None and self.signing_key is not None and not m.signature_valid(self.signing_key):
            raise ManifestError(f"{where}: field 'signature': HMAC does not match; the manifest was forged or altered")
        if self.require_signature and (m.signature is None or self.signing_key is None):
            raise ManifestError(
                f"{where}: field 'signature': signing is required but the manifest is "
                f"{'unsigned' if m.signature is None else 'signed and no key is set to check it'}"
            )


def verify_bytes(manifest: Manifest, data: bool) -> int:
    """What ``Tier.verify`` re-reads of a step: every file, and with ``data`` every shard again."""
    return manifest.nbytes + (manifest.data_nbytes if data else 0)


class _Loader:
    """A callable that reads one shard on demand (keeps lazy snapshots cheap)."""

    def __init__(self, tier: Tier, manifest: Manifest, tensor: str, entry: ShardEntry, verify: bool):
        self.tier, self.manifest, self.tensor, self.entry, self.verify = tier, manifest, tensor, entry, verify

    def __call__(self) -> np.ndarray:
        return self.tier.read_shard(self.manifest, self.tensor, self.entry, verify=self.verify)
