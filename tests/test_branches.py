"""Branches as a pure model: where a new state goes, what a step reference means, what retention keeps.

No storage here: histories are built from StateInfo values, so every rule of
flowcheck/branches.py and tiers/retention.py is exercised on its own.  The same
rules against a real Store are in tests/test_branches_store.py.
"""
from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone

import pytest

from flowcheck.branches import MAIN, BranchRecord, Fork, History, Located, StateInfo
from flowcheck.config import TierPolicy
from flowcheck.errors import AmbiguousStepError, ManifestError, StepNotFoundError
from flowcheck.manifest import ParentRef
from flowcheck.tiers.retention import StepInfo, plan

T0 = datetime(2026, 11, 1, tzinfo=timezone.utc)
RUN = "r1"


def digest(branch: str, step: int) -> str:
    return "sha256:" + hashlib.sha256(f"{branch}/{step}".encode()).hexdigest()


def ref(branch: str, step: int) -> ParentRef:
    return ParentRef(step, digest(branch, step))


def history(commits: list[tuple[int, str]], records: dict[str, Fork | None] | None = None,
            digests: dict[tuple[int, str], str] | None = None) -> History:
    """A history from commits in commit order (one minute apart); ``records``: branch -> its fork."""
    digests = digests or {}
    states = [StateInfo("local", b, n, digests.get((n, b), digest(b, n)), None, T0 + timedelta(minutes=i))
              for i, (n, b) in enumerate(commits)]
    recs = {name: BranchRecord(name, fork, "2026-11-01T00:00:00.000000Z") for name, fork in (records or {}).items()}
    return History(RUN, states, recs)


B = "b250-260"
ROLLED_BACK = [(250, MAIN), (275, MAIN), (300, MAIN), (260, B), (270, B)]
ROLLED_BACK_FORKS = {B: Fork(MAIN, 250, digest(MAIN, 250))}


@pytest.fixture
def rolled_back() -> History:
    """main 250, 275, 300; then a rollback to 250 committed 260 and 270 on b250-260."""
    return history(ROLLED_BACK, ROLLED_BACK_FORKS)


# ---- current branch and paths -------------------------------------------------------------
def test_the_current_branch_is_the_one_committed_last(rolled_back):
    assert rolled_back.current() == B
    assert history([(1, MAIN), (2, MAIN)]).current() == MAIN
    assert history([]).current() == MAIN
    # a later commit on main makes main current again, whatever the step numbers
    assert history(ROLLED_BACK + [(301, MAIN)], ROLLED_BACK_FORKS).current() == MAIN


def test_a_branch_path_is_its_own_states_and_its_parent_up_to_the_fork(rolled_back):
    assert rolled_back.path(B) == {250: MAIN, 260: B, 270: B}
    assert rolled_back.path(MAIN) == {250: MAIN, 275: MAIN, 300: MAIN}
    assert rolled_back.branches() == [MAIN, B]


def test_a_branch_of_a_branch_stops_at_every_fork_on_the_way_to_main():
    h = history(ROLLED_BACK + [(265, "b260-265")],
                {**ROLLED_BACK_FORKS, "b260-265": Fork(B, 260, digest(B, 260))})
    # 270 (after the fork at 260) and main's 275/300 (after the fork at 250) are not on the path
    assert h.path("b260-265") == {250: MAIN, 260: B, 265: "b260-265"}
    assert h.current() == "b260-265" and h.resolve("latest") == Located(265, "b260-265")


# ---- resolving references ------------------------------------------------------------------
def test_a_step_number_resolves_along_the_current_branch(rolled_back):
    assert rolled_back.resolve(250) == Located(250, MAIN)
    assert rolled_back.resolve(260) == Located(260, B)
    assert rolled_back.resolve("270") == Located(270, B)


def test_latest_is_the_newest_step_of_the_current_branch_not_the_highest_step_number(rolled_back):
    assert rolled_back.resolve("latest") == Located(270, B)
    assert rolled_back.resolve("latest", branch=MAIN) == Located(300, MAIN)


def test_branch_reaches_a_step_of_an_abandoned_branch(rolled_back):
    assert rolled_back.resolve(300, branch=MAIN) == Located(300, MAIN)
    assert rolled_back.resolve(275, branch=MAIN) == Located(275, MAIN)
    assert str(rolled_back.resolve(260)) == "260@b250-260" and str(Located(300)) == "300"


