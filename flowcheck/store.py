"""The store: one run's tiers together — snapshot RAM to local, promote local to object, read, GC.

Rules kept here, once: the lineage parent of a new step is what the RAM state
descends from; a new state goes to the branch its parent continues, or starts a
branch (flowcheck/branches.py) — never dropped, never overwriting; "latest" and
GC follow the current branch and only a durable commit; GC never deletes the
current head, nor anything it cannot classify.
"""
from __future__ import annotations

import logging
import os
import threading
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from flowcheck import config as config_mod
from flowcheck import identity, pruning, tier_check
from flowcheck.branches import MAIN, BranchRecord, History, Located, StateInfo, parse_time
from flowcheck.config import Config
from flowcheck.errors import FlowcheckError, ManifestError, StepNotFoundError, StepPrunedError, TierError
from flowcheck.listing import Listing, tier_rows
from flowcheck.manifest import Manifest, ParentRef, signing_key
from flowcheck.progress import Progress
from flowcheck.pruning import DeleteReport, GcReport
from flowcheck.state import Snapshot, check_branch
from flowcheck.tier_check import TierState
from flowcheck.tiers import fallback
from flowcheck.tiers.base import Tier, with_origin
from flowcheck.tiers.local import LocalTier
from flowcheck.tiers.memory import MemoryTier
from flowcheck.tiers.records import PrunedRecord

log = logging.getLogger(__name__)

