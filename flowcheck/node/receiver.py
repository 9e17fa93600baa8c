"""Push capture, node side: receive trainers' frames and make each complete step the RAM state.

Every sender (trainer rank) sends its part of a step.  Parts are received beside the RAM state, never into it
(flowcheck/capture/push/buffers.py): a trainer on this host lends the shared-memory segment it filled, which the
node adopts without a copy; a part over TCP lands in a reusable receive buffer.  When every part is in and checked
(its xxh3-128 digest over TCP; a segment's generation counter, read when the part arrives and again when the step is
adopted), the memory tier adopts the step whole; until then the previous complete step stays the RAM state, so a
sender that dies half-way, a damaged part or a timeout loses nothing acknowledged.  Each sender's ack is sent only
once the step is the RAM state (or, with an error, once it aborted).  With a token
(flowcheck/capture/push/auth.py) a push is checked before any of it is read: an unsigned, wrongly signed or replayed
frame is refused and its connection closed, its payload never read; a connection that has not proved it holds
the token sends no frame header over 16 KiB, and headers are read within ``serve.header_memory_mib`` over all
connections, so unauthenticated clients cannot exhaust the node's memory.  Every connection is bounded
(flowcheck/node/limits.py): a frame header must arrive within ``header_timeout_s``, a connection idles between
frames only once it pushed, and the listener refuses connections past ``max_connections``.
"""
from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from flowcheck import _native, dtypes
from flowcheck.capture.push.auth import DEFAULT_TOKEN_ENV, PushGate
from flowcheck.capture.push.buffers import LENT, ReceivePool, Segment, Segments
from flowcheck.capture.push.launch import Launch, Launches, Superseded
from flowcheck.capture.push.wire import (ROOT, PushHeader, WireError, recv_exact, recv_header_body, recv_header_size,
                                         reply)
from flowcheck.errors import AuthError, FlowcheckError
from flowcheck.logs import oneline
from flowcheck.manifest import ParentRef
from flowcheck.node.limits import BoundedTCPServer, ConnectionLimits, HeaderMemory, ListenerStats
from flowcheck.state import ParallelLayout, Scalars, Shard, Snapshot, StateLayout, TensorSpec
from flowcheck.tiers.memory import Block

if TYPE_CHECKING:
    from flowcheck.store import Store

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
    adopted_segments: int = 0  # parts adopted in place from a trainer's shared memory (no copy)
    last_aborted: str | None = None  # why the last aborted step aborted, and which step the RAM state stayed
    senders: dict[int, dict[str, Any]] = field(default_factory=dict)  # what each sender last said of its saves
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


@dataclass
class _Part:
    """One sender's part of a step, received beside the RAM state."""

    sender: int
    arrays: dict[Shard, np.ndarray]  # the shards it carries (views into ``block``'s memory)
    kept: list[Shard]  # shards it names but does not carry: the RAM state holds them (``base``)
    base: str | None
    block: Block | None  # where its arrays live, given back if the step never becomes the state
    recheck: Any = None  # raises WireError if the sender's segment changed since the part was read
    opened: Any = None  # the _OpenStep it belongs to

    def release(self) -> None:
        if self.block is not None and not self.block.users:
            self.block.release()


class _OpenStep:
    """One step being received: its parts so far, and how it ended (``outcome``) once it did."""

    def __init__(self, step: int, senders: int, layout: StateLayout, launch: Launch | None) -> None:
        self.step, self.senders, self.layout, self.launch = step, senders, layout, launch
        self.parts: dict[int, _Part] = {}
        self.claims: dict[int, tuple[str, socket.socket]] = {}  # sender place -> the connection sending it
        self.failed: str | None = None
        self.outcome: str | None = None  # ADOPTED, or why the step aborted
        self.cond = threading.Condition()
        self.scalars: Scalars | None = None
        self.parent = None  # ParentRef the sender resumed from, if any
        self.state_id: str | None = None  # the memory tier's state id once this step is adopted
        self.opened = time.monotonic()
        self.progress = self.opened  # when a part last began a shard (the part timeout counts from here)


ADOPTED = "adopted"


