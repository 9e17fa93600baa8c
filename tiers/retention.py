"""Retention: which committed states a tier keeps (keep-last-N and time buckets along the current branch).

A pure function of the tier's states and a TierPolicy, so the rules are tested
without any storage.  Keep-last-N and the hourly/daily buckets count along the
current branch's path (flowcheck/branches.py); the current head and anything
committed after it are never deleted; a state of an abandoned branch (one a
rollback left) is kept ``keep_abandoned_hours`` after that branch's last commit.
A state whose time cannot be read is kept: GC never deletes what it cannot classify.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone

from flowcheck.branches import MAIN, Located, parse_time
from flowcheck.config import TierPolicy

__all__ = ["StepInfo", "RetentionPlan", "plan", "parse_time"]


@dataclass(frozen=True)
class StepInfo:
    step: int
    created_at: datetime | None  # None: the manifest could not be read
    branch: str = MAIN
    on_path: bool = True  # on the current branch's path; False: a state of an abandoned branch
    abandoned_at: datetime | None = None  # off the path: the last commit of its branch off the path

    @property
    def key(self) -> Located:
        return Located(self.step, self.branch)


@dataclass(frozen=True)
class RetentionPlan:
    keep: dict[Located, str]  # state -> why it is kept
    delete: tuple[Located, ...]
    why_deleted: dict[Located, str]


def plan(steps: list[StepInfo], policy: TierPolicy, now: datetime | None = None) -> RetentionPlan:
    now = now or datetime.now(timezone.utc)
    keep: dict[Located, str] = {}
    for s in steps:
        if s.created_at is None:
            keep[s.key] = "unclassifiable (manifest unreadable)"
    # unreadable states are kept above, and count neither as the head nor toward keep-last-N: a damaged
    # manifest must not push every readable state out. Times: see _monotone
    path = _monotone(sorted((s for s in steps if s.on_path and s.created_at is not None), key=lambda s: s.step), now)
    off = [replace(s, created_at=min(s.created_at, now)) for s in steps if not s.on_path and s.created_at is not None]
    if path:
        keep.setdefault(path[-1].key, "head of the current branch")
        for s in off:
            if s.created_at > path[-1].created_at:
                keep.setdefault(s.key, "committed after the current head")
    if path or off:
        keep.setdefault(max(path + off, key=lambda s: (s.created_at, s.step)).key, "newest committed")
    for s in path[-policy.keep_last:]:
        keep.setdefault(s.key, f"last {policy.keep_last}")
    _bucket(path, policy.keep_hourly, "%Y-%m-%dT%H", "hourly", keep)
    _bucket(path, policy.keep_daily, "%Y-%m-%d", "daily", keep)
    why_deleted: dict[Located, str] = {}
    grace = timedelta(hours=policy.keep_abandoned_hours)
    for s in steps:
        if s.key in keep:
            continue
        if s.on_path:
            why_deleted[s.key] = "superseded on the current branch"
            continue
        since = s.abandoned_at or s.created_at
        if since is None or now - since < grace:
            until = "" if since is None else f" until {(since + grace).strftime('%Y-%m-%dT%H:%M:%SZ')}"
            keep[s.key] = f"abandoned branch {s.branch}{until}"
        else:
            why_deleted[s.key] = f"abandoned branch {s.branch} (no commit for {policy.keep_abandoned_hours:g} h)"
    delete = tuple(sorted(why_deleted, key=lambda k: (k.step, k.branch)))
    return RetentionPlan(keep, delete, why_deleted)


def _monotone(path: list[StepInfo], now: datetime) -> list[StepInfo]:
    """The path's commit times as the buckets see them: never after ``now`` and never earlier than a smaller
    step's along the path — a clock stepped back (or a host running ahead) must not make a newer state look
    older and let the buckets keep an older one in its place."""
    out, latest = [], None
    for s in path:  # ordered by step: the commit order along one lineage
        t = min(s.created_at, now)
        latest = t if latest is None else max(latest, t)
        out.append(replace(s, created_at=latest))
    return out


def _bucket(timed: list[StepInfo], count: int, fmt: str, label: str, keep: dict[Located, str]) -> None:
    """Keep the newest step of each of the ``count`` most recent time buckets that hold a step."""
    if count <= 0:
        return
    newest: dict[str, StepInfo] = {}
    for s in timed:
        k = s.created_at.strftime(fmt)
        if k not in newest or s.step > newest[k].step:
            newest[k] = s
    for k in sorted(newest, reverse=True)[:count]:
        keep.setdefault(newest[k].key, f"{label} {k}")