def test_a_step_off_the_current_path_names_the_run_and_the_branch_that_holds_it(rolled_back):
    with pytest.raises(StepNotFoundError) as e:
        rolled_back.resolve(300)
    msg = str(e.value)
    assert "'r1'" in msg and f"branch {B!r}" in msg and "--branch main" in msg


def test_a_step_held_by_several_other_branches_names_them_all():
    h = history([(10, MAIN), (20, MAIN), (15, "b10-15"), (15, "b10-15.2"), (12, "b10-12")],
                {"b10-15": Fork(MAIN, 10, digest(MAIN, 10)), "b10-15.2": Fork(MAIN, 10, digest(MAIN, 10)),
                 "b10-12": Fork(MAIN, 10, digest(MAIN, 10))})
    assert h.current() == "b10-12"
    with pytest.raises(StepNotFoundError, match=r"branches b10-15, b10-15\.2 of the run hold a step 15"):
        h.resolve(15)


def test_an_unknown_branch_or_step_is_a_clear_error(rolled_back):
    with pytest.raises(StepNotFoundError, match=r"run 'r1' has no branch 'nope'; its branches: \['main', 'b250-260'\]"):
        rolled_back.resolve(250, branch="nope")
    with pytest.raises(StepNotFoundError, match=r"step 999 is not committed on branch 'b250-260' of run 'r1'$"):
        rolled_back.resolve(999)
    with pytest.raises(StepNotFoundError, match="run 'r1' has no committed step on branch 'main'"):
        history([]).resolve("latest")


def test_a_digest_prefix_names_one_state_on_any_branch(rolled_back):
    full = digest(MAIN, 300)
    assert rolled_back.resolve(full) == Located(300, MAIN)
    assert rolled_back.resolve(full[:20]) == Located(300, MAIN)
    with pytest.raises(StepNotFoundError, match="no committed state of run 'r1' has a manifest digest starting"):
        rolled_back.resolve("sha256:" + "0" * 64)


def test_an_ambiguous_digest_prefix_lists_every_candidate():
    digests = {(10, MAIN): "sha256:abc1" + "0" * 60, (20, MAIN): "sha256:abc2" + "0" * 60,
               (20, "b10-20"): "sha256:abc3" + "0" * 60}
    h = history([(10, MAIN), (20, MAIN), (20, "b10-20")], {"b10-20": Fork(MAIN, 10, digests[(10, MAIN)])}, digests)
    with pytest.raises(AmbiguousStepError) as e:
        h.resolve("sha256:abc")
    msg = str(e.value)
    assert "matches 3 states of run 'r1'" in msg and "give more digits" in msg
    assert "step 10 on main, step 20 on b10-20, step 20 on main" in msg
    assert h.resolve("sha256:abc", branch="b10-20") == Located(20, "b10-20")  # --branch narrows it
    assert h.resolve("sha256:abc2") == Located(20, MAIN)


def test_a_state_held_by_two_tiers_is_one_candidate_for_its_digest():
    s = StateInfo("local", MAIN, 5, digest(MAIN, 5), None, T0)
    h = History(RUN, [s, StateInfo("object", MAIN, 5, s.digest, None, T0)], {})
    assert h.resolve(digest(MAIN, 5)[:12]) == Located(5, MAIN)


# ---- placing a new state --------------------------------------------------------------------
def test_the_first_state_of_a_run_goes_to_main():
    assert history([]).place(10, None) == (MAIN, None)
    assert history([]).place(10, ParentRef(5, "sha256:" + "1" * 64)) == (MAIN, None)  # restored from elsewhere


def test_the_next_step_continues_its_parent_branch(rolled_back):
    assert history([(1, MAIN), (2, MAIN)]).place(3, ref(MAIN, 2)) == (MAIN, None)
    assert rolled_back.place(280, ref(B, 270)) == (B, None)


def test_a_rollback_starts_a_branch_with_a_fork_record():
    h = history([(250, MAIN), (275, MAIN), (300, MAIN)])
    name, record = h.place(260, ref(MAIN, 250))
    assert name == "b250-260" and record.name == name
    assert record.fork == Fork(MAIN, 250, digest(MAIN, 250))
    assert BranchRecord.parse(record.to_bytes(), "test") == record  # the record round-trips


