"""Branches of a run: where each committed state lives, which branch is current, what a step reference means.

A step number is not an identity: a rollback or a restart from an older step
commits a second, different state at a step number the run already holds.
(run, step, manifest digest) is the identity; the branch says where it lives:

* the run's first lineage is the branch ``main``, stored at the run root
  (``<run>/step-<N:09d>/``), exactly where a store without branches keeps it;
* a state whose parent already has a later state on its branch (a rollback, a
  restart from an older step, a capture or import into a run that already holds
  higher steps) starts a new branch, stored under ``<run>/branches/<name>/``
  with a ``branch.json`` record naming its fork point.  Nothing ever moves.

The *current* branch is the one whose newest state was committed last.  A step
number resolves along a branch's *path*: its own states, then its parent
branch's up to the fork step, and so on to the root.  This module is a pure
model of those rules (no storage), so they are tested on their own.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from flowcheck.errors import AmbiguousStepError, FlowcheckError, ManifestError, StepNotFoundError
from flowcheck.manifest import ParentRef, canonical_json, now_utc
from flowcheck.state import check_branch  # noqa: F401 - the branch rules' home for readers of this module

MAIN = "main"
BRANCHES = "branches"  # folder under the run root that holds every branch but main
RECORD = "branch.json"


def branch_root(run: str, branch: str) -> str:
    """Where a branch's steps live, relative to a tier's root: ``<run>`` or ``<run>/branches/<name>``."""
    return run if branch == MAIN else f"{run}/{BRANCHES}/{check_branch(branch)}"


@dataclass(frozen=True)
class Fork:
    """Where a branch leaves its parent branch: the state its first state descends from."""

    branch: str | None  # None: the parent state is not stored in this run (restored from elsewhere)
    step: int
    manifest_digest: str


@dataclass(frozen=True)
class BranchRecord:
    """``branches/<name>/branch.json``: a branch's fork point, written before its first state."""

    name: str
    fork: Fork | None  # None: a new root lineage (a capture or import into a run that holds other steps)
    created_at: str

    def to_bytes(self) -> bytes:
        fork = None if self.fork is None else {
            "branch": self.fork.branch, "step": self.fork.step, "manifest_digest": self.fork.manifest_digest}
        return canonical_json({"name": self.name, "fork": fork, "created_at": self.created_at}) + b"\n"

    @classmethod
    def parse(cls, raw: bytes, where: str) -> BranchRecord:
        try:
            body = json.loads(raw)
            fork = body["fork"]
            rec = cls(
                check_branch(body["name"]),
                None if fork is None else Fork(
                    None if fork["branch"] is None else check_branch(fork["branch"]),
                    int(fork["step"]), str(fork["manifest_digest"])),
                str(body["created_at"]),
            )
        except (ValueError, KeyError, TypeError, FlowcheckError) as e:
            raise ManifestError(
                f"{where}: expected a branch record {{name, fork: {{branch, step, manifest_digest}} | null, "
                f"created_at}}, found {raw[:120]!r} ({e})"
            ) from e
        return rec


@dataclass(frozen=True)
class StateInfo:
    """One committed state as a tier lists it."""

    tier: str
    branch: str
    step: int
    digest: str | None  # None: the manifest could not be read (kept, never guessed at)
    parent: ParentRef | None
    created_at: datetime | None
    trusted: bool = True  # False: its signature is missing or wrong where signing is required/on


@dataclass(frozen=True, order=True)
class Located:
    """A resolved reference: the step and branch of one state (``275`` on main, ``275@b250-260`` elsewhere)."""

    step: int
    branch: str = MAIN

    def __str__(self) -> str:
        return str(self.step) if self.branch == MAIN else f"{self.step}@{self.branch}"


def parse_time(raw: str) -> datetime | None:
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except (ValueError, AttributeError):
        return None


