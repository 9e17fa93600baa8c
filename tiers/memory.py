"""The memory tier: the latest training state in RAM, replaced whole or updated in place, snapshotted step-consistently.

Two ways in.  A push is received beside the state and adopted whole once complete (``adopt_push``): the previous
state stays the RAM state until then, so a push that dies half-way loses nothing.  Its arrays may live in memory
lent by the receiver (a ``Block``: a trainer's shared-memory segment, a receive buffer), handed back once no state or
snapshot holds them.  The mirror's updater updates in place, one step at a time (``with tier.update(step) as u``).
A snapshot (``pin()``) never copies up front: it holds references to the
current arrays.  When an update then touches a shard that a snapshot still
holds, the shard is first copied (copy-on-write) and the update goes to the
copy, so the snapshot keeps the step-s bytes while step s+1 is applied.  A
snapshot is never a torn mixture: ``pin()`` waits for an update in flight to
finish, and an update never mutates an array a snapshot references.
"""
from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import numpy as np

from flowcheck import _native, dtypes
from flowcheck.config import MemoryConfig
from flowcheck.errors import FlowcheckError, StaleStateError, StepNotFoundError, TensorNotFoundError
from flowcheck.manifest import Manifest, ParentRef
from flowcheck.state import Pin, Scalars, Shard, Snapshot, StateLayout
from flowcheck.tiers.base import Tier, make_manifest, normalize_region, shard_digests

log = logging.getLogger(__name__)