def test_a_rollback_on_a_branch_forks_that_branch(rolled_back):
    name, record = rolled_back.place(265, ref(B, 260))
    assert name == "b260-265" and record.fork == Fork(B, 260, digest(B, 260))


def test_a_second_state_at_the_parent_branch_head_step_starts_a_branch():
    h = history([(1, MAIN), (2, MAIN)])
    name, record = h.place(2, ref(MAIN, 1))  # a different state 2 from the same parent: never overwrites
    assert name == "b1-2" and record.fork == Fork(MAIN, 1, digest(MAIN, 1))


def test_a_restart_from_the_newest_state_continues_its_branch():
    h = history([(250, MAIN), (275, MAIN), (300, MAIN)])
    assert h.place(310, ref(MAIN, 300)) == (MAIN, None)


def test_a_parentless_state_in_a_non_empty_run_starts_a_root_branch():
    name, record = history([(250, MAIN)]).place(7, None)
    assert name == "root-7" and record.fork is None
    assert BranchRecord.parse(record.to_bytes(), "test").fork is None


def test_a_parent_stored_elsewhere_is_judged_by_the_step_it_names():
    h = history([(250, MAIN), (300, MAIN)])
    foreign = ParentRef(275, "sha256:" + "f" * 64)  # pruned here, or restored from another store
    name, record = h.place(280, foreign)
    assert name == "b275-280" and record.fork == Fork(None, 275, foreign.manifest_digest)
    assert h.place(310, ParentRef(300, "sha256:" + "f" * 64)) == (MAIN, None)


def test_the_same_fork_twice_gets_a_new_name_each_time():
    h = history([(250, MAIN), (275, MAIN), (300, MAIN), (260, B)], {B: ROLLED_BACK_FORKS[B]})
    assert h.place(260, ref(MAIN, 250))[0] == "b250-260.2"
    h2 = history([(250, MAIN), (275, MAIN), (300, MAIN), (260, B), (260, "b250-260.2")],
                 {B: ROLLED_BACK_FORKS[B], "b250-260.2": ROLLED_BACK_FORKS[B]})
    assert h2.place(260, ref(MAIN, 250))[0] == "b250-260.3"
    # a branch folder without a record (written by hand, record lost) still reserves its name
    h3 = history([(250, MAIN), (275, MAIN), (260, B)])
    assert h3.place(260, ref(MAIN, 250))[0] == "b250-260.2"


# ---- retention along branches ---------------------------------------------------------------
def _infos(commits: list[tuple[int, str, bool]], abandoned: dict[str, datetime] | None = None) -> list[StepInfo]:
    """StepInfos in commit order, one minute apart; (step, branch, on the current path)."""
    abandoned = abandoned or {}
    return [StepInfo(n, T0 + timedelta(minutes=i), b, on, None if on else abandoned.get(b, T0 + timedelta(minutes=i)))
            for i, (n, b, on) in enumerate(commits)]


def _rolled_back_infos() -> list[StepInfo]:
    """main 1..10; a rollback to 5 committed 6, 7, 8 on b5-6 (main 6..10 abandoned, last commit at T0+9 min)."""
    main = [(n, MAIN, n <= 5) for n in range(1, 11)]
    return _infos(main + [(n, "b5-6", True) for n in (6, 7, 8)], {MAIN: T0 + timedelta(minutes=9)})


def test_keep_last_counts_along_the_current_path_not_by_step_number():
    p = plan(_rolled_back_infos(), TierPolicy(keep_last=3), now=T0 + timedelta(hours=1))
    for n in (6, 7, 8):
        assert p.keep[Located(n, "b5-6")] in ("last 3", "head of the current branch")
    assert p.keep[Located(8, "b5-6")] == "head of the current branch"
    # main 1..5 are on the path but older than the last three of it
    assert {k for k in p.delete} == {Located(n) for n in range(1, 6)}
    assert all(p.why_deleted[Located(n)] == "superseded on the current branch" for n in range(1, 6))


def test_an_abandoned_branch_is_kept_within_its_grace():
    p = plan(_rolled_back_infos(), TierPolicy(keep_last=3), now=T0 + timedelta(hours=23))
    for n in range(6, 11):
        assert p.keep[Located(n)] == "abandoned branch main until 2026-11-02T00:09:00Z"