class History:
    """Every committed state of one run across tiers, with its branch records."""

    def __init__(self, run: str, states: Iterable[StateInfo], records: dict[str, BranchRecord]) -> None:
        self.run = run
        self.states = list(states)
        self.records = dict(records)
        self._own: dict[str, set[int]] = {}
        for s in self.states:
            self._own.setdefault(s.branch, set()).add(s.step)
        # states no tier can vouch for (unreadable, or failing a required signature): never "latest"
        trusted = {(s.step, s.branch) for s in self.states if s.trusted and s.digest is not None}
        self._doubtful = {(s.step, s.branch) for s in self.states} - trusted

    # ---- structure -------------------------------------------------------
    def branches(self) -> list[str]:
        names = set(self._own) | set(self.records)
        return sorted(names, key=lambda b: (b != MAIN, b))

    def own_steps(self, branch: str) -> list[int]:
        return sorted(self._own.get(branch, ()))

    def fork(self, branch: str) -> Fork | None:
        rec = self.records.get(branch)
        return rec.fork if rec is not None else None

    def last_commit(self, branch: str) -> datetime | None:
        times = [s.created_at for s in self.states if s.branch == branch and s.created_at is not None and s.trusted]
        return max(times, default=None)

    def current(self) -> str:
        """The branch whose newest state was committed last (main when the run is empty)."""
        best, best_key = MAIN, None
        for b in self.branches():
            t = self.last_commit(b)
            if t is None:
                continue
            key = (t, max(self.own_steps(b), default=-1))
            if best_key is None or key > best_key:
                best, best_key = b, key
        return best

    def path(self, branch: str) -> dict[int, str]:
        """step -> the branch holding it, along ``branch``'s lineage back to its root."""
        out: dict[int, str] = {}
        seen: set[str] = set()
        limit: int | None = None
        b: str | None = branch
        while b is not None and b not in seen:
            seen.add(b)
            for s in self.own_steps(b):
                if (limit is None or s <= limit) and s not in out:
                    out[s] = b
            fork = self.fork(b) if b != MAIN else None
            if fork is None:
                break
            limit = fork.step if limit is None else min(limit, fork.step)
            b = fork.branch
        return out

    def head(self, branch: str) -> int | None:
        steps = self.own_steps(branch) or list(self.path(branch))
        return max(steps, default=None)

    def holders(self, step: int) -> list[str]:
        return [b for b in self.branches() if step in self._own.get(b, ())]

    def by_digest(self, digest: str) -> list[Located]:
        return sorted({Located(s.step, s.branch) for s in self.states if s.digest and s.digest.startswith(digest)},
                      key=lambda x: (x.step, x.branch))

    # ---- references --------------------------------------------------------
    def resolve(self, step: int | str, branch: str | None = None) -> Located:
        """``latest`` / a step number on ``branch`` (default: current) / a ``sha256:`` digest prefix."""
        if isinstance(step, str) and step.startswith("sha256:"):
            return self._by_digest_prefix(step, branch)
        b = branch if branch is not None else self.current()
        if branch is not None and branch not in self.branches():
            raise StepNotFoundError(f"run {self.run!r} has no branch {branch!r}; its branches: {self.branches()}")
        path = self.path(b)
        if step == "latest":
            if not path:
                raise StepNotFoundError(f"run {self.run!r} has no committed step on branch {b!r}; "
                                        "run `flowcheck snapshot` or the demo first")
            vouched = [n for n in path if (n, path[n]) not in self._doubtful]
            n = max(vouched or path)
            return Located(n, path[n])
        n = int(step)
        if n in path:
            return Located(n, path[n])
        others = [h for h in self.holders(n) if h != path.get(n)]
        hint = (f"; branch{'es' if len(others) > 1 else ''} {', '.join(others)} of the run hold{'s' if len(others) == 1 else ''} "
                f"a step {n}: add --branch {others[0]}" if others else "")
        raise StepNotFoundError(f"step {n} is not committed on branch {b!r} of run {self.run!r}{hint}")

    def _by_digest_prefix(self, ref: str, branch: str | None) -> Located:
        hits = self.by_digest(ref)
        if branch is not None:
            hits = [h for h in hits if h.branch == branch]
        if not hits:
            raise StepNotFoundError(f"no committed state of run {self.run!r} has a manifest digest starting {ref!r}")
        if len(hits) > 1:
            raise AmbiguousStepError(
                f"manifest digest prefix {ref!r} matches {len(hits)} states of run {self.run!r}: "
                + ", ".join(f"step {h.step} on {h.branch}" for h in hits) + "; give more digits")
        return hits[0]

    # ---- placing a new state -----------------------------------------------
    def place(self, step: int, parent: ParentRef | None) -> tuple[str, BranchRecord | None]:
        """The branch a new state goes to, and the record to write first when it starts a branch.

        It continues its parent's branch when that branch holds nothing after the parent;
        otherwise (a rollback, a restart from an older step) it starts a new branch.
        """
        if not self.states:
            return MAIN, None
        if parent is None:
            return self._new(f"root-{step}", None)
        held = [s for s in self.states if s.digest == parent.manifest_digest]
        pb = held[0].branch if held else None
        if pb is None:  # the parent is not stored here: judge by the branch that holds its step number
            pb = self.path(self.current()).get(parent.step, self.current())
        later = [s for s in self.own_steps(pb) if s > parent.step or s == step]
        if not later:
            return pb, None
        return self._new(f"b{parent.step}-{step}", Fork(pb if held else None, parent.step, parent.manifest_digest))

    def _new(self, base: str, fork: Fork | None) -> tuple[str, BranchRecord]:
        for name, rec in self.records.items():  # a first commit that crashed after writing the record: reuse it
            if rec.fork == fork and not self._own.get(name) and (name == base or name.startswith(base + ".")):
                return name, rec
        name, n = base, 1
        while name in self.records or name in self._own:
            n += 1
            name = f"{base}.{n}"
        return name, BranchRecord(name, fork, now_utc())
