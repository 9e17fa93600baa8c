"""Reads that fall back to an intact copy: a state damaged in one tier is read from another tier holding it.

Under automatic tier choice (``prefer="auto"``) the store hands readers a ``FallbackTier``: it reads from the
fastest tier holding the state, and when a read there fails its check (a shard's digest, a zarr CRC, a
safetensors header, a missing file, an unreadable manifest) it logs a WARNING naming the tier, the state and
what was damaged, and reads the same shard (or region) from the next tier holding the *same manifest digest*
— every byte is still verified against that tier's manifest. An explicit tier (``--from local``) never falls
back: the store then hands out the tier itself, and its error stands.

Verification (``verify``) and every write or deletion go to the first tier only: a check must report what is
damaged, not read around it.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from flowcheck.errors import FormatError, IntegrityError, ManifestError, TierError
from flowcheck.manifest import Manifest, ParentRef, ShardEntry
from flowcheck.progress import Progress
from flowcheck.state import Snapshot
from flowcheck.tiers.base import Tier

log = logging.getLogger(__name__)

# what a damaged or unreadable copy raises (a digest, a CRC, a header, a missing file, an I/O error)
DAMAGE = (IntegrityError, FormatError, ManifestError, TierError)


def open_checked(first: Tier, step: int, others: Callable[[], list[Tier]]) -> tuple[Tier, Manifest]:
    """A fallback-reading view of ``step`` in ``first`` and its manifest; when the manifest there is damaged,
    the first other tier (``others()``, same branch, fastest first) whose manifest reads."""
    try:
        m = first.manifest(step)
        return FallbackTier(first, m, others), m
    except (ManifestError, FormatError) as e:
        for t in others():
            if step not in t.steps():
                continue
            try:
                m = t.manifest(step)
            except (ManifestError, FormatError):
                continue
            log.warning("%s tier: step %d (branch %s): manifest damaged (%s); reading the %s tier's copy instead "
                        "— run `flowcheck audit`", first.name, step, first.branch, e, t.name,
                        extra={"event": "fallback_read", "step": step, "tier": first.name})
            return FallbackTier(t, m, lambda used=t.name: [o for o in others() if o.name != used]), m
        raise


def _same_entry(m: Manifest, tensor: str, entry: ShardEntry) -> ShardEntry:
    """The shard of another tier's manifest that holds the same data (same offsets, shape and digest)."""
    for e in m.tensors[tensor].shards:
        if e.offsets == entry.offsets and e.shape == entry.shape and e.digest == entry.digest:
            return e
    raise KeyError((tensor, entry.offsets))


