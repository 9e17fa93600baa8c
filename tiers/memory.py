"""The memory tier: the latest training state in RAM, updated in place, snapshotted step-consistently.

Updates happen in place, one step at a time (``with tier.update(step) as u``).
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
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from flowcheck import _native, dtypes
from flowcheck.config import MemoryConfig
from flowcheck.errors import StaleStateError, StepNotFoundError
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
        self._pins: dict[int, set[Shard]] = {}
        self._pin_ids = itertools.count()
        self._manifest: Manifest | None = None
        self.head: ParentRef | None = None  # the committed step this state descends from (lineage parent)
        # names this state: a new id each time the whole state is replaced (a full push, resync, restore, delete);
        # in-place updates keep it.  A trainer that sent frozen tensors once skips them only while the id it was
        # told still names the state (flowcheck/capture/push/receiver.py): a restarted node has another one
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
        with self._cond:
            self._wait_idle()
            self._layout, self._arrays, self._step = snapshot.layout, arrays, snapshot.step
            self._scalars, self._source, self._stale = snapshot.scalars, snapshot.source, False
            self.state_id = state_id or new_state_id()
            self._digests = dict(digests)
            self._written = {s: next(self._write_count) for s in arrays}
            self._pins.clear()  # old pins keep their own array references
            self._cow_bytes = 0
            self.head = snapshot.origin.parent_ref() if snapshot.origin is not None else parent
            self._manifest = make_manifest(
                snapshot, node=self.node, parent=parent, digests=digests, locations={s: () for s in arrays}, files=()
            )
            return self._manifest

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
        return any(shard in pinned for pinned in self._pins.values())

    def _cow_fits(self, nbytes: int) -> bool:
        if self.config.cow_budget is None:
            return True
        held = sum(a.nbytes for a in self._arrays.values())
        return self._cow_bytes + nbytes <= self.config.cow_budget * held

    def _copy_on_write(self, shard: Shard, arr: np.ndarray) -> np.ndarray:
        fresh = np.empty_like(arr)
        _native.copy_into(fresh.reshape(-1).view(np.uint8), arr.reshape(-1).view(np.uint8), self.config.copy_threads)
        self._arrays[shard] = fresh
        for pinned in self._pins.values():
            pinned.discard(shard)
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
            self._pins[pin_id] = set(self._arrays)
            data = dict(self._arrays)
            # the known digests hold: pinned arrays are not written until unpinned
            pin = Pin(pin_id, dict(self._digests), dict(self._written), lambda shard: self._unpin(pin_id, shard))
            return Snapshot(self.run, self._step, self._layout, data, self._scalars, source=self._source, pin=pin)

    def _unpin(self, pin_id: int, shard: Shard) -> None:
        with self._cond:
            pinned = self._pins.get(pin_id)
            if pinned is not None:
                pinned.discard(shard)
                self._cond.notify_all()  # an update may be waiting for this shard

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
        with self._cond:
            self._pins.pop(pin_id, None)
            if not self._pins:
                self._cow_bytes = 0  # the originals the copies were made for are no longer held
            self._cond.notify_all()
            copied = self.cow_copies != getattr(self, "_trimmed_at", 0)
            self._trimmed_at = self.cow_copies
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
                known = snap._known_digests  # noqa: SLF001 - set by pin() above
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
            spec = snap.layout.spec(tensor)
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
        with self._cond:
            self._wait_idle()
            self._layout, self._arrays, self._step, self._manifest = None, {}, None, None
            self.state_id = None
            self._digests, self._written = {}, {}

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


def new_state_id() -> str:
    return secrets.token_hex(8)


def _trim_heap() -> None:
    """glibc keeps freed multi-MiB arrays in its heap; malloc_trim returns them (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
