"""Push capture, node side: receive trainers' frames and apply each complete step to the memory tier.

Every sender (trainer rank) sends its part of a step; a step becomes visible in RAM only when every
part is in and every payload checks: its xxh3-128 digest over TCP; through shared memory, the segment's
generation counter, read before and after the copy (the only way a payload there goes bad is a rewrite).
Once the memory tier holds a state of the same layout, parts are received straight into its arrays
inside one ``update(step)`` (copy-on-write keeps a snapshot in flight intact), so the node holds the
state about once; a part that fails or a sender that vanishes aborts the update, which marks the state
stale — never a torn or unverified step.  With a token (flowcheck/capture/push/auth.py) a push is checked
before any of it is read: an unsigned, wrongly signed or replayed frame is refused and its connection
closed, its payload never read.  Every connection is bounded (flowcheck/node/limits.py): a frame header
must arrive within ``header_timeout_s``, a connection idles between frames only once it pushed, and the
listener refuses connections past ``max_connections``.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import xxhash

from flowcheck import _native, dtypes
from flowcheck.capture.push.auth import DEFAULT_TOKEN_ENV, PushGate
from flowcheck.capture.push.wire import WireError, recv_exact, recv_header, reply
from flowcheck.errors import AuthError, FlowcheckError
from flowcheck.logs import oneline
from flowcheck.manifest import ParentRef
from flowcheck.node.limits import BoundedTCPServer, ConnectionLimits, ListenerStats
from flowcheck.state import ParallelLayout, Scalars, Shard, Snapshot, StateLayout, TensorSpec
from flowcheck.tiers.memory import new_state_id

log = logging.getLogger(__name__)


@dataclass
class PushStats:
    """Counters the node exports as metrics."""

    frames: int = 0
    bytes: int = 0
    steps: int = 0
    rejected: int = 0
    aborted_steps: int = 0
    last_step: int | None = None
    kept_bytes: int = 0  # bytes of shards pushes carried as kept (the node already held them)
    resends_asked: int = 0  # pushes with kept shards this node lacked, asked again whole
    last_receive_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    def error(self, msg: str) -> None:
        self.errors = (self.errors + [msg])[-20:]


@dataclass(frozen=True)
class ShardRef:
    shard: Shard
    at: int
    nbytes: int
    kept: bool = False  # not in the payload: the node's state already holds it (a frozen tensor sent before)


class Lacking(FlowcheckError):
    """A push carries kept shards the node does not hold (it restarted, its state is stale or was replaced): the
    sender is told ``resend`` and sends the whole part again."""


def parse_part(header: dict[str, Any]) -> tuple[StateLayout, list[ShardRef], int]:
    """The layout a part belongs to, its shards (payload offsets) and payload size; WireError if malformed."""
    try:
        specs = tuple(TensorSpec(t["name"], t["dtype"], tuple(t["shape"]), t.get("role", "replicated"))
                      for t in header["tensors"])
        layout = StateLayout(specs, ParallelLayout(**header.get("source_layout", {})))
        sizes = {s.name: dtypes.dtype(s.dtype).itemsize for s in specs}
        refs, end = [], 0
        for s in header["shards"]:
            shard = Shard(s["tensor"], tuple(s["offsets"]), tuple(s["shape"]))
            nbytes = int(np.prod(shard.shape, dtype=np.int64)) * sizes[shard.tensor]
            if int(s["at"]) != end:
                raise WireError(f"shard {shard.tensor} at byte {s['at']}, expected {end} (shards are back to back)")
            if not shard.within(layout.spec(shard.tensor)):
                raise WireError(f"shard {shard.tensor} {shard.offsets}+{shard.shape} lies outside its global shape")
            kept = s.get("kept", False)
            if not isinstance(kept, bool):
                raise WireError(f"shard {shard.tensor}: kept must be true or false, found {kept!r}")
            refs.append(ShardRef(shard, end, nbytes, kept))
            end += nbytes
        size = int(header["payload"]["bytes"])
        Scalars.from_json(header.get("scalars") or {})  # checked here: a bad type is this sender's error reply
    except WireError:
        raise
    except (KeyError, TypeError, ValueError, FlowcheckError) as e:
        raise WireError(f"push header: {type(e).__name__}: {e}") from e
    if size != end:
        raise WireError(f"push header: payload of {size} bytes, but its shards need {end}")
    return layout, refs, size


class _OpenStep:
    """One step being received: the memory tier update in progress, and which senders are still due."""

    def __init__(self, step: int, senders: int) -> None:
        self.step, self.senders = step, senders
        self.done: set[int] = set()
        self.failed: str | None = None
        self.cond = threading.Condition()
        self.update = None  # memory tier _Update while receiving in place
        self.fresh: dict[Shard, np.ndarray] = {}  # first state / new layout: received into new arrays
        self.layout: StateLayout | None = None
        self.scalars: Scalars | None = None
        self.fresh_ready = False  # no in-place update possible: parts go to new arrays
        self.shards: set[Shard] = set()
        self.parent = None  # ParentRef the sender resumed from, if any
        self.state_id: str | None = None  # the memory tier's state id once this step is applied
        self.stale = False  # the RAM state this step rewrites in place was stale (kept shards cannot come from it)
        self.opened = time.monotonic()
        self.progress = self.opened  # when a part last began a shard (the part timeout counts from here)


class PushReceiver:
    """Receives push frames on a TCP listener and applies complete steps to ``store``'s memory tier.

    ``token``: when set, only pushes signed with it are taken (``token_env`` names its variable in messages).
    ``limits``: how long a connection may take and how many may be open (flowcheck/node/limits.py).
    """

    # whether hello offers kept shards and acks name the RAM state (False: answer as a node from before them, which a
    # trainer must then send every shard — kept for the compatibility test)
    offers_kept = True

    def __init__(self, store: Any, host: str = "127.0.0.1", port: int = 0, *, part_timeout_s: float = 60.0,
                 on_step=None, token: str | None = None, token_env: str = DEFAULT_TOKEN_ENV,
                 limits: ConnectionLimits = ConnectionLimits()) -> None:
        self.store, self.part_timeout_s, self.on_step = store, part_timeout_s, on_step
        self._token, self._token_env, self.limits = token, token_env, limits
        self.stats = PushStats()
        self.connections = ListenerStats()
        self._lock = threading.Lock()
        self._open: _OpenStep | None = None
        self._applier: threading.Thread | None = None
        self._segments: dict[int, tuple[str, shared_memory.SharedMemory]] = {}
        receiver = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                receiver._serve(self.request)

        self.server = BoundedTCPServer((host, port), Handler, limits, self.connections, name="push", busy=_busy)
        self.address = self.server.server_address
        self._thread = threading.Thread(target=self.server.serve_forever, name="push-listener", daemon=True)

    def start(self) -> PushReceiver:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever, forever if it never ran
            self.server.shutdown()
        self.server.server_close()
        with self._lock:
            current = self._open
        if current is not None:
            self._fail(current, "node shutting down")
        for _, seg in self._segments.values():
            _close_quietly(seg)

    # ---- one connection -------------------------------------------------------------
    def _serve(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        gate = PushGate(self._token, self._token_env)
        pushed = False  # until its first push is accepted, a connection gets header_timeout_s per frame
        while True:
            try:
                header = self._next_header(sock, pushed)
            except TimeoutError:
                self.connections.timeout()
                return
            except (ConnectionError, OSError):
                return
            except WireError as e:
                self.stats.rejected += 1
                self.stats.error(str(e))
                try:
                    reply(sock, "error", message=str(e))
                finally:
                    return
            kind = header["kind"]
            if kind == "hello":
                reply(sock, "ack", node=self.store.config.node or socket.gethostname(), run=self.store.config.run,
                      **({"kept_shards": True} if self.offers_kept else {}), **gate.greet(header))
                continue
            if kind != "push":
                reply(sock, "error", message=f"unknown frame kind {kind!r}")
                return
            try:
                gate.check(header)
            except AuthError as e:
                self._refuse(sock, e)
                return
            try:
                state = self._receive_part(sock, header)
                reply(sock, "ack", step=header.get("step"), **({"state": state} if self.offers_kept else {}))
                pushed = True
            except Lacking as e:
                self.stats.resends_asked += 1
                reply(sock, "error", reason="resend", message=str(e))
            except WireError as e:
                self.stats.rejected += 1
                self.stats.error(str(e))
                reply(sock, "error", message=str(e))
            except (ConnectionError, OSError) as e:
                if isinstance(e, TimeoutError):
                    self.connections.timeout()
                log.warning("push: sender lost mid-part: %s", oneline(e))
                return

    def _next_header(self, sock: socket.socket, pushed: bool) -> dict[str, Any]:
        """The next frame's header: TimeoutError unless it starts within the idle bound (``idle_timeout_s`` once the
        connection pushed, else ``header_timeout_s``) and is complete ``header_timeout_s`` after it started."""
        limits = self.limits
        if pushed:
            sock.settimeout(limits.idle_timeout_s)
            if not sock.recv(1, socket.MSG_PEEK):
                raise ConnectionError("the sender closed the connection")
        header = recv_header(sock, deadline=time.monotonic() + limits.header_timeout_s)
        sock.settimeout(limits.header_timeout_s)  # the payload: no wait for its next bytes may be longer
        return header

    def _refuse(self, sock: socket.socket, e: AuthError) -> None:
        """An unauthorised push: counted, reported to its sender, and its connection closed with the payload unread."""
        self.stats.rejected += 1
        self.stats.error(str(e))
        log.warning("push: %s (from %s)", oneline(e), _peer(sock))
        with contextlib.suppress(OSError):
            reply(sock, "error", message=str(e), reason="unauthorised")

    def _receive_part(self, sock: socket.socket, header: dict[str, Any]) -> str | None:
        """Receive one part into its step; the id of the memory state it is applied to (the ack tells the sender)."""
        t0 = time.monotonic()
        layout, refs, full = parse_part(header)
        size = sum(r.nbytes for r in refs if not r.kept)  # what the payload carries: kept shards have no bytes
        run, step = header.get("run"), header.get("step")
        if run != self.store.config.run:
            self._drain(sock, header, size)
            raise WireError(f"push for run {run!r}, but this node serves run {self.store.config.run!r}")
        if not isinstance(step, int) or step < 0:
            self._drain(sock, header, size)
            raise WireError(f"push header: step must be a non-negative integer, found {step!r}")
        senders, sender = header.get("senders", 1), header.get("sender", 0)
        if not (isinstance(senders, int) and isinstance(sender, int) and 0 <= sender < senders):
            self._drain(sock, header, size)
            raise WireError(f"push header: expected 0 <= sender < senders, found sender {sender!r} of {senders!r}")
        opened = self._join(step, senders, layout)
        if any(r.kept for r in refs):
            lacking = self._lacking(opened, header, refs)
            if lacking is not None:
                self._drain(sock, header, size)
                raise Lacking(f"step {step} part {sender}: {lacking}; send the part again with every shard's bytes")
        try:
            digest = self._read_payload(sock, header, refs, full, opened)
            want = header["payload"].get("digest")
            if want is not None and digest != want:
                raise WireError(f"step {step} part {sender}: payload digest {digest} != header {want}")
        except BaseException as e:
            self._fail(opened, f"part {sender} of step {step}: {e}")
            raise
        with opened.cond:
            if sender == 0 or opened.scalars is None:
                opened.scalars = Scalars.from_json(header.get("scalars") or {})
                opened.parent = _parent(header.get("parent"))
            opened.done.add(sender)
            opened.cond.notify_all()
        self.stats.frames += 1
        self.stats.bytes += size
        self.stats.kept_bytes += sum(r.nbytes for r in refs if r.kept)
        self.stats.last_receive_s = time.monotonic() - t0
        return opened.state_id

    def _lacking(self, opened: _OpenStep, header: dict[str, Any], refs: list[ShardRef]) -> str | None:
        """Why this node cannot take the part's kept shards from its RAM state (None: it can).  It can only when the
        step is applied in place to the very state the sender's kept bytes went into (``base``, the state id an
        earlier ack gave the sender), and that state is cut into the same shards."""
        if opened.update is None or opened.stale:
            return "the node holds no state these kept shards can come from (it restarted, its state is stale, or " \
                   "the layout changed)"
        base = header.get("base")
        if base != opened.state_id:
            return f"the kept shards were sent to node state {base!r}, the node holds state {opened.state_id!r}"
        missing = [r.shard.tensor for r in refs if r.kept and r.shard not in opened.shards]
        if missing:
            return f"kept shards not cut as the RAM state's: {missing[:3]}"
        return None

    def _drain(self, sock: socket.socket, header: dict[str, Any], size: int) -> None:
        if not header.get("payload", {}).get("shm"):
            left = size
            while left:
                left -= len(recv_exact(sock, min(left, 1 << 20)))

    def _read_payload(self, sock, header, refs: list[ShardRef], size: int, opened: _OpenStep) -> str | None:
        """Copy the payload into the step's arrays; the xxh3-128 of the whole payload when the header carries
        one to check (always over TCP), else None (shared memory, guarded by its generation counter)."""
        payload = header["payload"]
        h = xxhash.xxh3_128() if payload.get("digest") is not None else None
        shm_name = payload.get("shm")
        if shm_name:
            seg = self._segment(int(header.get("sender", 0)), shm_name)
            guard = _generation_guard(payload, size, seg.size, shm_name)
            if seg.size < size:
                raise WireError(f"shared memory {shm_name!r} holds {seg.size} bytes, the header says {size}")
            self._copy_from_segment(seg, refs, opened, h, guard)
        elif h is None:
            raise WireError("push header: a payload sent over TCP needs its digest (payload.digest), found none")
        else:
            for ref in refs:
                if ref.kept:
                    continue  # unchanged in the RAM state: not written, so never copied on write either
                if ref.nbytes:
                    view = self._destination(opened, ref).reshape(-1).view(np.uint8)
                    recv_exact(sock, ref.nbytes, memoryview(view))
                    h.update(view)
                else:
                    self._destination(opened, ref)
        return None if h is None else "xxh3-128:" + h.hexdigest()

    def _segment(self, sender: int, name: str) -> shared_memory.SharedMemory:
        """A sender's segment, attached once and kept while the sender reuses it (no re-mapping per frame);
        a sender that moved to a new segment has its old mapping closed, so unlinked memory is not held."""
        with self._lock:
            held = self._segments.get(sender)
            if held is not None and held[0] == name:
                return held[1]
            seg = _attach(name)
            self._segments[sender] = (name, seg)
        if held is not None:
            _close_quietly(held[1])
        return seg

    def _copy_from_segment(self, seg: shared_memory.SharedMemory, refs: list[ShardRef], opened: _OpenStep, h,
                           guard: tuple[int, int] | None) -> None:
        """Copy (and hash, if ``h``) the payload; with ``guard`` = (generation, offset) the segment's counter must
        read that generation before the copy and still after it — else the trainer rewrote the buffer meanwhile."""
        if guard is not None:
            _check_generation(seg, *guard, "before the node read it")
        # every view of the segment dies with this frame, so the segment can be closed afterwards
        whole = np.frombuffer(seg.buf, np.uint8)
        try:
            for ref in refs:
                if ref.kept:
                    continue
                dest = self._destination(opened, ref).reshape(-1).view(np.uint8)
                # piece by piece: copy with streaming stores (around the cache the trainer's core shares), hash it
                # while in cache if the sender sent a digest, drop its pages — the node never maps more than one
                # piece of the trainer's segment (a 32 MiB embedding shard counted as RSS was 0.05x of the state in P7)
                pos, end = ref.at, ref.at + ref.nbytes
                while pos < end:
                    stop = min(end, (pos // SHM_PIECE + 1) * SHM_PIECE)
                    src = whole[pos:stop]
                    _native.copy_into(dest[pos - ref.at:stop - ref.at], src, threads=1, stream=True)
                    if h is not None:
                        h.update(src)
                    del src
                    _unmap_pages(seg, pos, stop)
                    pos = stop
        finally:
            del whole
        if guard is not None:
            _check_generation(seg, *guard, "while the node read it (a torn copy)")

    def _destination(self, opened: _OpenStep, ref: ShardRef) -> np.ndarray:
        spec = opened.layout.spec(ref.shard.tensor)
        if opened.update is not None:
            if ref.shard not in opened.shards:
                # the RAM state is cut differently: this step aborts (stale) and the next push replaces it whole
                raise WireError(f"shard {ref.shard.tensor} {ref.shard.offsets} is not cut as the RAM state's shards")
            arr = opened.update.array(ref.shard)
            opened.progress = time.monotonic()
            return arr
        opened.progress = time.monotonic()
        arr = np.empty(ref.shard.shape, dtype=dtypes.dtype(spec.dtype).storage)
        with opened.cond:
            opened.fresh[ref.shard] = arr
        return arr

    # ---- assembling a step -----------------------------------------------------------
    def _join(self, step: int, senders: int, layout: StateLayout) -> _OpenStep:
        """The open step ``step`` (opening it, after the previous one closed, if this is its first part)."""
        while True:
            with self._lock:
                current = self._open
                if current is not None and current.step == step:
                    if layout.digest() != current.layout.digest() and not _same_tensors(layout, current.layout):
                        raise WireError(f"step {step}: senders disagree on the model layout")
                    return current
                if current is None:
                    opened = _OpenStep(step, senders)
                    opened.layout = layout
                    self._open = opened
                    self._applier = threading.Thread(target=self._apply, args=(opened,), name=f"push-step-{step}",
                                                     daemon=True)
                    self._applier.start()
                    with opened.cond:
                        while opened.update is None and opened.failed is None and not opened.fresh_ready:
                            opened.cond.wait()
                    return opened
                waiting_for = current
            # another step is still being received: wait for it to close (back-pressure on this sender)
            with waiting_for.cond:
                waiting_for.cond.wait_for(lambda: self._open is not waiting_for, timeout=self.part_timeout_s)

    def _apply(self, opened: _OpenStep) -> None:
        """Hold the memory tier's update open while parts arrive; publish the step when all are in."""
        memory = self.store.memory
        # a stale state of the same tensors is rewritten in place too (a push is every shard, whole): new arrays
        # beside the old ones would hold the state twice until the push ends
        in_place = memory._layout is not None and _same_tensors(memory._layout, opened.layout)
        try:
            if in_place:
                with memory.update(opened.step, rewrite=True) as u:
                    with opened.cond:
                        opened.shards = set(u.shards())
                        opened.state_id = memory.state_id
                        opened.stale = memory.stale
                        opened.update = u
                        opened.cond.notify_all()
                    self._wait_parts(opened)
                    u.scalars = opened.scalars
                if opened.parent is not None:
                    memory.head = opened.parent
            else:
                with opened.cond:
                    opened.state_id = new_state_id()  # what the received arrays go by once adopted
                    opened.fresh_ready = True
                    opened.cond.notify_all()
                self._wait_parts(opened)
                self._write_fresh(opened)
            self.stats.steps += 1
            self.stats.last_step = opened.step
            if self.on_step is not None:
                self.on_step(opened.step)
        except Exception as e:  # noqa: BLE001 - an aborted step is reported, the node keeps serving
            self.stats.aborted_steps += 1
            self.stats.error(f"step {opened.step} aborted: {e}")
            log.warning("push: step %d aborted (%s); the RAM state is stale until the next full push", opened.step,
                        oneline(e))
        finally:
            with self._lock:
                if self._open is opened:
                    self._open = None
            with opened.cond:
                opened.cond.notify_all()

    def _wait_parts(self, opened: _OpenStep) -> None:
        """Until every sender's part is in. The step aborts when no part began a shard for ``part_timeout_s``
        — time a part spends waiting for a snapshot to write a shard (the memory tier's back-pressure, bounded
        by ``cow_wait_s``) is not such a silence."""
        memory = self.store.memory
        with opened.cond:
            while True:
                left = self.part_timeout_s - (time.monotonic() - opened.progress)
                ok = opened.cond.wait_for(lambda: len(opened.done) >= opened.senders or opened.failed is not None,
                                          timeout=max(left, 0.05))
                if opened.failed is not None:
                    raise FlowcheckError(opened.failed)
                if ok:
                    return
                if memory.cow_waiting:
                    opened.progress = time.monotonic()
                idle = time.monotonic() - opened.progress
                if idle >= self.part_timeout_s:
                    raise FlowcheckError(f"only {len(opened.done)} of {opened.senders} senders' parts arrived; "
                                         f"none progressed within {self.part_timeout_s:.0f} s")

    def _write_fresh(self, opened: _OpenStep) -> None:
        if opened.parent is not None:  # the trainer resumed from a stored step: a new branch of its lineage
            self.store.memory.head = opened.parent
        covered = {s for s in opened.fresh}
        layout = opened.layout
        missing = [t.name for t in layout.tensors if not any(s.tensor == t.name for s in covered)]
        if missing:
            raise FlowcheckError(f"step {opened.step}: no sender sent {missing[:5]}")
        snap = Snapshot(self.store.config.run, opened.step, layout, dict(opened.fresh), opened.scalars or Scalars(),
                        source="push")
        memory = self.store.memory
        memory.adopt(snap, memory.head, opened.state_id)  # the received arrays become the RAM state: no second copy

    def _fail(self, opened: _OpenStep, reason: str) -> None:
        with opened.cond:
            if opened.failed is None:
                opened.failed = reason
            opened.cond.notify_all()