TIER_NAMES = ("memory", "local", "object")
__all__ = ["Store", "open_store", "GcReport", "DeleteReport", "TierState", "PrunedRecord"]


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
        self._branch_tiers: dict[tuple[str, str], Tier] = {}
        self._seen: dict[str, tuple[list[StateInfo], dict[str, BranchRecord]]] = {}  # tier -> its last listing
        # one writer per target tier: a slow upload never holds up local snapshots
        self._locks = {name: threading.RLock() for name in TIER_NAMES}
        self._in_use: set[tuple[str, Located]] = set()  # (tier, step) being read by a promotion: GC skips them
        self._unrecorded: bool | None = None  # None: this config's identity not yet checked against the run's
        self._read_checked = False  # whether reads were checked against the run's identity (a warning, once)

    def writing(self, tier: str) -> AbstractContextManager:
        """The tier's write lock: held by every writer, GC and delete of this store (re-entrant)."""
        return self._locks[tier]

    def promoting(self, tier: str, at: Located) -> bool:
        """Whether a promotion is reading this state from ``tier`` now (GC and delete leave it)."""
        return (tier, at) in self._in_use

    def bind(self) -> None:
        """Before anything that writes or deletes: the run is this experiment's (flowcheck/identity.py), or
        RunIdentityError naming the experiment it belongs to."""
        if self._unrecorded is None:
            self._unrecorded = identity.claim(self.config, self.local)

    def _bound(self) -> None:
        """After a write: the run's identity is this config's (recorded once)."""
        if self._unrecorded:
            identity.record(self.config, self.local)
            self._unrecorded = False

    @property
    def object(self) -> Tier | None:
        """The object tier, opened on first use (s3fs and the network load only when needed)."""
        cfg = self.config.tiers.object
        if self._object is None and cfg.enabled:
            from flowcheck.tiers.object import ObjectTier

            staging = cfg.staging_dir or os.path.join(self.config.tiers.local.root, ".staging")
            self._object = ObjectTier(cfg, self.config.run, staging_dir=staging, progress=self.progress,
                                      cluster=self.config.cluster, grace_s=self.config.policy.object.tmp_grace_seconds,
                                      own_staging=not cfg.staging_dir, **self._tier_kw)
        return self._object

    def tiers(self, include_memory: bool = True) -> list[Tier]:
        """Present tiers (their main-branch view), fastest first."""
        out: list[Tier] = [self.memory] if include_memory else []
        out.append(self.local)
        if self.object is not None:
            out.append(self.object)
        return out

    def tier(self, name: str, branch: str = MAIN) -> Tier:
        """A tier by name, opened at a branch (``main``: the run root)."""
        for t in self.tiers():
            if t.name == name:
                if branch == MAIN or t is self.memory:
                    return t
                key = (name, check_branch(branch))
                if key not in self._branch_tiers:
                    self._branch_tiers[key] = t.at_branch(branch)
                return self._branch_tiers[key]
        raise ValueError(f"unknown or disabled tier {name!r}; expected one of {[t.name for t in self.tiers()]}")

    def branch_tiers(self, name: str) -> list[Tier]:
        """Every branch of one persistent tier: main first."""
        main = self.tier(name)
        return [main] + [self.tier(name, b) for b in main.branch_names()]

    # ---- history -------------------------------------------------------------------
    def history(self, tiers: list[str] | None = None, *, live: set[str] | None = None) -> History:
        """Every committed state of the run in the persistent tiers (or those named), with its branch.

        ``live``: only these tiers are listed now; the others contribute what they held when last listed
        (nothing if never), so a local snapshot never waits on a slow or unreachable object store."""
        states: list[StateInfo] = []
        records: dict[str, BranchRecord] = {}
        for t in self.tiers(include_memory=False):
            if tiers is not None and t.name not in tiers:
                continue
            if live is not None and t.name not in live:
                seen = self._seen.get(t.name, ([], {}))
            else:
                try:
                    seen = self._seen[t.name] = self._scan(t.name)
                except TierError:
                    if live is None or t.name in live:
                        raise
                    seen = self._seen.get(t.name, ([], {}))
            states += seen[0]
            for name, rec in seen[1].items():
                records.setdefault(name, rec)
        return History(self.config.run, states, records)

    def _scan(self, name: str) -> tuple[list[StateInfo], dict[str, BranchRecord]]:
        states: list[StateInfo] = []
        records: dict[str, BranchRecord] = {}
        for bt in self.branch_tiers(name):
            if bt.branch != MAIN:
                try:
                    rec = bt.branch_record()
                except FlowcheckError as e:
                    log.warning("%s", e)
                    rec = None
                if rec is not None:
                    records[bt.branch] = rec
            states += [_state_info(bt, step) for step in bt.steps()]
        return states, records

    # ---- writing ---------------------------------------------------------------
    def push(self, snapshot: Snapshot) -> Manifest:
        """Replace the RAM state with a full snapshot (trainer push / resync / restore)."""
        return self.memory.write(snapshot, self.memory.head)

    def snapshot(self) -> Manifest:
        """Persist the current RAM state to the local tier (step-consistent while updates continue)."""
        with self._locks["local"]:
            snap = self.memory.pin()
            try:
                m = self.commit(snap, "local", self.memory.head)
                self.memory.learn(snap, m)  # the next snapshot hashes only the shards written after this pin
            finally:
                self.memory.release(snap)
            self.memory.descends_from(m.parent_ref())  # the RAM state now descends from this committed step
            return m

    def write(self, snapshot: Snapshot, tier: str = "local", parent: ParentRef | None = None, *, root: bool = False,
              progress: Progress | None = None) -> Manifest:
        """Commit a snapshot directly to a tier; without ``parent`` it continues the current branch
        (its head, when that is an earlier step; ``root=True``: no parent, e.g. an imported checkpoint
        starts its own lineage); ``progress`` counts bytes."""
        with self._locks[tier]:
            if parent is None and snapshot.origin is None and not root:
                parent = self._current_head_before(snapshot.step)
            return self.commit(snapshot, tier, parent, progress=progress)

    def head_before(self, step: int) -> ParentRef | None:
        """The current branch's newest state before ``step``: what a plain ``write`` at ``step`` descends from."""
        return self._current_head_before(step)

    def placement(self, step: int, tier: str, parent: ParentRef | None) -> Tier:
        """The tier opened at the branch a new state at ``step`` descending from ``parent`` goes to (the rule of
        ``commit``, flowcheck/branches.py), that branch's fork record written first when the state starts one.
        For writers that store a state in pieces instead of through ``commit`` (flowcheck/dcp: a part per rank)."""
        self.bind()
        with self._locks[tier]:
            listed = self._unbranched()
            if listed is not None and not any(parent is None or n > parent.step or n == step
                                              for _, steps in listed for n in steps):
                return self.tier(tier)  # main holds nothing after the parent: the state continues main
            live = {tier} | {t.name for t, _ in listed or ()}  # every tier just listed counts as it is now
            branch, record = self.history(live=live).place(step, parent)
            target = self.tier(tier, branch)
            if record is not None:
                target.put_branch_record(record)
            self._bound()
            return target

    def commit(self, snapshot: Snapshot, tier: str, parent: ParentRef | None, *,
               progress: Progress | None = None, hist: History | None = None) -> Manifest:
        """Commit a state to the branch it belongs on (flowcheck/branches.py).

        The same state already committed at its step is a no-op (retries, promotions); a different state
        at an existing step is never dropped or overwritten: it goes to a new branch. ``hist``: a listing
        the caller just took with ``tier`` live, under its lock (not listed again).
        """
        self.bind()
        with self._locks[tier]:
            hist = hist or self.history(live={tier})
            if snapshot.origin is not None:  # a stored state copied between tiers keeps its branch
                branch, record = self._origin_branch(hist, snapshot.origin)
            else:
                same = self._same_state(hist, snapshot)
                if same is not None:
                    at, origin = same
                    held = self.tier(tier, at.branch)
                    if at.step in held.steps():
                        log.info("%s tier: step %s %s", tier, at, _same_state_note(hist, at))
                        return held.manifest(at.step)
                    # held by another tier only (RAM restored from it): copy it with its identity, as a
                    # promotion does; a second manifest (parent: itself) would split one state in two
                    snapshot, parent = with_origin(snapshot, origin), origin.parent
                    branch, record = at.branch, hist.records.get(at.branch)
                else:
                    branch, record = hist.place(snapshot.step, parent)
            target = self.tier(tier, branch)
            if record is not None:
                target.put_branch_record(record)
            if record is not None and record.name not in hist.records:
                log.info("%s tier: step %d starts branch %s (fork: %s)", tier, snapshot.step, branch, record.fork)
            elif branch != MAIN and branch not in hist.records:
                log.warning("%s tier: branch %s has no fork record; audit will report it", tier, branch)
            m = target.write(snapshot, parent, progress=progress)
            self._bound()
            return m

    def _origin_branch(self, hist: History, origin: Manifest) -> tuple[str, BranchRecord | None]:
        held = hist.by_digest(origin.digest())
        if held:
            return held[0].branch, hist.records.get(held[0].branch)
        return hist.place(origin.step, origin.parent)  # read from elsewhere (another store, an export)

    def _same_state(self, hist: History, snapshot: Snapshot) -> tuple[Located, Manifest] | None:
        """A committed state at the snapshot's step holding the same data and scalars, and its manifest, if any."""
        if not any(s.step == snapshot.step and s.digest is not None for s in hist.states):
            return None
        from flowcheck.digest import data_digest
        from flowcheck.tiers import row_blocks

        # the local tier may store large shards as row blocks: the same state then lists the blocks' boxes
        blocked = row_blocks.split(snapshot, self.config.tiers.local.row_block_bytes)
        views = [snapshot] if blocked is snapshot else [snapshot, blocked]
        boxes: list[set | None] = [None] * len(views)
        scalars, layout_digest = snapshot.scalars.to_json(), snapshot.layout.digest()
        for c in [s for s in hist.states if s.step == snapshot.step and s.digest is not None]:
            try:
                m = self.tier(c.tier, c.branch).manifest(c.step, check_signature=False)
            except StepNotFoundError:
                continue  # listed when the tier was last listed (not live now), deleted since: not a state any more
            if dict(m.scalars) != scalars or m.layout_digest != layout_digest:
                continue
            for i, view in enumerate(views):
                if boxes[i] is None:  # hashed once, and only when a candidate's scalars and layout match
                    boxes[i] = {(sh.tensor, sh.offsets, sh.shape, data_digest(view.array(sh))) for sh in view.shards()}
                if _same_data(m, boxes[i], scalars, layout_digest):
                    return Located(c.step, c.branch), m
        return None

    def committed_same_state(self, m: Manifest, tier: str) -> Manifest | None:
        """The manifest of a state committed in ``tier`` (any branch) at ``m``'s step with the same data (shard
        digests), scalars and layout as manifest ``m`` — for writers that store a state in pieces before they can
        compare it (flowcheck/dcp: an identical re-save is then a no-op, as ``commit`` makes it).  Only the
        branches whose listing holds the step are read: a save at a new step number costs one listing per branch."""
        ours = {(name, e.offsets, e.shape, e.digest) for name, t in m.tensors.items() for e in t.shards}
        for bt in self.branch_tiers(tier):
            if m.step not in bt.steps():
                continue
            try:
                theirs = bt.manifest(m.step, check_signature=False)
            except FlowcheckError:
                continue  # deleted since it was listed, or unreadable: not a state to be the same as
            if _same_data(theirs, ours, dict(m.scalars), m.layout_digest):
                return theirs
        return None

    def _current_head_before(self, step: int) -> ParentRef | None:
        """The current branch's newest state before ``step`` (a plain write continues it)."""
        listed = self._unbranched()
        if listed is not None:  # main is the current branch: its newest listed step before this one
            n = max((n for _, steps in listed for n in steps if n < step), default=None)
            if n is None:
                return None
            try:
                holder = next(t for t, steps in listed if n in steps)
                return ParentRef(n, holder.manifest(n, check_signature=False).digest())
            except FlowcheckError:
                pass  # unreadable: the history decides, and says why
        hist = self.history()
        path = hist.path(hist.current())
        earlier = [s for s in path if s < step]
        if not earlier:
            return None
        at = Located(max(earlier), path[max(earlier)])
        info = next(s for s in hist.states if s.step == at.step and s.branch == at.branch)
        if info.digest is None:
            return None
        return ParentRef(at.step, info.digest)

    def promote(self, step: int | str | None = None, src: str = "local", dst: str = "object", *,
                branch: str | None = None, progress: Progress | None = None) -> Manifest:
        """Copy a committed state from one tier to another (default: the newest local state of the current
        branch to object); ``progress`` counts the bytes written (left at zero when the target holds it)."""
        with self._locks[src]:
            hist = self.history(live={src})
            ref = "latest" if step is None else step
            try:
                at = hist.resolve(ref, branch)
            except StepNotFoundError as e:
                raise self._not_held(src, ref, branch, e) from None
            source = self.tier(src, at.branch)
            if at.step not in source.steps():
                raise StepNotFoundError(f"{src} tier has no committed step {at} of run {self.config.run!r} to promote")
            snap = source.load(at.step)  # raises StepNotFoundError before anything is written
            self._in_use.add((src, at))
        try:
            with self._locks[dst]:
                try:  # one listing of the target: whether it holds the state, and where a new one goes
                    hist = self.history(live={dst})
                except TierError as e:  # the same kind (TierMissingError, TierAccessError), with what it means here
                    raise type(e)(f"{dst} tier: step {at} was not promoted (nothing of it was written): {e}") from e
                if any(s.tier == dst and Located(s.step, s.branch) == at for s in hist.states):
                    return self.tier(dst, at.branch).manifest(at.step)
                return self.commit(snap, dst, snap.origin.parent if snap.origin else None, progress=progress,
                                   hist=hist)
        finally:
            self._in_use.discard((src, at))

    def _not_held(self, src: str, ref: int | str, branch: str | None, e: StepNotFoundError) -> StepNotFoundError:
        """Why a promotion has nothing to copy, naming the tiers that do hold the state when another one does."""
        hist = self.history()
        try:
            at = hist.resolve(ref, branch)
        except StepNotFoundError:
            return e
        holders = sorted({s.tier for s in hist.states if Located(s.step, s.branch) == at})
        return StepNotFoundError(f"step {at} of run {self.config.run!r} is not committed in {src} (held by: "
                                 f"{', '.join(holders)}): a promotion copies from {src}; nothing to promote")

    # ---- reading ---------------------------------------------------------------
    def locate(self, step: int | str, prefer: str = "auto", branch: str | None = None) -> tuple[Tier, int]:
        """The fastest tier holding a state, opened at its branch, and its step number (where it is; to read it,
        ``open_step``).

        ``step``: a number or ``latest`` (on ``branch``, default the current branch: see flowcheck/branches.py)
        or a ``sha256:`` manifest-digest prefix. A state that was deleted on purpose raises StepPrunedError
        (a StepNotFoundError) saying when and by what."""
        if not self._read_checked:
            self._read_checked = True
            identity.warn_if_foreign(self.config, self.local)
        tiers = self.tiers() if prefer == "auto" else [self.tier(prefer)]
        found = self._on_unbranched_main(step, branch, tiers)
        if found is not None:
            return found
        hist = self.history()
        mem = self.memory
        if self.memory in tiers and mem.step is not None and mem.head is not None and branch is None and step == "latest":
            path = hist.path(hist.current())
            if not path or (mem.step > max(path) and any(s.digest == mem.head.manifest_digest for s in hist.states)):
                return mem, mem.step
        at = self.resolve(step, branch, hist)
        for t in tiers:
            if t is mem:
                if mem.step == at.step and mem.head is not None and any(
                        s.digest == mem.head.manifest_digest and Located(s.step, s.branch) == at for s in hist.states):
                    return mem, at.step
                continue
            bt = self.tier(t.name, at.branch)
            if at.step in bt.steps():
                return bt, at.step
        holders = sorted({s.tier for s in hist.states if Located(s.step, s.branch) == at})
        gone = [r.describe() for r in (self.tier(prefer, at.branch).pruned_entries() if prefer in ("local", "object")
                                       else ()) if r.step == at.step]
        raise StepNotFoundError(
            f"step {at} of run {self.config.run!r} is not committed in {prefer if prefer != 'auto' else 'any tier'}"
            f"{' (held by: ' + ', '.join(holders) + ')' if holders else ''}"
            f"{'; the ' + prefer + ' tier copy was ' + gone[-1] if gone else ''}")

    def _on_unbranched_main(self, step: int | str, branch: str | None, tiers: list[Tier]) -> tuple[Tier, int] | None:
        """``locate`` for a run that never branched (no tier holds a branch), from the tiers' listings instead of
        every stored manifest (a DCP load asks on every rank): a step number is main's step of that number;
        ``latest`` the highest step, when a copy of its manifest reads and passes the signature rule (else the
        history decides which to vouch for).  None: ask the history (RAM holds a state, a branch exists, the step
        is not listed, an error)."""
        number = isinstance(step, int) and not isinstance(step, bool)
        listed = self._unbranched() if (number or step == "latest") and branch in (None, MAIN) else None
        if listed is None:
            return None
        n = step if number else max((n for _, steps in listed for n in steps), default=None)
        if n is None or not number and not self._vouched([t for t, steps in listed if n in steps], n):
            return None
        holders = {t.name for t, steps in listed if n in steps}
        return next(((t, n) for t in tiers if t is not self.memory and t.name in holders), None)

    def _unbranched(self) -> list[tuple[Tier, list[int]]] | None:
        """Each persistent tier and its listed steps, when the run never branched (no tier holds a branch) and RAM
        holds no state: every stored state is then main's, and the listings answer what the history would without
        parsing every stored manifest (a DCP save plans, and a DCP load resolves, on every call).  None: ask the
        history (a branch exists, RAM holds a state, a listing failed)."""
        if self.memory.step is not None:
            return None
        try:
            stored = self.tiers(include_memory=False)
            if any(t.branch_names() for t in stored):
                return None
            return [(t, t.steps()) for t in stored]
        except FlowcheckError:
            return None

    def _absent(self) -> str:
        """The configured tier folders that do not exist, as a note for "nothing stored" (a mistyped path reads as
        an empty store otherwise)."""
        try:
            missing = [f"{t.tier} folder {t.where} does not exist" for t in self.check_tiers() if not t.created]
        except FlowcheckError as e:  # a folder and its parent missing, a bucket that does not exist: say that
            return f" ({e})"
        return f" ({'; '.join(missing)})" if missing else ""

    @staticmethod
    def _vouched(holders: list[Tier], step: int) -> bool:
        """Whether a tier holding the step can vouch for it, as the history counts it (its manifest reads and
        passes the signature rule); the manifest stays in that tier's cache for the read that follows."""
        for t in holders:
            try:
                t.manifest(step)
                return True
            except FlowcheckError:
                continue
        return False

    def resolve(self, step: int | str, branch: str | None = None, hist: History | None = None) -> Located:
        """The state a reference names (``History.resolve``), with the errors saying more: another run of the
        store holds that step (add --run), or the state was deleted on purpose (StepPrunedError)."""
        hist = hist or self.history()
        try:
            if not hist.states:
                what = "any step" if step == "latest" else f"step {step}"
                raise StepNotFoundError(f"run {self.config.run!r} has no committed step in any tier{self._absent()} "
                                        f"(asked for {what}); run `flowcheck snapshot` or the demo first")
            return hist.resolve(step, branch)
        except StepNotFoundError as e:
            gone = pruning.pruned_message(self, step, branch)
            if gone is not None:
                raise StepPrunedError(*gone) from None
            elsewhere = self._other_runs_holding(step)
            if not elsewhere:
                raise
            raise type(e)(f"{e}; run{'s' if len(elsewhere) > 1 else ''} {', '.join(elsewhere)} of this store "
                          f"hold{'s' if len(elsewhere) == 1 else ''} a step {step}: add --run {elsewhere[0]}") from None

    def open_step(self, step: int | str, prefer: str = "auto", branch: str | None = None, *,
                  at: tuple[Tier, int] | None = None) -> tuple[Tier, Manifest]:
        """The persistent tier to read a state from (opened at its branch; RAM is read through its stored copy)
        and its manifest.  ``at``: where ``stored`` found the state, for a caller that needed the place first.

        With ``prefer="auto"`` the tier is a FallbackTier (tiers/fallback.py): a shard, region or manifest
        found damaged there is read from the next tier holding the same manifest digest, with a WARNING naming
        the damaged tier, step and file. An explicit tier is that tier alone: its errors stand."""
        t, n = at or self.stored(step, prefer, branch)
        return self._checked(t, n, prefer)

    def stored(self, step: int | str, prefer: str, branch: str | None) -> tuple[Tier, int]:
        """``locate``, with RAM replaced by a stored copy of its state (a digest names it: a bare step number
        may name another branch's state)."""
        t, n = self.locate(step, prefer, branch)
        if t is not self.memory:
            return t, n
        ref = step if isinstance(step, str) and step.startswith("sha256:") else n
        stored = [x.name for x in self.tiers(include_memory=False)] if prefer in ("auto", "memory") else [prefer]
        for i, name in enumerate(stored):
            try:
                return self.locate(ref, name, branch)
            except StepNotFoundError:
                if i == len(stored) - 1:
                    raise
        raise AssertionError("unreachable")

    def _checked(self, t: Tier, n: int, prefer: str) -> tuple[Tier, Manifest]:
        """(tier to read, manifest): under ``auto`` a persistent tier falls back to intact copies elsewhere."""
        if prefer != "auto" or t is self.memory:
            return t, t.manifest(n)

        def others() -> list[Tier]:
            return [self.tier(o.name, t.branch) for o in self.tiers(include_memory=False) if o.name != t.name]

        return fallback.open_checked(t, n, others)

    def runs(self) -> list[str]:
        """The runs the local tier holds (folders with a committed step, on any branch)."""
        root = self.config.tiers.local.root
        try:
            names = sorted(os.listdir(root))
        except OSError:
            return []
        return [n for n in names if not n.startswith(".") and os.path.isdir(os.path.join(root, n))
                and any(e.startswith("step-") or e == "branches" for e in os.listdir(os.path.join(root, n)))]

    def _other_runs_holding(self, step: int | str) -> list[str]:
        """Other runs of the local tier that hold a state at step number ``step`` (for error messages)."""
        if not str(step).isdigit():
            return []
        out = []
        for run in self.runs():
            if run == self.config.run:
                continue
            main = LocalTier(self.config.tiers.local, run, **self._tier_kw)
            if any(int(step) in t.steps() for t in [main] + [main.at_branch(b) for b in main.branch_names()]):
                out.append(run)
        return out

    def find(self, step: int | str, prefer: str = "auto", branch: str | None = None) -> Tier:
        """The fastest tier (opened at the state's branch) that holds a committed state; see ``locate``. Where it
        is, not a reader: read through ``open_step`` / ``load`` / ``read`` to fall back on damage."""
        return self.locate(step, prefer, branch)[0]

    def manifest(self, step: int | str, prefer: str = "auto", branch: str | None = None) -> Manifest:
        t, n = self.locate(step, prefer, branch)
        return self._checked(t, n, prefer)[1]

    def read(self, step: int | str, tensor: str, region: Any = None, prefer: str = "auto",
             branch: str | None = None) -> np.ndarray:
        t, n = self.locate(step, prefer, branch)
        t, m = self._checked(t, n, prefer)
        return t.read(n, tensor, region, manifest=m)

    def load(self, step: int | str, prefer: str = "auto", branch: str | None = None) -> Snapshot:
        """A lazy snapshot of a stored state (``prefer="memory"``: RAM's); under ``auto`` shards found damaged
        are read from another tier's intact copy (see ``open_step``)."""
        if prefer == "memory":
            t, n = self.locate(step, prefer, branch)
            return t.load(n)
        t, m = self.open_step(step, prefer, branch)
        return t.load(m.step)

    # ---- deleting on purpose (flowcheck/pruning.py) ------------------------------------
    def gc(self, dry_run: bool = False, tiers: list[str] | None = None, *, progress: Progress | None = None) -> GcReport:
        """Apply each tier's retention policy along the current branch; clean abandoned partial writes.

        ``progress`` counts committed states (listed first, for the total) as each is kept or deleted."""
        if not dry_run:
            self.bind()
        return pruning.gc(self, dry_run, tiers, progress=progress)

    def delete(self, step: int | str, tier: str | None = None, branch: str | None = None, *,
               force: bool = False) -> DeleteReport:
        """Delete one committed state from ``tier`` (None: every persistent tier holding it), leaving the pruning
        record GC leaves (audit then reads the gap as deliberate). ``step``: a number or ``latest`` on ``branch``
        (default the current branch) or a ``sha256:`` digest prefix. The newest state of the current branch
        (the head) is refused with a FlowcheckError unless ``force=True``; StepNotFoundError when it is not held."""
        self.bind()
        return pruning.delete(self, step, tier, branch, force=force)

    def pruned(self, step: int | str, branch: str | None = None) -> PrunedRecord | None:
        """The pruning record of a state no tier holds any more (deleted by GC or ``delete``; its ``pruned_at``
        and ``by`` say when and how — None for records older than those fields), else None."""
        return pruning.pruned(self, step, branch)

    def listing(self) -> Listing:
        """Every tier's committed steps and incomplete writes at every branch (``flowcheck ls``); a configured tier
        that does not exist is an error, not an empty store."""
        states = self.check_tiers()
        current = self.history().current()
        rows = [row for t in self.tiers(include_memory=False) for bt in self.branch_tiers(t.name)
                for row in tier_rows(bt, current)]
        return Listing(self.config.run, current, self.local.root, self.object.url if self.object else None, rows,
                       states)

    def check_tiers(self) -> list[TierState]:
        """Each persistent tier's state, fastest first, for reading commands (flowcheck/tier_check.py): a local
        root or ``file://`` folder not created yet is empty (``created=False``); an existing tier holding nothing
        of the run is ``empty``. A configured tier that does not exist raises TierMissingError (no such S3
        bucket; a ``file://`` folder whose parent is missing too), refused credentials TierAccessError."""
        return tier_check.check_tiers(self)