class StepAborted(FlowcheckError):
    """The step this part belongs to did not become the RAM state (another part failed or never came)."""


class PushReceiver:
    """Receives push frames on a TCP listener and applies complete steps to ``store``'s memory tier.

    ``token``: when set, only pushes signed with it are taken (``token_env`` names its variable in messages).
    ``limits``: how long a connection may take and how many may be open (flowcheck/node/limits.py).
    """

    # whether hello offers kept shards and acks name the RAM state (False: answer as a node from before them, which a
    # trainer must then send every shard — kept for the compatibility test)
    offers_kept = True

    def __init__(self, store: Store, host: str = "127.0.0.1", port: int = 0, *, part_timeout_s: float = 60.0,
                 on_step=None, token: str | None = None, token_env: str = DEFAULT_TOKEN_ENV,
                 limits: ConnectionLimits = ConnectionLimits()) -> None:
        self.store, self.part_timeout_s, self.on_step = store, part_timeout_s, on_step
        self._token, self._token_env, self.limits = token, token_env, limits
        self.stats = PushStats()
        self.connections = ListenerStats()
        self._lock = threading.Lock()
        self._open: _OpenStep | None = None
        self._applier: threading.Thread | None = None
        self.segments = Segments()
        self.pool = ReceivePool()
        self.node_id = secrets.token_hex(8)  # this receiver: a trainer that sees another one takes its segments back
        self.launches = Launches()  # the launch of the job pushes are taken from (a requeued job's zombie is refused)
        self.header_memory = HeaderMemory(limits.header_memory_bytes)
        receiver = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                receiver._serve(self.request)

        self.server = BoundedTCPServer((host, port), Handler, limits, self.connections, name="push", busy=_busy)
        self.address = self.server.server_address
        self._thread = threading.Thread(target=self.server.serve_forever, name="push-listener", daemon=True)

    @property
    def receiving(self) -> int | None:
        """The step whose parts are being received now (None: none is open)."""
        current = self._open
        return None if current is None else current.step

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
        self.segments.close()

    # ---- one connection -------------------------------------------------------------
    def _serve(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        gate = PushGate(self._token, self._token_env)
        pushed = False  # until its first push is accepted, a connection gets header_timeout_s per frame
        while True:
            try:
                header = self._next_header(sock, pushed, gate.header_limit)
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
                      node_id=self.node_id, adopts_segments=True,
                      **({"kept_shards": True} if self.offers_kept else {}), **gate.greet(header))
                continue
            if kind == "auth":
                try:
                    gate.authenticate(header)
                except AuthError as e:
                    self._refuse(sock, e)
                    return
                reply(sock, "ack")
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
            except StepAborted as e:
                reply(sock, "error", reason="aborted", message=str(e))
            except Superseded as e:
                self.stats.rejected += 1
                self.stats.error(str(e))
                log.warning("push: %s (from %s)", oneline(e), _peer(sock))
                with contextlib.suppress(OSError):
                    reply(sock, "error", reason="superseded", message=str(e))
                return
            except WireError as e:
                self.stats.rejected += 1
                self.stats.error(str(e))
                reply(sock, "error", message=str(e))
            except (ConnectionError, OSError) as e:
                if isinstance(e, TimeoutError):
                    self.connections.timeout()
                log.warning("push: sender lost mid-part: %s", oneline(e))
                return

    def _next_header(self, sock: socket.socket, pushed: bool, limit: int) -> dict[str, Any]:
        """The next frame's header: TimeoutError unless it starts within the idle bound (``idle_timeout_s`` once the
        connection pushed, else ``header_timeout_s``) and is complete ``header_timeout_s`` after it started.  A
        header longer than ``limit`` is refused unread; the others are read within the node's header memory."""
        limits = self.limits
        if pushed:
            sock.settimeout(limits.idle_timeout_s)
            if not sock.recv(1, socket.MSG_PEEK):
                raise ConnectionError("the sender closed the connection")
        deadline = time.monotonic() + limits.header_timeout_s
        size = recv_header_size(sock, deadline, limit)
        with self.header_memory.hold(size, deadline):
            header = recv_header_body(sock, size, deadline)
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
        """Receive one part beside the RAM state and wait until its step is adopted: the state id the ack names.
        A segment lent with a part the node does not take goes back to its trainer at once."""
        part = None
        try:
            part = self._take_part(sock, header)
            return self._await_step(part, header)
        finally:
            if part is None:
                payload = header.get("payload") if isinstance(header.get("payload"), dict) else {}
                if payload.get("shm") and "lease_at" in payload:
                    self.segments.give_back(payload["shm"], payload["lease_at"])

    def _take_part(self, sock: socket.socket, header: dict[str, Any]) -> _Part:
        t0 = time.monotonic()
        layout, refs, full = parse_part(header)
        size = sum(r.nbytes for r in refs if not r.kept)  # what the payload carries: kept shards have no bytes
        try:
            push = PushHeader.from_json(header)
            if push.run != self.store.config.run:
                raise WireError(f"push for run {push.run!r}, but this node serves run {self.store.config.run!r}")
            launch = Launch.from_json(push.launch)
            parent = _parent(push.parent, self.store)
        except WireError:
            self._drain(sock, header, size)
            raise
        step, sender, senders, base = push.step, push.sender, push.senders, push.base
        self._admit(launch, sock)
        kept = [r.shard for r in refs if r.kept]
        if kept:
            lacking = self.store.memory.kept_problem(kept, base)
            if lacking is not None:
                self._drain(sock, header, size)
                raise Lacking(f"step {step} part {sender}: {lacking}; send the part again with every shard's bytes")
        try:
            opened = self._join(step, senders, layout, launch)
        except WireError:
            self._drain(sock, header, size)
            raise
        self._claim(opened, sender, sock, header, size)
        try:
            arrays, block, recheck = self._read_payload(sock, header, refs, full, opened)
        except BaseException as e:
            self._fail(opened, f"part {sender} of step {step}: {e}")
            raise
        part = _Part(sender, arrays, kept, base, block, recheck)
        with opened.cond:
            if sender in opened.parts or opened.outcome is not None:
                part.release()
                raise WireError(f"step {step}: part {sender} arrived twice (two trainers pushing as one sender?)"
                                if sender in opened.parts else f"step {step} already ended: {opened.outcome}")
            opened.parts[sender] = part
            if sender == 0 or opened.scalars is None:
                opened.scalars = Scalars.from_json(push.scalars)
                opened.parent = parent
            opened.cond.notify_all()
        self.stats.frames += 1
        self.stats.bytes += size
        self.stats.kept_bytes += sum(r.nbytes for r in refs if r.kept)
        self.stats.last_receive_s = time.monotonic() - t0
        if push.trainer is not None:
            self.stats.senders[sender] = push.trainer
        part.opened = opened
        return part

    def _admit(self, launch: Launch | None, sock: socket.socket) -> None:
        """Superseded unless ``launch`` may push; a newer launch aborts the older one's open step."""
        older = self.launches.admit(launch, _peer(sock))
        if older is None:
            return
        log.warning("push: %s supersedes %s: pushes of the older are refused from now on", launch.describe(),
                    older.describe(), extra={"event": "launch_superseded"})
        with self._lock:
            current = self._open
        if current is not None and current.launch == older:
            self._fail(current, f"superseded by {launch.describe()}")

    def _claim(self, opened: _OpenStep, sender: int, sock: socket.socket, header: dict[str, Any], size: int) -> None:
        """Sender place ``sender`` of the step is this connection's, or WireError (the payload left unread) naming the
        connection that holds it: two trainers pushing as one sender never both write a step."""
        who = _peer(sock) + (f" ({opened.launch.describe()})" if opened.launch is not None else "")
        with opened.cond:
            holder, holder_sock = opened.claims.setdefault(sender, (who, sock))
        if holder_sock is not sock:
            self._drain(sock, header, size)
            log.warning("push: step %d part %d is being sent by %s; refused from %s", opened.step, sender, holder, who)
            raise WireError(f"step {opened.step}: part {sender} is already being sent by {holder}; refused from {who} "
                            "(two trainers pushing as one sender?)")

    def _await_step(self, part: _Part, header: dict[str, Any]) -> str | None:
        """Wait until the part's step is the RAM state (the ack) or aborted (StepAborted)."""
        opened = part.opened
        with opened.cond:
            opened.cond.wait_for(lambda: opened.outcome is not None)
        if opened.outcome != ADOPTED:
            raise StepAborted(opened.outcome)
        return opened.state_id

    def _drain(self, sock: socket.socket, header: dict[str, Any], size: int) -> None:
        if not header.get("payload", {}).get("shm"):
            left = size
            while left:
                left -= len(recv_exact(sock, min(left, 1 << 20)))

    def _read_payload(self, sock, header, refs: list[ShardRef], size: int, opened: _OpenStep):
        """The part's arrays, the block they live in, and its recheck (None: nothing can change it now).

        A segment with a lease word is adopted in place (views into it); one without (a trainer that rewrites its
        only buffer) and a TCP payload are copied into a receive buffer, checked by generation or digest."""
        payload = header["payload"]
        shm_name = payload.get("shm")
        if shm_name:
            seg = self.segments.attach(int(header.get("sender", 0)), shm_name)
            if seg.size < size:
                raise WireError(f"shared memory {shm_name!r} holds {seg.size} bytes, the header says {size}")
            guard = _generation_guard(payload, size, seg.size, shm_name)
            if payload.get("lease_at") is not None:
                return self._lend(seg, payload, refs, size, opened, guard)
            buf, block = self.pool.take(size)
            try:
                arrays = self._views(buf, refs, opened)
                self._copy_from_segment(seg, refs, arrays, payload.get("digest"), guard)
            except BaseException:
                block.release()
                raise
            return arrays, block, None
        if payload.get("digest") is None:
            raise WireError("push header: a payload sent over TCP needs its digest (payload.digest), found none")
        buf, block = self.pool.take(size)
        try:
            arrays = self._views(buf, refs, opened)
            h = xxhash.xxh3_128()
            for ref in refs:
                if not ref.kept and ref.nbytes:
                    opened.progress = time.monotonic()
                    view = buf[ref.at:ref.at + ref.nbytes]
                    recv_exact(sock, ref.nbytes, memoryview(view))
                    h.update(view)
            digest = "xxh3-128:" + h.hexdigest()
            if digest != payload["digest"]:
                raise WireError(f"step {header.get('step')} part {header.get('sender')}: payload digest {digest} != "
                                f"header {payload['digest']}")
        except BaseException:
            block.release()
            raise
        return arrays, block, None

    def _lend(self, seg, payload, refs: list[ShardRef], size: int, opened: _OpenStep, guard):
        """Adopt a lent segment's payload in place: its lease word must say lent, its generation the header's, now
        and again when the step is adopted (a trainer writes a segment only once the node gave it back)."""
        at = payload["lease_at"]
        if not (isinstance(at, int) and at >= size and at % 8 == 0 and at + 8 <= seg.size):
            raise WireError(f"push header: lease_at must be an 8-aligned offset past the payload inside the segment "
                            f"({seg.size} bytes), found {at!r}")
        if guard is None:
            raise WireError("push header: a lent segment needs its generation (payload.generation), found none")
        if _native.generation_load(seg.buf, at) != LENT:
            raise WireError(f"shared memory {seg.name!r}: its lease word says the trainer did not lend it")
        _check_generation(seg, *guard, "before the node took it")
        block = self.segments.lend(seg, size, at)
        whole = np.frombuffer(seg.buf, np.uint8, count=size)
        arrays = self._views(whole, refs, opened)
        self.stats.adopted_segments += 1
        return arrays, block, lambda: _check_generation(seg, *guard, "after lending it to the node")

    @staticmethod
    def _views(buf: np.ndarray, refs: list[ShardRef], opened: _OpenStep) -> dict[Shard, np.ndarray]:
        out = {}
        for ref in refs:
            if ref.kept:
                continue
            storage = dtypes.dtype(opened.layout.spec(ref.shard.tensor).dtype).storage
            out[ref.shard] = buf[ref.at:ref.at + ref.nbytes].view(storage).reshape(ref.shard.shape)
        return out

    def _copy_from_segment(self, seg: Segment, refs: list[ShardRef],
                           arrays: dict[Shard, np.ndarray], digest: str | None, guard: tuple[int, int] | None) -> None:
        """Copy (and check against ``digest``, if given) the payload of a segment its trainer does not lend; with
        ``guard`` = (generation, offset) the counter must read that generation before the copy and still after it
        — else the trainer rewrote the buffer meanwhile."""
        if guard is not None:
            _check_generation(seg, *guard, "before the node read it")
        h = xxhash.xxh3_128() if digest is not None else None
        whole = np.frombuffer(seg.buf, np.uint8)  # every view of the segment dies with this frame
        try:
            for ref in refs:
                if ref.kept:
                    continue
                dest = arrays[ref.shard].reshape(-1).view(np.uint8)
                # piece by piece: copy around the cache the trainer's core shares, hash it while in cache, drop its
                # pages (the node never maps more than one piece of a segment it copies)
                pos, end = ref.at, ref.at + ref.nbytes
                while pos < end:
                    stop = min(end, (pos // SHM_PIECE + 1) * SHM_PIECE)
                    src = whole[pos:stop]
                    _native.copy_into(dest[pos - ref.at:stop - ref.at], src, threads=1, stream=True)
                    if h is not None:
                        h.update(src)
                    del src
                    seg.unmap_pages(pos, stop)
                    pos = stop
        finally:
            del whole
        if guard is not None:
            _check_generation(seg, *guard, "while the node read it (a torn copy)")
        if h is not None and "xxh3-128:" + h.hexdigest() != digest:
            raise WireError(f"shared memory {seg.name!r}: payload digest does not match the header's {digest}")

    # ---- assembling a step -----------------------------------------------------------
    def _join(self, step: int, senders: int, layout: StateLayout, launch: Launch | None) -> _OpenStep:
        """The open step ``step`` (opening it, after the previous one closed, if this is its first part)."""
        while True:
            with self._lock:
                current = self._open
                if current is not None and current.step == step and current.failed is None:
                    if launch != current.launch:
                        raise WireError(f"step {step} is being pushed by "
                                        f"{current.launch.describe() if current.launch else 'a trainer without a launch'}"
                                        f"; this part is from {launch.describe() if launch else 'one without a launch'}")
                    if layout.digest() != current.layout.digest() and not _same_tensors(layout, current.layout):
                        raise WireError(f"step {step}: senders disagree on the model layout")
                    return current
                if current is None:
                    opened = self._open = _OpenStep(step, senders, layout, launch)
                    self._applier = threading.Thread(target=self._apply, args=(opened,), name=f"push-step-{step}",
                                                     daemon=True)
                    self._applier.start()
                    return opened
                waiting_for = current
            # another step is still being received: wait for it to close (back-pressure on this sender)
            with waiting_for.cond:
                waiting_for.cond.wait_for(lambda: self._open is not waiting_for, timeout=self.part_timeout_s)

    def _apply(self, opened: _OpenStep) -> None:
        """Wait for every part, then make the step the RAM state in one move; until then the previous complete step
        stays the state.  A step that cannot complete aborts and gives its parts' memory back."""
        memory = self.store.memory
        adopted = False
        try:
            self._wait_parts(opened)
            opened.state_id = self._adopt(opened)
            adopted = True
        except Exception as e:  # noqa: BLE001 - an aborted step is reported, the node keeps serving
            held = memory.step
            why = f"step {opened.step} aborted ({oneline(e)}); the RAM state stays " + \
                  (f"step {held}" if held is not None else "empty (no complete push yet)")
            self.stats.aborted_steps += 1
            self.stats.last_aborted = why
            self.stats.error(why)
            log.warning("push: %s", why, extra={"event": "push_aborted", "step": opened.step, "held": held})
        finally:
            with self._lock:
                if self._open is opened:
                    self._open = None
            with opened.cond:
                opened.outcome = ADOPTED if adopted else (self.stats.last_aborted or "aborted")
                parts = list(opened.parts.values())
                opened.cond.notify_all()
            if not adopted:
                for part in parts:
                    part.release()
        if adopted:
            self.stats.steps += 1
            self.stats.last_step = opened.step
            if self.on_step is not None:
                try:
                    self.on_step(opened.step)
                except Exception as e:  # noqa: BLE001 - the step is the RAM state; what follows it is reported
                    self.stats.error(f"step {opened.step}: after it was adopted: {e}")
                    log.warning("push: step %d adopted, then: %s", opened.step, oneline(e))

    def _adopt(self, opened: _OpenStep) -> str:
        """The complete step becomes the RAM state (its kept shards taken from the state it replaces)."""
        with opened.cond:
            parts = list(opened.parts.values())
        arrays, blocks, kept = {}, {}, []
        for part in parts:
            if part.recheck is not None:
                part.recheck()
            arrays.update(part.arrays)
            blocks.update({s: part.block for s in part.arrays} if part.block is not None else {})
            kept += part.kept
        bases = {p.base for p in parts if p.kept}
        if len(bases) > 1:
            raise FlowcheckError(f"senders kept shards of different node states {sorted(map(str, bases))}")
        names = {s.tensor for s in arrays} | {s.tensor for s in kept}
        missing = [t.name for t in opened.layout.tensors if t.name not in names]
        if missing:
            raise FlowcheckError(f"step {opened.step}: no sender sent {missing[:5]}")
        if any(p.recheck is None for p in parts):  # received into buffers: keep about a state of them for reuse
            self.pool.cap_bytes = max(self.pool.cap_bytes, sum(a.nbytes for a in arrays.values()))
        else:  # every part a lent segment: buffers kept for TCP pushes would only hold memory
            self.pool.clear()
        snap = Snapshot(self.store.config.run, opened.step, opened.layout, arrays, opened.scalars or Scalars(),
                        source="push")
        root = opened.parent == ROOT
        return self.store.memory.adopt_push(snap, blocks, kept, base=bases.pop() if bases else None,
                                            parent=None if root else opened.parent, root=root)

    def _wait_parts(self, opened: _OpenStep) -> None:
        """Until every sender's part is in; the step aborts when no part began a shard for ``part_timeout_s``."""
        with opened.cond:
            while True:
                left = self.part_timeout_s - (time.monotonic() - opened.progress)
                ok = opened.cond.wait_for(lambda: len(opened.parts) >= opened.senders or opened.failed is not None,
                                          timeout=max(left, 0.05))
                if opened.failed is not None:
                    raise FlowcheckError(opened.failed)
                if ok:
                    return
                if time.monotonic() - opened.progress >= self.part_timeout_s:
                    raise FlowcheckError(f"only {len(opened.parts)} of {opened.senders} senders' parts arrived; "
                                         f"none progressed within {self.part_timeout_s:.0f} s")

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


def _parent(raw: Any, store: Store) -> ParentRef | str | None:
    """What a pushed state descends from: a stored state (``{step, manifest_digest}``; ``{step}``: the current
    branch's state at that step), ROOT (nothing stored: a fresh start), or None (what the RAM state descends from)."""
    if raw == ROOT:
        return ROOT
    if not isinstance(raw, dict):
        return None
    try:
        if set(raw) == {"step"}:
            tier, n = store.locate(int(raw["step"]))
            return tier.manifest(n).parent_ref()
        return ParentRef(int(raw["step"]), str(raw["manifest_digest"]))
    except FlowcheckError as e:
        raise WireError(f"push header: parent step {raw['step']}: {e}") from e
    except (KeyError, TypeError, ValueError) as e:
        raise WireError(f"push header: parent: expected {{step, manifest_digest}}, {{step}} or {ROOT!r}, "
                        f"found {raw!r}") from e


def _same_tensors(a: StateLayout, b: StateLayout) -> bool:
    return {(t.name, t.dtype, t.shape) for t in a.tensors} == {(t.name, t.dtype, t.shape) for t in b.tensors}


SHM_PIECE = 4 << 20  # bytes of a sender's segment copied (and then unmapped) at a time


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


def _check_generation(seg: Segment, want: int, at: int, when: str) -> None:
    found = _native.generation_load(seg.buf, at)
    if found != want:
        raise WireError(f"shared memory {seg.name!r}: generation {found}, the header says {want}: "
                        f"the trainer rewrote its buffer {when}")