class FallbackTier(Tier):
    """``primary`` for reading one state, with other tiers' intact copies to fall back on (see the module)."""

    def __init__(self, primary: Tier, manifest: Manifest, others: Callable[[], list[Tier]]) -> None:
        super().__init__(primary.run, node=primary.node, signing_key=primary.signing_key,
                         require_signature=primary.require_signature, branch=primary.branch)
        self.primary, self._manifest, self._others = primary, manifest, others
        self.name = primary.name
        self.verifies_reads = primary.verifies_reads
        self._alternates: list[tuple[Tier, Manifest]] | None = None
        self._lock = threading.Lock()
        # readers on several threads (restore) may all land here: another tier is read by one at a time, as
        # its read-ahead and header cache expect (the rare path: damage found)
        self._elsewhere_lock = threading.Lock()

    def __getattr__(self, attr: str) -> Any:  # url, root, config, header(): the primary's
        if attr.startswith("__") or attr == "primary":
            raise AttributeError(attr)
        return getattr(self.primary, attr)

    # ---- reads: the primary's, else an intact copy -----------------------------------
    def read_shard(self, manifest: Manifest, tensor: str, entry: ShardEntry, *, verify: bool = True) -> np.ndarray:
        try:
            return self.primary.read_shard(manifest, tensor, entry, verify=verify)
        except DAMAGE as e:
            what = f"{tensor} shard {list(entry.offsets)}"
            return self._elsewhere(e, manifest, what,
                                   lambda t, m: t.read_shard(m, tensor, _same_entry(m, tensor, entry), verify=True))

    def read(self, step: int, tensor: str, region: Any = None, *, manifest: Manifest | None = None) -> np.ndarray:
        m = manifest or self._manifest
        try:
            return self.primary.read(step, tensor, region, manifest=m)
        except DAMAGE as e:
            return self._elsewhere(e, m, tensor, lambda t, other: t.read(step, tensor, region, manifest=other))

    def _elsewhere(self, error: Exception, manifest: Manifest, what: str, read: Callable[[Tier, Manifest], Any]):
        """``read`` from the first other tier holding the same state that reads it intact; else ``error``."""
        tried = []
        for t, m in self._copies(manifest):
            try:
                with self._elsewhere_lock:
                    out = read(t, m)
            except DAMAGE as e:
                tried.append(f"{t.name}: {e}")
                continue
            log.warning("%s tier: step %d (branch %s) %s is damaged (%s); read it from the %s tier's intact copy "
                        "— run `flowcheck audit`", self.name, manifest.step, self.branch, what, error, t.name,
                        extra={"event": "fallback_read", "step": manifest.step, "tier": self.name})
            return out
        for line in tried:
            log.warning("step %d %s: no intact copy in %s", manifest.step, what, line)
        raise error

    def _copies(self, manifest: Manifest) -> list[tuple[Tier, Manifest]]:
        """Other tiers holding this state (same manifest digest), fastest first; listed once, on first need."""
        with self._lock:
            if self._alternates is None:
                self._alternates = []
                for t in self._others():
                    try:
                        if manifest.step in t.steps():
                            m = t.manifest(manifest.step)
                            if m.digest() == manifest.digest():
                                self._alternates.append((t, m))
                    except DAMAGE as e:
                        log.info("%s tier: no usable copy of step %d (%s)", t.name, manifest.step, e)
            return self._alternates

    # ---- everything else is the primary's ------------------------------------------
    def manifest(self, step: int, *, check_signature: bool = True, fresh: bool = False) -> Manifest:
        if step == self._manifest.step and not fresh:
            return self._manifest
        return self.primary.manifest(step, check_signature=check_signature, fresh=fresh)

    def steps(self) -> list[int]:
        return self.primary.steps()

    def verify(self, step: int, *, data: bool = True, on_bytes=None):
        return self.primary.verify(step, data=data, on_bytes=on_bytes)

    def write(self, snapshot: Snapshot, parent: ParentRef | None = None, *, progress: Progress | None = None):
        return self.primary.write(snapshot, parent, progress=progress)

    def delete(self, step: int, *, by: str = "gc"):
        return self.primary.delete(step, by=by)

    def at_branch(self, branch: str) -> Tier:
        return self.primary.at_branch(branch)

    def clean_incomplete(self, older_than_s: float, dry_run: bool = False) -> list[str]:
        return self.primary.clean_incomplete(older_than_s, dry_run)

    def _committed_steps(self) -> list[int]:
        return self.primary.steps()

    # the base class's primitives: a view reaches the primary through its public methods only (write, delete and
    # manifest above call the primary's; these are what the base class's other bodies would use)
    def _manifest_bytes(self, step: int) -> bytes:
        return self.primary.manifest(step, check_signature=False).to_bytes()

    def _write(self, snapshot, parent, progress=None):
        return self.primary.write(snapshot, parent, progress=progress)

    def _read_shard(self, manifest, tensor, shard, region):
        return self.primary.read_shard(manifest, tensor, shard)[region]

    def _delete(self, step: int) -> None:
        self.primary.delete(step)

    def _put_record(self, name: str, data: bytes) -> None:
        self.primary.put_record(name, data)

    def _get_record(self, name: str) -> bytes | None:
        return self.primary.get_record(name)

    def _list_records(self, prefix: str) -> list[str]:
        return self.primary.list_records(prefix)
