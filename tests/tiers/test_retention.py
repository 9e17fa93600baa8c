"""Retention rules as a pure function: keep-last-N, hourly and daily buckets, never the newest or unclassifiable."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from flowcheck.branches import Located
from flowcheck.config import TierPolicy
from flowcheck.tiers.retention import StepInfo, plan

T0 = datetime(2026, 11, 1, 0, 0, tzinfo=timezone.utc)


def _every(minutes: int, count: int) -> list[StepInfo]:
    return [StepInfo(i, T0 + timedelta(minutes=minutes * i)) for i in range(count)]


def test_keep_last_n_deletes_the_rest():
    p = plan(_every(1, 10), TierPolicy(keep_last=3))
    assert sorted(k.step for k in p.keep) == [7, 8, 9] and p.delete == tuple(Located(i) for i in range(7))


def test_hourly_and_daily_buckets_keep_newest_step_of_each():
    steps = _every(20, 24 * 3 * 9)  # 9 days, three steps an hour
    p = plan(steps, TierPolicy(keep_last=1, keep_hourly=24, keep_daily=7))
    hourly = [k for k, why in p.keep.items() if why.startswith("hourly")]
    daily = [k for k, why in p.keep.items() if why.startswith("daily")]
    assert len(hourly) == 23 and len(daily) == 6  # the newest hour's/day's step is kept as "newest committed"
    assert all(steps[k.step].created_at.minute == 40 for k in hourly)  # last step of each hour
    assert len(p.keep) == 1 + 23 + 6


def test_never_deletes_newest_or_unclassifiable():
    steps = _every(1, 5) + [StepInfo(2_000, None)] + [StepInfo(3, None)]
    steps = [s for s in steps if s.step != 3] + [StepInfo(3, None)]
    p = plan(steps, TierPolicy(keep_last=1))
    assert Located(2_000) in p.keep and Located(3) in p.keep
    assert "unclassifiable" in p.keep[Located(3)]
    # the newest *readable* step is the head: unreadable manifests never push every readable state out
    assert "head" in p.keep[Located(4)]
    assert set(p.delete) == {Located(0), Located(1), Located(2)}


def test_empty_tier_plans_nothing():
    p = plan([], TierPolicy())
    assert p.keep == {} and p.delete == ()


def test_a_clock_stepped_back_never_makes_the_buckets_keep_older_steps_over_newer():
    """Steps 0-5 an hour apart; then the clock is stepped back two days and steps 6-8 are committed. The hourly
    buckets must keep the newest steps, not the old ones whose timestamps now look the newest."""
    steps = [StepInfo(i, T0 + timedelta(hours=i)) for i in range(6)]
    steps += [StepInfo(i, T0 - timedelta(days=2) + timedelta(minutes=i)) for i in range(6, 9)]
    p = plan(steps, TierPolicy(keep_last=1, keep_hourly=2), now=T0 + timedelta(hours=6))
    kept = sorted(k.step for k in p.keep)
    assert kept == [4, 8], kept  # the head, and the newest step of each of the last two hours


def test_a_timestamp_in_the_future_counts_as_now():
    steps = [StepInfo(i, T0 + timedelta(hours=i)) for i in range(5)] + [StepInfo(5, T0 + timedelta(days=30))]
    p = plan(steps, TierPolicy(keep_last=1, keep_hourly=3), now=T0 + timedelta(hours=5))
    assert {k.step for k in p.keep} == {5, 4, 3}
