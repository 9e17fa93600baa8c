"""Deleting committed states on purpose — GC's retention and an explicit delete — and finding what was deleted.

Both go through one path (``_delete_state``): the tier deletes the state and leaves a pruning record
(tiers/records.py), so audit reads the gap as deliberate and ``show`` can say when the state went and why.
Neither ever deletes the newest committed state of the current branch (the head) unless a delete is forced.
These are the bodies of ``Store.gc``, ``Store.delete`` and ``Store.pruned``; they hold the store's per-tier
write lock while they delete.
"""
from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from flowcheck.branches import MAIN, History, Located
from flowcheck.config import Config
from flowcheck.errors import ConfigError, FlowcheckError, StepNotFoundError
from flowcheck.progress import Progress, counter
from flowcheck.tiers import retention
from flowcheck.tiers.base import Tier
from flowcheck.tiers.records import PrunedRecord

log = logging.getLogger(__name__)


class Store(Protocol):
    """What GC and delete use of a store (flowcheck/store.py's Store): its tiers per branch, its history, and its
    per-tier write lock and promotions in flight, so a deletion never races a writer or a promotion's source."""

    config: Config

    def tiers(self, include_memory: bool = True) -> list[Tier]: ...
    def tier(self, name: str, branch: str = MAIN) -> Tier: ...
    def branch_tiers(self, name: str) -> list[Tier]: ...
    def history(self, tiers: list[str] | None = None, *, live: set[str] | None = None) -> History: ...
    def resolve(self, step: int | str, branch: str | None = None, hist: History | None = None) -> Located: ...
    def writing(self, tier: str) -> AbstractContextManager: ...
    def promoting(self, tier: str, at: Located) -> bool: ...


@dataclass
class GcReport:
    deleted: dict[str, list[Located]] = field(default_factory=dict)
    kept: dict[str, dict[Located, str]] = field(default_factory=dict)
    why: dict[str, dict[Located, str]] = field(default_factory=dict)  # deleted state -> the rule that let it go
    cleaned: dict[str, list[str]] = field(default_factory=dict)
    dry_run: bool = False


@dataclass(frozen=True)
class DeleteReport:
    """What ``Store.delete`` removed: one state, from the tiers named, each leaving a pruning record."""

    run: str
    state: Located
    manifest_digest: str | None
    tiers: tuple[str, ...]
    records: tuple[PrunedRecord, ...]
    was_head: bool  # it was the current branch's newest state (deleted with force=True)


def _delete_state(store: Store, tier: str, at: Located, by: str) -> PrunedRecord | None:
    """Delete one state from one tier with its pruning record; None when it was already gone (a shared object
    store: another node's GC was first). The caller holds the tier's lock."""
    try:
        return store.tier(tier, at.branch).delete(at.step, by=by)
    except StepNotFoundError:
        log.info("%s: %s tier step %s was already deleted", by, tier, at)
        return None


def gc(store: Store, dry_run: bool = False, tiers: list[str] | None = None, *,
       progress: Progress | None = None) -> GcReport:
    """Apply each tier's retention policy along the current branch; clean abandoned partial writes."""
    report = GcReport(dry_run=dry_run)
    chosen = [t for t in store.tiers(include_memory=False) if tiers is None or t.name in tiers]
    hist = store.history(live={t.name for t in chosen})
    done = counter(progress, sum(1 for s in hist.states if s.tier in {t.name for t in chosen})
                   if progress is not None else 0)
    on_path = {Located(n, b) for n, b in hist.path(hist.current()).items()}
    abandoned_at = _abandoned_at(hist, on_path)
    for t in chosen:
        with store.writing(t.name):  # the store's own lock, held as its writers do
            policy = getattr(store.config.policy, t.name)
            # a state that fails its signature check is kept and counts for nothing, as an unreadable one
            infos = [retention.StepInfo(s.step, s.created_at if s.trusted else None, s.branch,
                                        Located(s.step, s.branch) in on_path, abandoned_at.get(s.branch))
                     for s in hist.states if s.tier == t.name]
            plan = retention.plan(infos, policy)
            report.kept[t.name] = plan.keep
            report.deleted[t.name] = [k for k in plan.delete if not store.promoting(t.name, k)]
            report.why[t.name] = {k: plan.why_deleted[k] for k in report.deleted[t.name]}
            done(len(infos) - len(report.deleted[t.name]))
            for k in report.deleted[t.name]:
                if not dry_run:
                    _delete_state(store, t.name, k, "gc")
                done(1)
            report.cleaned[t.name] = [p for bt in store.branch_tiers(t.name)
                                      for p in bt.clean_incomplete(policy.tmp_grace_seconds, dry_run=dry_run)]
    return report


