"""Retention: which committed steps a tier keeps (keep-last-N plus hourly and daily buckets).

A pure function of (step, created_at) pairs and a TierPolicy, so the rules are
tested without any storage.  A step whose time cannot be read is kept: GC never
deletes what it cannot classify, and never the newest committed step.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from flowcheck.config import TierPolicy


@dataclass(frozen=True)
class StepInfo:
    step: int
    created_at: datetime | None  # None: the manifest could not be read


@dataclass(frozen=True)
class RetentionPlan:
    keep: dict[int, str]  # step -> why it is kept
    delete: tuple[int, ...]


def parse_time(raw: str) -> datetime | None:
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except (ValueError, AttributeError):
        return None


def plan(steps: list[StepInfo], policy: TierPolicy) -> RetentionPlan:
    ordered = sorted(steps, key=lambda s: s.step)
    keep: dict[int, str] = {}
    for s in ordered:
        if s.created_at is None:
            keep[s.step] = "unclassifiable (manifest unreadable)"
    if ordered:
        keep.setdefault(ordered[-1].step, "newest committed")
    for s in ordered[-policy.keep_last:]:
        keep.setdefault(s.step, f"last {policy.keep_last}")
    timed = [s for s in ordered if s.created_at is not None]
    _bucket(timed, policy.keep_hourly, "%Y-%m-%dT%H", "hourly", keep)
    _bucket(timed, policy.keep_daily, "%Y-%m-%d", "daily", keep)
    return RetentionPlan(keep, tuple(s.step for s in ordered if s.step not in keep))


def _bucket(timed: list[StepInfo], count: int, fmt: str, label: str, keep: dict[int, str]) -> None:
    """Keep the newest step of each of the ``count`` most recent time buckets that hold a step."""
    if count <= 0:
        return
    newest: dict[str, int] = {}
    for s in timed:
        key = s.created_at.strftime(fmt)
        newest[key] = max(newest.get(key, -1), s.step)
    for key in sorted(newest, reverse=True)[:count]:
        keep.setdefault(newest[key], f"{label} {key}")