class MemoryTier(Tier):
    name = "memory"
    verifies_reads = False  # RAM is the live state, not a stored copy: nothing to check it against
    stores = False  # the live state: its manifest is a view, never committed

    def __init__(self, config: MemoryConfig, run: str, **kw) -> None:
        super().__init__(run, **kw)
        self.config = config
        self._cond = threading.Condition()
        self._layout: StateLayout | None = None
        self._arrays: dict[Shard, np.ndarray] = {}
        self._step: int | None = None
        self._scalars = Scalars()
        self._source = "push"
        self._stale = False
        self._updating = False
        self._pins_waiting = 0
        # pin id -> the arrays it holds (and the block each lives in) that its snapshot has not written yet
        self._pins: dict[int, dict[Shard, tuple[np.ndarray, Block | None]]] = {}
        self._blocks: dict[Shard, Block] = {}  # the state's arrays that live in lent memory, and where
        self._pin_ids = itertools.count()
        self._manifest: Manifest | None = None
        self._head: ParentRef | None = None  # the committed step this state descends from (lineage parent)
        # names this state: a new id each time the whole state is replaced (a full push, resync, restore, delete);
        # in-place updates keep it.  A trainer that sent frozen tensors once skips them only while the id it was
        # told still names the state (flowcheck/node/receiver.py): a restarted node has another one
        self.state_id: str | None = None
        self.cow_copies = 0  # shards copied because a snapshot held them (a metric)
        self.cow_waits = 0  # updates that waited for a snapshot to write a shard (the budget was spent)
        self.cow_waiting = 0  # updates waiting for that right now (a receiver's timeout does not count this time)
        self._cow_bytes = 0  # bytes copied away while pins hold the originals (freed when the pins go)
        # data digests of the live arrays, while nothing has written them since they were computed: a snapshot of a
        # state whose frozen shards are never written (LoRA through kept pushes) hashes only what changed
        self._digests: dict[Shard, str] = {}
        self._written: dict[Shard, int] = {}  # shard -> the write count when it was last handed out for writing
        self._write_count = itertools.count(1)

    # ---- state in ------------------------------------------------------------
    def adopt(self, snapshot: Snapshot, parent: ParentRef | None = None, state_id: str | None = None) -> Manifest:
        """Replace the whole state with arrays nobody else holds (a node's freshly received push): no copy.
        ``state_id``: the id the new state goes by (default: a fresh one)."""
        return self._write(snapshot, parent, copy=False, state_id=state_id)

    def _write(self, snapshot: Snapshot, parent: ParentRef | None, progress: object = None, copy: bool = True,
               state_id: str | None = None) -> Manifest:
        """Replace the whole state (a full push, a resync, or a restore into RAM); a RAM copy, not counted."""
        arrays = {s: np.array(snapshot.array(s), copy=True) if copy else snapshot.array(s) for s in snapshot.data}
        digests = shard_digests(snapshot, arrays)
        freed: list[Block] = []
        with self._cond:
            self._wait_idle()
            self._install(snapshot, arrays, {}, state_id or new_state_id(), freed)
            self._digests = dict(digests)
            self._head = snapshot.origin.parent_ref() if snapshot.origin is not None else parent
            self._manifest = make_manifest(
                snapshot, node=self.node, parent=parent, digests=digests, locations={s: () for s in arrays}, files=()
            )
            manifest = self._manifest
        _release(freed)
        return manifest

    def adopt_push(self, snapshot: Snapshot, blocks: dict[Shard, Block], kept: Iterable[Shard] = (),
                   base: str | None = None, parent: ParentRef | None = None, root: bool = False) -> str:
        """Make a complete push the RAM state in one move, without copying it: its arrays (``blocks``: the lent memory
        each lives in), plus the ``kept`` shards (bytes the sender did not send again) taken from the state it
        replaces, which must still be the state ``base`` names.  A kept array that lives in lent memory is copied
        out first (once: the copy is the node's own from then on), so that memory can go back to its owner.

        The replaced state stays whole until this call: a push that never completes never reaches it.  Raises
        KeptShardsGone (nothing changed) when ``base`` no longer holds the kept shards.  Returns the new state's id:
        the replaced state's when the push has the same tensors (what senders were told stays true), else a new one.
        ``parent``: the committed step the state descends from (a trainer that resumed); None keeps the current;
        ``root``: it descends from nothing stored (a trainer's fresh start): its first commit starts a new root."""
        kept = list(kept)
        freed: list[Block] = []
        with self._cond:
            self._wait_idle()
            why = self._cannot_keep(kept, base) if kept else None
            if why is not None:
                raise KeptShardsGone(why)
            arrays = {s: snapshot.array(s) for s in snapshot.data}
            for s in kept:
                arr = self._arrays[s]
                arrays[s] = _owned_copy(arr, self.config.copy_threads) if s in self._blocks else arr
            keeps_id = (self.state_id is not None and not self._stale and self._layout is not None
                        and _same_tensors(self._layout, snapshot.layout))
            state_id = self.state_id if keeps_id else new_state_id()
            known = {s: d for s, d in self._digests.items() if s in kept}  # kept arrays: not written, still true
            self._install(snapshot, arrays, blocks, state_id, freed)
            self._digests = known
            if parent is not None or root:
                self._head = parent
            self._manifest = None  # made (and the new shards hashed) when first asked: by the next snapshot
        _release(freed)
        return state_id

    def kept_problem(self, kept: list[Shard], base: str | None) -> str | None:
        """Why the state cannot supply these kept shards for a push whose sender was told state ``base`` (None: it
        can, as of now)."""
        with self._cond:
            return self._cannot_keep(kept, base)

    def _cannot_keep(self, kept: list[Shard], base: str | None) -> str | None:
        if self._layout is None or self._stale:
            return "the node holds no state kept shards can come from (it restarted, or its state is stale)"
        if base != self.state_id:
            return f"the kept shards were sent to node state {base!r}, the node holds state {self.state_id!r}"
        missing = [s.tensor for s in kept if s not in self._arrays]
        if missing:
            return f"the node's state is cut differently: it has no shard {missing[0]!r} as sent"
        return None

    def _install(self, snapshot: Snapshot, arrays: dict[Shard, np.ndarray], blocks: dict[Shard, Block],
                 state_id: str, freed: list[Block]) -> None:
        """Make ``arrays`` the state (under the lock): the replaced state's lent memory is handed back unless a
        snapshot still holds it (``freed`` collects what goes back, released outside the lock)."""
        _drop(self._blocks.values(), freed)
        self._blocks = {s: b for s, b in blocks.items() if s in arrays}
        _hold(self._blocks.values())
        self._layout, self._arrays, self._step = snapshot.layout, arrays, snapshot.step
        self._scalars, self._source, self._stale = snapshot.scalars, snapshot.source, False
        self.state_id = state_id
        self._written = {s: next(self._write_count) for s in arrays}
        self._cow_bytes = 0  # old pins keep their own array references; nothing of the new state is copied yet
        self._cond.notify_all()

    @property
    def head(self) -> ParentRef | None:
        """The committed step this state descends from: what its next snapshot names as parent (None: a root)."""
        return self._head

    def descends_from(self, parent: ParentRef | None) -> None:
        """Record the committed step the RAM state descends from (a snapshot of it, a recovered node's head, the
        step a mirror replica starts from); the state's bytes are unchanged."""
        self._head = parent

    @property
    def state_bytes(self) -> int:
        """Bytes of the RAM state (0 before the first full push)."""
        return sum(a.nbytes for a in list(self._arrays.values()))

    @property
    def lent_bytes(self) -> int:
        """Bytes of the state and of pinned snapshots that live in lent memory (a trainer's segment, a receive
        buffer), each block counted once."""
        with self._cond:
            blocks = {id(b): b for b in self._blocks.values()}
            for pinned in self._pins.values():
                blocks.update((id(b), b) for _, b in pinned.values() if b is not None)
            return sum(b.nbytes for b in blocks.values())

    @contextmanager
    def update(self, step: int, scalars: Scalars | None = None, *, rewrite: bool = False) -> Iterator[_Update]:
        """Apply step ``step`` in place; the new step becomes visible only when the block exits cleanly.

        An exception inside the block marks the state stale: it will not be
        snapshotted until a full state is written again.  ``rewrite``: the caller
        writes every shard it takes whole (a full push); a stale state becomes
        fresh again when such an update took every shard and exits cleanly — the
        full state written again in place, without a second copy of it in RAM.
        """
        with self._cond:
            # a waiting snapshot goes first: back-to-back updates must not starve it
            while self._updating or self._pins_waiting:
                self._cond.wait()
            if self._layout is None:
                raise StepNotFoundError("memory tier: no state loaded; write a full snapshot first")
            self._updating = True
        ok = False
        try:
            u = _Update(self, rewrite)
            yield u
            ok = True
        finally:
            with self._cond:
                self._updating = False
                if ok:
                    self._step, self._manifest = step, None
                    if self._stale and u.rewrite and u.taken.issuperset(self._arrays):
                        self._stale = False
                        log.info("memory tier: step %d rewrote every shard; the state is no longer stale", step)
                    if scalars is not None or u.scalars is not None:
                        self._scalars = u.scalars or scalars
                else:
                    self._stale = True
                    log.warning("memory tier: update to step %d failed; state marked stale", step)
                self._cond.notify_all()

    def _writable(self, shard: Shard) -> np.ndarray:
        """The live array of a shard (its cached digest forgotten), copied first if a snapshot still references it.

        Copies are bounded by ``cow_budget`` (a fraction of the state): past it, the update waits until
        the snapshot has written this shard (it unpins each shard once written) — the node's memory
        stays near one state, and a trainer pushing faster than snapshots persist is back-pressured
        (its saves coalesce) instead.  After ``cow_wait_s`` the shard is copied anyway.
        """
        with self._cond:
            self._digests.pop(shard, None)
            self._written[shard] = next(self._write_count)
            deadline = None
            while self._pinned(shard):
                arr = self._arrays[shard]
                if self._cow_fits(arr.nbytes):
                    return self._copy_on_write(shard, arr)
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.config.cow_wait_s
                    self.cow_waits += 1
                elif now >= deadline:
                    log.warning("memory tier: waited %.0f s for a snapshot to write %s; copying it beyond the "
                                "copy-on-write budget", self.config.cow_wait_s, shard.tensor)
                    return self._copy_on_write(shard, arr)
                self.cow_waiting += 1
                try:
                    self._cond.wait(deadline - now)
                finally:
                    self.cow_waiting -= 1
            return self._arrays[shard]

    def _pinned(self, shard: Shard) -> bool:
        """Whether a snapshot still holds the live array of ``shard`` (not one the state replaced since)."""
        arr = self._arrays[shard]
        return any(pinned.get(shard, (None,))[0] is arr for pinned in self._pins.values())

    def _cow_fits(self, nbytes: int) -> bool:
        if self.config.cow_budget is None:
            return True
        held = sum(a.nbytes for a in self._arrays.values())
        return self._cow_bytes + nbytes <= self.config.cow_budget * held

    def _copy_on_write(self, shard: Shard, arr: np.ndarray) -> np.ndarray:
        fresh = _owned_copy(arr, self.config.copy_threads)
        self._arrays[shard] = fresh
        block = self._blocks.pop(shard, None)
        if block is not None:  # a snapshot holds it (this shard is pinned), so it is not handed back yet
            block.users -= 1
        self.cow_copies += 1
        self._cow_bytes += arr.nbytes
        return fresh

    def mark_stale(self, reason: str) -> None:
        with self._cond:
            self._stale = True
        log.warning("memory tier: state marked stale: %s", reason)

    @property
    def stale(self) -> bool:
        return self._stale

    @property
    def step(self) -> int | None:
        return self._step

    @property
    def layout(self) -> StateLayout | None:
        """The layout of the state held (None before the first full write)."""
        return self._layout

    # ---- state out -----------------------------------------------------------
    def pin(self) -> Snapshot:
        """A step-consistent snapshot of the current step; call ``release`` when it is persisted."""
        with self._cond:
            self._pins_waiting += 1
            try:
                self._wait_idle()
            finally:
                self._pins_waiting -= 1
                self._cond.notify_all()
            if self._layout is None or self._step is None:
                raise StepNotFoundError("memory tier: no state loaded")
            if self._stale:
                raise StaleStateError(
                    f"memory tier: the state after step {self._step} is stale (an update failed); "
                    "it is not snapshotted until a full state push (resync) arrives"
                )
            pin_id = next(self._pin_ids)
            self._pins[pin_id] = {s: (a, self._blocks.get(s)) for s, a in self._arrays.items()}
            _hold(self._blocks.values())
            data = dict(self._arrays)
            # the known digests hold: pinned arrays are not written until unpinned
            pin = Pin(pin_id, dict(self._digests), dict(self._written), lambda shard: self._unpin(pin_id, shard))
            return Snapshot(self.run, self._step, self._layout, data, self._scalars, source=self._source, pin=pin)

    def _unpin(self, pin_id: int, shard: Shard) -> None:
        freed: list[Block] = []
        with self._cond:
            pinned = self._pins.get(pin_id)
            if pinned is not None:
                _, block = pinned.pop(shard, (None, None))
                _drop([block] if block is not None else [], freed)
                self._cond.notify_all()  # an update may be waiting for this shard
        _release(freed)

    def learn(self, snapshot: Snapshot, manifest: Manifest) -> None:
        """Keep the data digests ``manifest`` (a commit of pinned ``snapshot``) records for the shards nothing has
        written since the pin: the next snapshot does not hash them again."""
        if snapshot.pin is None:
            return
        pinned = snapshot.pin.written
        with self._cond:
            for name, t in manifest.tensors.items():
                for e in t.shards:
                    shard = Shard(name, e.offsets, e.shape)
                    if shard in pinned and self._written.get(shard) == pinned[shard] and shard in self._arrays:
                        self._digests[shard] = e.digest

    def _known_digests_for_tests(self) -> dict[Shard, str]:
        with self._cond:
            return dict(self._digests)

    def release(self, snapshot: Snapshot) -> None:
        pin_id = snapshot.pin.id if snapshot.pin is not None else None
        freed: list[Block] = []
        with self._cond:
            pinned = self._pins.pop(pin_id, {})
            _drop([b for _, b in pinned.values() if b is not None], freed)
            if not self._pins:
                self._cow_bytes = 0  # the originals the copies were made for are no longer held
            self._cond.notify_all()
            copied = self.cow_copies != getattr(self, "_trimmed_at", 0)
            self._trimmed_at = self.cow_copies
        _release(freed)
        if copied:
            _trim_heap()  # the step's copied-away shards were freed: hand the pages back to the OS

    def _wait_idle(self) -> None:
        while self._updating:
            self._cond.wait()

    # ---- the tier interface --------------------------------------------------
    def _committed_steps(self) -> list[int]:
        return [] if self._step is None or self._stale else [self._step]

    def _manifest_bytes(self, step: int) -> bytes:
        return self.manifest(step).to_bytes()

    def manifest(self, step: int, *, check_signature: bool = True, fresh: bool = False) -> Manifest:
        if step not in self._committed_steps():
            raise StepNotFoundError(f"memory tier: holds step {self._step}, not {step}")
        if self._manifest is None or self._manifest.step != step:
            snap = self.pin()
            try:
                known = snap.pin.known_digests
                digests = {**shard_digests(snap, {s: snap.array(s) for s in snap.data if s not in known}),
                           **{s: d for s, d in known.items() if s in snap.data}}
                self._manifest = make_manifest(snap, node=self.node, parent=self.head, digests=digests,
                                               locations={s: () for s in snap.data}, files=())
            finally:
                self.release(snap)
        return self._manifest

    def read(self, step: int, tensor: str, region=None, *, manifest: Manifest | None = None) -> np.ndarray:
        snap = self.pin()
        try:
            if snap.step != step:
                raise StepNotFoundError(f"memory tier: holds step {snap.step}, not {step}")
            spec = _spec(snap, tensor)
            reg = normalize_region(region, spec.shape, tensor)
            out = np.empty(tuple(s.stop - s.start for s in reg), dtype=dtypes.dtype(spec.dtype).storage)
            for shard in snap.data:
                if shard.tensor == tensor and (hit := shard.intersect(reg)) is not None:
                    out[hit[1]] = snap.array(shard)[hit[0]]
            return out
        finally:
            self.release(snap)

    def _read_shard(self, manifest, tensor, shard, region):
        return self.read(manifest.step, tensor, tuple(
            slice(o + r.start, o + r.stop) for o, r in zip(shard.offsets, region)))

    def _delete(self, step: int) -> None:
        freed: list[Block] = []
        with self._cond:
            self._wait_idle()
            _drop(self._blocks.values(), freed)
            self._layout, self._arrays, self._step, self._manifest = None, {}, None, None
            self._blocks = {}
            self.state_id = None
            self._digests, self._written = {}, {}
        _release(freed)

    def load(self, step: int, *, verify: bool = True) -> Snapshot:
        """A private copy of the current step (for promotion out of RAM); pin() avoids the copy."""
        manifest = self.manifest(step)
        snap = self.pin()
        try:
            if snap.step != step:
                raise StepNotFoundError(f"memory tier: holds step {snap.step}, not {step}")
            data = {s: np.array(snap.array(s), copy=True) for s in snap.data}
        finally:
            self.release(snap)
        return Snapshot(self.run, step, snap.layout, data, snap.scalars, source=snap.source, origin=manifest)