def _abandoned_at(hist: History, on_path: set[Located]) -> dict[str, Any]:
    """Branch -> its last commit, for branches holding states off the current path (kept a while, then pruned)."""
    out: dict[str, Any] = {}
    for s in hist.states:
        if Located(s.step, s.branch) not in on_path and s.created_at is not None:
            out[s.branch] = max(out.get(s.branch, s.created_at), s.created_at)
    return out


def delete(store: Store, step: int | str, tier: str | None = None, branch: str | None = None, *,
           force: bool = False) -> DeleteReport:
    """Delete one committed state (a number or ``latest`` on ``branch``, default the current branch, or a
    ``sha256:`` digest prefix) from ``tier`` (None: every persistent tier holding it), leaving GC's pruning
    record in each. The head of the current branch is refused unless ``force``."""
    names = [t.name for t in store.tiers(include_memory=False)]
    if tier is not None and tier not in names:
        raise ConfigError(f"delete: tier: expected one of {names}, found {tier!r}")
    hist = store.history()
    at = store.resolve(step, branch, hist)
    holders = sorted({s.tier for s in hist.states if Located(s.step, s.branch) == at}, key=names.index)
    chosen = [n for n in holders if tier is None or n == tier]
    if not chosen:
        raise StepNotFoundError(f"step {at} of run {store.config.run!r} is not committed in the {tier} tier "
                                f"(held by: {', '.join(holders)}); nothing was deleted")
    head = hist.resolve("latest")
    if at == head and not force:
        raise FlowcheckError(
            f"step {at} of run {store.config.run!r} is the newest committed state of the current branch "
            f"{hist.current()!r} (its head): expected an older state, found the head — deleting it moves 'latest' "
            "back and GC never does that; pass --force (force=True) to delete it anyway")
    digest = next((s.digest for s in hist.states if Located(s.step, s.branch) == at and s.digest), None)
    done = []
    for name in chosen:
        with store.writing(name):  # the store's own lock, held as its writers do
            if store.promoting(name, at):
                raise FlowcheckError(f"step {at} of run {store.config.run!r} is being promoted from the {name} tier "
                                     "right now: expected it idle; delete it again when the promotion is done")
            rec = _delete_state(store, name, at, "delete")
        if rec is not None:
            done.append(rec)
            log.info("delete: step %s of run %s deleted from the %s tier", at, store.config.run, name)
    return DeleteReport(store.config.run, at, digest, tuple(r.tier for r in done), tuple(done), at == head)


def pruned(store: Store, step: int | str, branch: str | None = None) -> PrunedRecord | None:
    """The newest pruning record of a state no tier holds any more: ``step`` a number (on ``branch``, default
    the branches of the current branch's path) or a ``sha256:`` digest prefix (on any branch); None if none."""
    if step == "latest":
        return None
    hist = store.history()
    if isinstance(step, str) and step.startswith("sha256:"):
        wanted = {branch} if branch is not None else None
        hits = [r for r in records(store, wanted) if r.manifest_digest and r.manifest_digest.startswith(step)]
    else:
        if not str(step).isdigit():
            return None
        wanted = {branch} if branch is not None else set(hist.path(hist.current()).values()) | {hist.current()}
        hits = [r for r in records(store, wanted) if r.step == int(step)]
    held = {(s.step, s.digest) for s in hist.states}
    hits = [r for r in hits if (r.step, r.manifest_digest) not in held]  # deleted from one tier, kept in another
    return max(hits, key=lambda r: (r.pruned_at is not None, r.pruned_at or 0), default=None)


def records(store: Store, branches: set[str] | None = None) -> list[PrunedRecord]:
    """Every pruning record of the run, in every persistent tier (on ``branches``, default all)."""
    return [r for t in store.tiers(include_memory=False) for bt in store.branch_tiers(t.name)
            if branches is None or bt.branch in branches for r in bt.pruned_entries()]


def pruned_message(store: Store, step: int | str, branch: str | None) -> tuple[str, PrunedRecord] | None:
    """``step 5 of run 'r1' was pruned by GC at … from the local, object tier(s) …`` when a record explains a
    missing state; None otherwise."""
    rec = pruned(store, step, branch)
    if rec is None:
        return None
    tiers = sorted({r.tier for r in records(store, {rec.branch})
                    if r.step == rec.step and r.manifest_digest == rec.manifest_digest})
    at = Located(rec.step, rec.branch)
    message = (f"step {at} of run {store.config.run!r} was {rec.describe()} (from the {', '.join(tiers)} "
               f"tier{'s' if len(tiers) > 1 else ''}; manifest {rec.manifest_digest or 'unreadable'}): it is no "
               "longer stored — `flowcheck ls` lists the steps kept")
    return message, rec