def _busy(sock: socket.socket, limit: int) -> None:
    """What a connection past the listener's limit is told before it is closed."""
    reply(sock, "error", reason="busy", message=f"node busy: {limit} push connections open (serve.max_connections); "
          "retry later")


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "a closed connection"
    return f"{host}:{port}"


def _parent(raw: Any) -> ParentRef | None:
    if not isinstance(raw, dict):
        return None
    try:
        return ParentRef(int(raw["step"]), str(raw["manifest_digest"]))
    except (KeyError, TypeError, ValueError) as e:
        raise WireError(f"push header: parent: expected {{step, manifest_digest}}, found {raw!r}") from e


def _same_tensors(a: StateLayout, b: StateLayout) -> bool:
    return {(t.name, t.dtype, t.shape) for t in a.tensors} == {(t.name, t.dtype, t.shape) for t in b.tensors}


SHM_PIECE = 4 << 20  # bytes of a sender's segment copied (and then unmapped) at a time


def _unmap_pages(seg: shared_memory.SharedMemory, start: int, end: int) -> None:
    """Drop the node's page-table entries for bytes [start, end) of a sender's segment once copied.

    The memory is the trainer's (shared, it stays intact); without this the node's RSS would count
    the whole buffer a second time for as long as the segment stays attached.
    """
    mm = getattr(seg, "_mmap", None)  # SharedMemory keeps its mmap here (CPython 3.8+)
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    lo = start - start % mmap.PAGESIZE
    hi = min(-(-end // mmap.PAGESIZE) * mmap.PAGESIZE, len(mm))
    if hi > lo:
        with contextlib.suppress(OSError, ValueError):
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def _generation_guard(payload: dict[str, Any], size: int, seg_size: int, name: str) -> tuple[int, int] | None:
    """(generation, offset) of a shared-memory payload's counter, or None for a sender that hashes instead."""
    gen, at = payload.get("generation"), payload.get("generation_at")
    if gen is None and payload.get("digest") is not None:
        return None
    if not (isinstance(gen, int) and gen >= 0 and gen % 2 == 0 and isinstance(at, int) and at >= size and at % 8 == 0):
        raise WireError(f"push header: a shared-memory payload needs an even generation and an 8-aligned "
                        f"generation_at >= bytes ({size}) (or a digest), found {gen!r} at {at!r}")
    if at + 8 > seg_size:
        raise WireError(f"shared memory {name!r} holds {seg_size} bytes, no room for the generation at {at}")
    return gen, at


def _check_generation(seg: shared_memory.SharedMemory, want: int, at: int, when: str) -> None:
    found = _native.generation_load(seg.buf, at)
    if found != want:
        raise WireError(f"shared memory {seg.name!r}: generation {found}, the header says {want}: "
                        f"the trainer rewrote its buffer {when}")


def _close_quietly(seg: shared_memory.SharedMemory) -> None:
    try:
        seg.close()
    except BufferError:  # a copy still running in a daemon thread holds a view; the OS unmaps at exit
        pass


def _attach(name: str) -> shared_memory.SharedMemory:
    """Open the sender's segment without adopting it (the sender unlinks it, not this process)."""
    if not isinstance(name, str) or "/" in name or len(name) > 250:
        raise WireError(f"push header: bad shared memory name {name!r}")
    try:
        return shared_memory.SharedMemory(name=name, create=False, track=False)
    except TypeError:  # Python < 3.13: attaching registers the segment with this process's resource tracker
        from multiprocessing import resource_tracker

        seg = shared_memory.SharedMemory(name=name, create=False)
        resource_tracker.unregister(seg._name, "shared_memory")  # noqa: SLF001
        return seg
    except FileNotFoundError as e:
        raise WireError(f"shared memory {name!r} does not exist: is the sender on another host?") from e