def _spec(snap: Snapshot, tensor: str):
    try:
        return snap.layout.spec(tensor)
    except KeyError:
        raise TensorNotFoundError(f"step {snap.step} has no tensor {tensor!r} (memory tier); see `flowcheck show "
                                  f"--step {snap.step} --json`") from None


class _Update:
    """Handle of one in-place update: ``u.array(shard)`` gives a writable array."""

    def __init__(self, tier: MemoryTier, rewrite: bool = False) -> None:
        self._tier = tier
        self.scalars: Scalars | None = None
        self.rewrite = rewrite
        self.taken: set[Shard] = set()  # shards handed out for writing

    def array(self, shard: Shard) -> np.ndarray:
        arr = self._tier._writable(shard)
        self.taken.add(shard)
        return arr

    def shards(self) -> list[Shard]:
        return list(self._tier._arrays)


class Block:
    """Memory the RAM state borrows from its receiver: a part of a trainer's shared-memory segment, or a receive
    buffer.  ``release`` runs once, when neither the state nor any snapshot holds an array of it (it then goes back:
    the trainer may write its segment again, the receiver reuses its buffer); a push that never became the state
    releases its blocks itself."""

    def __init__(self, nbytes: int, release: Callable[[], None]) -> None:
        self.nbytes = nbytes
        self.users = 0  # arrays of it held: one per shard of the state, one per shard a pin has not written yet
        self._release = release
        self._released = False
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._release()


class KeptShardsGone(FlowcheckError):
    """A push's kept shards (bytes the node was to hold from before) are not in the RAM state any more."""


def _hold(blocks: Iterable[Block]) -> None:
    for b in blocks:
        b.users += 1


def _drop(blocks: Iterable[Block], freed: list[Block]) -> None:
    for b in blocks:
        b.users -= 1
        if b.users == 0:
            freed.append(b)


def _release(freed: list[Block]) -> None:
    for b in freed:
        b.release()


def _owned_copy(arr: np.ndarray, threads: int) -> np.ndarray:
    fresh = np.empty_like(arr)
    _native.copy_into(fresh.reshape(-1).view(np.uint8), arr.reshape(-1).view(np.uint8), threads)
    return fresh


def _same_tensors(a: StateLayout, b: StateLayout) -> bool:
    return {(t.name, t.dtype, t.shape) for t in a.tensors} == {(t.name, t.dtype, t.shape) for t in b.tensors}


def new_state_id() -> str:
    return secrets.token_hex(8)


def _trim_heap() -> None:
    """glibc keeps freed multi-MiB arrays in its heap; malloc_trim returns them (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
