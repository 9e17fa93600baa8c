"""The store: one run's tiers together — snapshot RAM to local, promote local to object, read, GC.

Rules kept here, once: the lineage parent of a new step is what the RAM state
descends from; "latest" and GC only follow a durable commit; GC never deletes
the newest committed step of a tier, nor anything it cannot classify.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flowcheck import config as config_mod
from flowcheck.config import Config
from flowcheck.errors import FlowcheckError, StepNotFoundError, TierError
from flowcheck.manifest import Manifest, ParentRef, signing_key
from flowcheck.progress import Progress, counter
from flowcheck.state import Snapshot
from flowcheck.tiers import retention
from flowcheck.tiers.base import Tier
from flowcheck.tiers.local import LocalTier
from flowcheck.tiers.memory import MemoryTier

log = logging.getLogger(__name__)

TIER_NAMES = ("memory", "local", "object")


@dataclass
class GcReport:
    deleted: dict[str, list[int]] = field(default_factory=dict)
    kept: dict[str, dict[int, str]] = field(default_factory=dict)
    cleaned: dict[str, list[str]] = field(default_factory=dict)
    dry_run: bool = False


class Store:
    """All tiers of one run, as the config describes them."""

    def __init__(self, config: Config, *, progress: bool = False) -> None:
        self.config = config
        self.progress = progress
        key = signing_key(config.signing.key_env)
        self._tier_kw = dict(node=config.node, signing_key=key, require_signature=config.signing.required)
        self.memory = MemoryTier(config.tiers.memory, config.run, **self._tier_kw)
        self.local = LocalTier(config.tiers.local, config.run, **self._tier_kw)
        self._object: Tier | None = None
        # one writer per target tier: a slow upload never holds up local snapshots
        self._locks = {name: threading.RLock() for name in TIER_NAMES}
        self._in_use: set[tuple[str, int]] = set()  # (tier, step) being read by a promotion: GC skips them

    @property
    def object(self) -> Tier | None:
        """The object tier, opened on first use (s3fs and the network load only when needed)."""
        cfg = self.config.tiers.object
        if self._object is None and cfg.enabled:
            from flowcheck.tiers.object import ObjectTier

            staging = cfg.staging_dir or os.path.join(self.config.tiers.local.root, ".staging")
            self._object = ObjectTier(cfg, self.config.run, staging_dir=staging, progress=self.progress,
                                      cluster=self.config.cluster, **self._tier_kw)
        return self._object

    def tiers(self, include_memory: bool = True) -> list[Tier]:
        """Present tiers, fastest first."""
        out: list[Tier] = [self.memory] if include_memory else []
        out.append(self.local)
        if self.object is not None:
            out.append(self.object)
        return out

    def tier(self, name: str) -> Tier:
        for t in self.tiers():
            if t.name == name:
                return t
        raise ValueError(f"unknown or disabled tier {name!r}; expected one of {[t.name for t in self.tiers()]}")

    # ---- writing ---------------------------------------------------------------
    def push(self, snapshot: Snapshot) -> Manifest:
        """Replace the RAM state with a full snapshot (trainer push / resync / restore)."""
        return self.memory.write(snapshot, self.memory.head)

    def snapshot(self) -> Manifest:
        """Persist the current RAM state to the local tier (step-consistent while updates continue)."""
        with self._locks["local"]:
            snap = self.memory.pin()
            try:
                if snap.step in self.local.steps():
                    return self.local.manifest(snap.step)
                m = self.local.write(snap, self.memory.head)
            finally:
                self.memory.release(snap)
            self.memory.head = m.parent_ref()  # the RAM state now descends from this committed step
            return m

    def write(self, snapshot: Snapshot, tier: str = "local", parent: ParentRef | None = None, *, root: bool = False,
              progress: Progress | None = None) -> Manifest:
        """Commit a snapshot directly to a tier; the parent defaults to the newest earlier committed step
        (``root=True``: no parent, e.g. an imported checkpoint starts its own lineage); ``progress`` counts bytes."""
        with self._locks[tier]:
            if parent is None and snapshot.origin is None and not root:
                parent = self._newest_before(snapshot.step)
            return self.tier(tier).write(snapshot, parent, progress=progress)

    def promote(self, step: int | None = None, src: str = "local", dst: str = "object", *,
                progress: Progress | None = None) -> Manifest:
        """Copy a committed step from one tier to another (default: the newest local step to object);
        ``progress`` counts the bytes written (left at zero when the target holds the step already)."""
        source, target = self.tier(src), self.tier(dst)
        with self._locks[src]:
            if step is None:
                step = source.latest()
                if step is None:
                    raise StepNotFoundError(f"{src} tier has no committed step to promote")
            snap = source.load(step)  # raises StepNotFoundError before anything is written
            self._in_use.add((src, step))
        try:
            with self._locks[dst]:
                try:
                    present = step in target.steps()
                except TierError as e:
                    raise TierError(f"{dst} tier: step {step} was not promoted (nothing of it was written): {e}") from e
                if present:
                    return target.manifest(step)
                return target.write(snap, progress=progress)
        finally:
            self._in_use.discard((src, step))

    def _newest_before(self, step: int) -> ParentRef | None:
        best: Manifest | None = None
        for t in self.tiers(include_memory=False):
            earlier = [s for s in t.steps() if s < step]
            if earlier and (best is None or earlier[-1] > best.step):
                # the link records what the parent *is*; whether it is trusted is audit's finding
                best = t.manifest(earlier[-1], check_signature=False)
        return best.parent_ref() if best else None

    # ---- reading ---------------------------------------------------------------
    def find(self, step: int | str, prefer: str = "auto") -> Tier:
        """The fastest tier that holds a committed step ('latest' = the newest anywhere)."""
        tiers = self.tiers() if prefer == "auto" else [self.tier(prefer)]
        if step == "latest":
            step = max((s for t in tiers for s in t.steps()), default=None)
            if step is None:
                raise StepNotFoundError("no committed step in any tier; run `flowcheck snapshot` or the demo first")
        for t in tiers:
            if int(step) in t.steps():
                return t
        where = ", ".join(f"{t.name}: {t.steps()[-5:]}" for t in tiers)
        raise StepNotFoundError(f"step {step} is not committed in {prefer if prefer != 'auto' else 'any tier'} ({where})")

    def manifest(self, step: int | str, prefer: str = "auto") -> Manifest:
        t = self.find(step, prefer)
        return t.manifest(t.latest() if step == "latest" else int(step))

    def read(self, step: int, tensor: str, region: Any = None, prefer: str = "auto") -> np.ndarray:
        return self.find(step, prefer).read(step, tensor, region)

    def load(self, step: int, prefer: str = "auto") -> Snapshot:
        t = self.find(step, prefer)
        if t is self.memory:
            t = self.find(step, "local") if step in self.local.steps() else self.object
        return t.load(step)

    # ---- retention ---------------------------------------------------------------
    def gc(self, dry_run: bool = False, tiers: list[str] | None = None, *, progress: Progress | None = None) -> GcReport:
        """Apply each tier's retention policy; clean abandoned partial writes.

        ``progress`` counts committed steps (listed first, for the total) as each is kept or deleted."""
        report = GcReport(dry_run=dry_run)
        chosen = [t for t in self.tiers(include_memory=False) if tiers is None or t.name in tiers]
        done = counter(progress, sum(len(t.steps()) for t in chosen) if progress is not None else 0)
        for t in chosen:
            with self._locks[t.name]:
                policy = getattr(self.config.policy, t.name)
                infos = []
                for s in t.steps():
                    try:
                        infos.append(retention.StepInfo(s, retention.parse_time(t.manifest(s).created_at)))
                    except FlowcheckError as e:
                        log.warning("gc: %s tier step %d is unclassifiable (%s); keeping it", t.name, s, e)
                        infos.append(retention.StepInfo(s, None))
                plan = retention.plan(infos, policy)
                report.kept[t.name] = plan.keep
                report.deleted[t.name] = [s for s in plan.delete if (t.name, s) not in self._in_use]
                done(len(infos) - len(report.deleted[t.name]))
                for s in report.deleted[t.name]:
                    try:
                        if not dry_run:
                            t.delete(s)
                    except StepNotFoundError:  # a shared object store: another node's GC was first
                        log.info("gc: %s tier step %d was already deleted", t.name, s)
                    done(1)
                report.cleaned[t.name] = t.clean_incomplete(policy.tmp_grace_seconds, dry_run=dry_run)
        return report


def open_store(cfg: Config | str | None = None, *, progress: bool = False) -> Store:
    """A Store from a Config, a YAML path, or None ($FLOWCHECK_CONFIG, else the embedded defaults)."""
    if not isinstance(cfg, Config):
        cfg = config_mod.load(cfg)
    return Store(cfg, progress=progress)