def _same_state_note(hist: History, at: Located) -> str:
    """Why committing a state again forms no branch: a retry, or a deterministic replay after a rollback (the same
    state again: kept once, as every copy of one state is)."""
    later = [s.step for s in hist.states if s.branch == at.branch and s.step > at.step]
    if later:
        return (f"is the same state as before the rollback (step {max(later)} on {at.branch} was committed after "
                f"it): kept once, no branch forms")
    return "is already committed with this state"


def _same_data(m: Manifest, shards: set, scalars: dict, layout_digest: str) -> bool:
    """Whether manifest ``m`` holds these shards ``(tensor, offsets, shape, digest)``, scalars and layout."""
    theirs = {(name, e.offsets, e.shape, e.digest) for name, t in m.tensors.items() for e in t.shards}
    return theirs == shards and dict(m.scalars) == scalars and m.layout_digest == layout_digest


def _state_info(tier: Tier, step: int) -> StateInfo:
    try:
        m = tier.manifest(step, check_signature=False)
    except FlowcheckError as e:
        # info, not warning: the command that needs this state fails naming it, audit and gc report it
        log.info("%s tier %s step %d: manifest unreadable (%s); kept, never guessed at", tier.name, tier.branch,
                 step, e)
        return StateInfo(tier.name, tier.branch, step, None, None, None)
    try:
        tier.check_signature(m)  # the tier's own rule, applied to a listing
        trusted = True
    except ManifestError as e:
        log.info("%s", e)
        trusted = False
    return StateInfo(tier.name, tier.branch, step, m.digest(), m.parent, parse_time(m.created_at), trusted)


def open_store(cfg: Config | str | None = None, *, progress: bool = False) -> Store:
    """A Store from a Config, a YAML path, or None ($FLOWCHECK_CONFIG, else the embedded defaults)."""
    if not isinstance(cfg, Config):
        cfg = config_mod.load(cfg)
    return Store(cfg, progress=progress)