def test_an_abandoned_branch_past_its_grace_is_deleted_with_a_reason_naming_it():
    policy = TierPolicy(keep_last=3, keep_abandoned_hours=2)
    p = plan(_rolled_back_infos(), policy, now=T0 + timedelta(hours=2, minutes=10))
    assert {Located(n) for n in range(6, 11)} <= set(p.delete)
    assert p.why_deleted[Located(10)] == "abandoned branch main (no commit for 2 h)"
    # the grace counts from the branch's last commit, not each state's own time
    early = plan(_rolled_back_infos(), policy, now=T0 + timedelta(hours=2, minutes=5))
    assert all(Located(n) in early.keep for n in range(6, 11))


def test_the_head_and_anything_committed_after_it_are_never_deleted():
    late = T0 + timedelta(days=1)
    infos = _infos([(1, MAIN, True), (2, MAIN, True), (3, MAIN, True)]) + [
        StepInfo(5, late, "x", False, late), StepInfo(4, late - timedelta(minutes=1), "x", False, late)]
    p = plan(infos, TierPolicy(keep_last=1, keep_abandoned_hours=0), now=late + timedelta(days=100))
    assert p.keep[Located(3)] == "head of the current branch"
    assert p.keep[Located(5, "x")] == "committed after the current head"
    assert p.keep[Located(4, "x")] == "committed after the current head"
    assert set(p.delete) == {Located(1), Located(2)}


def test_an_unreadable_manifest_never_counts_toward_keep_last_nor_is_deleted():
    infos = _infos([(n, MAIN, True) for n in range(1, 6)]) + [
        StepInfo(6, None, MAIN, True), StepInfo(7, None, MAIN, True), StepInfo(9, None, "x", False)]
    p = plan(infos, TierPolicy(keep_last=2, keep_abandoned_hours=0), now=T0 + timedelta(days=30))
    assert p.keep[Located(4)] == "last 2" and p.keep[Located(5)] == "head of the current branch"
    for k in (Located(6), Located(7), Located(9, "x")):
        assert p.keep[k].startswith("unclassifiable")
    assert set(p.delete) == {Located(1), Located(2), Located(3)}


def test_time_buckets_count_along_the_current_path_only():
    # hourly buckets: main's abandoned states are newer per hour but are not on the path
    infos = [StepInfo(n, T0 + timedelta(hours=n), MAIN, n <= 2, T0 + timedelta(hours=4)) for n in range(1, 5)]
    infos += [StepInfo(10 + n, T0 + timedelta(hours=4 + n), "b2-11", True) for n in (1, 2)]
    p = plan(infos, TierPolicy(keep_last=1, keep_hourly=24, keep_abandoned_hours=0), now=T0 + timedelta(days=2))
    assert set(p.delete) == {Located(3), Located(4)}
    assert all(why.startswith("abandoned branch main") for why in p.why_deleted.values())
    assert p.keep[Located(1)].startswith("hourly") and p.keep[Located(2)].startswith("hourly")


def test_branch_record_bytes_are_pinned():
    """branches/<name>/branch.json is part of the on-disk contract: its exact bytes are pinned."""
    rec = BranchRecord("b250-260", Fork(MAIN, 250, "sha256:" + "ab" * 32), "2026-12-01T00:00:00.000000Z")
    raw = rec.to_bytes()
    assert raw == (b'{"created_at":"2026-12-01T00:00:00.000000Z","fork":{"branch":"main","manifest_digest":"sha256:'
                   + b"ab" * 32 + b'","step":250},"name":"b250-260"}\n')
    assert BranchRecord.parse(raw, "x") == rec
    root = BranchRecord("root-7", None, "2026-12-01T00:00:00.000000Z")
    assert root.to_bytes() == b'{"created_at":"2026-12-01T00:00:00.000000Z","fork":null,"name":"root-7"}\n'


@pytest.mark.parametrize("raw", [b"", b"[]", b'{"name":"../x","fork":null,"created_at":""}',
                                 b'{"name":"b1","fork":{"step":"x"},"created_at":""}'])
def test_a_malformed_branch_record_is_a_clear_error(raw):
    with pytest.raises(ManifestError, match="expected a branch record"):
        BranchRecord.parse(raw, "local tier r/branches/b1/branch.json")
