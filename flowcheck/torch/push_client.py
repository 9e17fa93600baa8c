"""The Checkpointer's push client (a mixin of Checkpointer): one connection to the node, greeted and signed, a push
frame per save (its header, the payload over TCP or a lent shared-memory segment) and what the node's answer means
for the next save (what it holds, which region it adopted)."""
from __future__ import annotations

import logging
import select
import socket
from typing import Any

import xxhash

from flowcheck import evidence
from flowcheck.capture.push.auth import DEFAULT_TOKEN_ENV, PushSigner
from flowcheck.capture.push.launch import Superseded
from flowcheck.capture.push.wire import ROOT, PushHeader, encode_header, recv_header
from flowcheck.errors import AuthError, FlowcheckError
from flowcheck.manifest import ParentRef
from flowcheck.torch.push_plan import _Job


log = logging.getLogger(__name__)


class PushClient:
    """The node connection and the push protocol (a mixin of Checkpointer)."""

    def _send(self, job: _Job) -> None:
        """Send the job's push; a node that lacks the frozen tensors it carries as kept (it restarted, went stale or
        holds another state) answers ``resend`` and gets the whole part at once (copied into the region then)."""
        kept = job.kept if self._node_state is not None else frozenset()
        try:
            header, answer, sent, kept = self._push(job, kept)
            if kept and answer.get("kind") != "ack" and answer.get("reason") == "resend":
                log.info("checkpoint push of step %d: %s; sending the whole state", job.step, answer.get("message"))
                self.stats.resends += 1
                self._node_state = None
                header, answer, sent, kept = self._push(job, frozenset())
        except (OSError, FlowcheckError):
            self._drop()
            raise
        if answer.get("kind") != "ack":
            if answer.get("reason") == "unauthorised":  # the node closed the connection
                self._drop()
                raise AuthError(f"node refused step {job.step}: {answer.get('message')}")
            if answer.get("reason") == "superseded":  # a newer launch of this job pushes: this copy stops pushing
                self._drop()
                self.superseded = f"node refused step {job.step}: {answer.get('message')}"
                log.error("checkpoint push stopped: %s", self.superseded)
                raise Superseded(self.superseded)
            raise FlowcheckError(f"node refused step {job.step}: {answer.get('message')}")
        self._acknowledged(job, answer, sent, kept)
        # the node now knows where this state descends from; later steps descend from what it commits next (sending
        # the resume point with every push re-parented each snapshot onto it)
        self.parent, self._lineage_told = None, True
        evidence.pushed(self.config.run, job.step)

    def _push(self, job: _Job, kept: frozenset[int]) -> tuple[dict[str, Any], dict[str, Any], int, frozenset[int]]:
        """One push frame and the node's answer (sent once the node holds the step as its RAM state): (header, answer,
        payload bytes sent, the entries sent as kept).  Kept shards keep their slot in the region's byte layout
        (``at``) but carry no bytes: over TCP only the others are sent, in order; through shared memory the node
        does not read them.  Entries the job kept that are not sent as kept are copied into the region first."""
        sock = self._connect()
        if not self._signer.hello.get("kept_shards"):
            kept = frozenset()  # a node from before kept shards (its hello does not offer them): send everything
        if job.kept - kept:
            self._fill(job, job.kept - kept)
        host = self._host
        pieces = self._pieces(job.region, kept)
        sent = sum(len(p) for p in pieces)
        payload = host.payload(job.region)
        if not host.shm:
            done = job.digest
            payload["digest"] = done[1] if done is not None and done[0] == kept else self._digest(job.region, kept)
        c = self.coords
        push = PushHeader(
            self.config.run, job.step, c.sender, c.senders, {"tp": c.tp, "pp": c.pp, "dp": c.dp, "vpp": c.vpp}, self._specs,
            [{"tensor": e.name, "offsets": e.offsets, "shape": list(e.tensor.shape), "at": e.at,
              **({"kept": True} if i in kept else {})} for i, e in enumerate(self._entries)],
            payload, job.scalars, self._header_parent(job.step),
            base=self._node_state if kept else None,  # the node state that holds the kept shards' bytes
            launch=self.launch.to_json() if self.launch is not None else None, trainer=self._trainer_report())
        header = self._signer.sign(push.to_json())
        host.lend(job.region)  # the node holds it from now on, until it clears the lease (or refuses the push)
        sock.sendall(encode_header(header))
        if not host.shm:
            for piece in pieces:
                sock.sendall(piece)
        return header, recv_header(sock), sent, kept

    def _header_parent(self, step: int) -> dict[str, Any] | str | None:
        """The push header's ``parent``: a stored state (``{step, manifest_digest}``; ``{step}``: the node's current
        branch's state at that step), ``ROOT`` (a new lineage), or None once the node was told (it continues)."""
        if self.parent is not None:
            return _ref_json(self.parent)
        if self._lineage_told:
            return None
        p = self._parent_arg
        if hasattr(p, "resumed"):  # a flowcheck.dcp.Reader: what it loaded
            p = p.resumed if p.resumed is not None else "auto"
        if p == "auto":
            known = evidence.parent_for(self.config.run, step)
            if known is None:
                if not self._root_logged:
                    self._root_logged = True
                    log.warning("%s", evidence.root_hint("Checkpointer", self.config.run, step))
                return ROOT
            return None if known.ref is None else _ref_json(known.ref)
        if p is None:
            return ROOT
        return {"step": p} if isinstance(p, int) else _ref_json(p)

    def _pieces(self, region: int, kept: frozenset[int]) -> list[memoryview]:
        """What a push of ``region`` carries: the whole buffer, or the entries not kept, in order."""
        buf = memoryview(self._host.regions[region].numpy())[: self.stats.buffer_bytes]
        if not kept:
            return [buf]
        return [buf[e.at:e.at + e.nbytes] for i, e in enumerate(self._entries) if i not in kept and e.nbytes]

    def _digest(self, region: int, kept: frozenset[int]) -> str:
        h = xxhash.xxh3_128()
        for piece in self._pieces(region, kept):
            h.update(piece)
        return "xxh3-128:" + h.hexdigest()

    def _trainer_report(self) -> dict[str, Any]:
        """What the node shows on /status of this sender's saves: how many were skipped or waited, and for how long."""
        st = self.stats
        return {"saves": st.saves, "sent": st.sent, "coalesced": st.coalesced, "busy_waits": st.busy_waits,
                "blocked_s": round(st.blocked_s, 4), "lease_waits": st.lease_waits, "staged": st.staged,
                "on_busy": self.config.on_busy}

    def _acknowledged(self, job: _Job, answer: dict[str, Any], sent: int, kept: frozenset[int]) -> None:
        """Record what the node now holds: its state id, the region it adopted (the trainer fills another one next),
        and the frozen tensors this push carried (their keys)."""
        state = answer.get("state")
        if state != self._node_state or not isinstance(state, str):
            for e in self._entries:  # another node state (or a node that names none): it holds nothing of ours yet
                e.held = None
            self._node_state = state if isinstance(state, str) else None
        self._held = job.region
        for i, key in job.frozen.items():
            if i not in kept:  # sent: the node holds it as of this key (kept: what it holds is unchanged)
                self._entries[i].held = key
        for i in job.buffers:  # sent: this region's slice is what the node holds (kept: the slice it had)
            if i not in kept:
                self._entries[i].mirrored_in = job.region
        sent_kept = sum(self._entries[i].nbytes for i in kept)
        self.stats.last_sent_bytes = sent
        self.stats.sent_bytes += sent
        self.stats.kept_bytes += sent_kept

    def _connect(self) -> socket.socket:
        """The node connection, opened (and greeted: a fresh challenge, the node's proof) on first use, and again
        when the node closed it meanwhile (it closes push connections idle past its serve.idle_timeout_s).  A node
        other than the one that held our segments (restarted) holds none of them: they are ours again."""
        if self._sock is not None and _closed_by_peer(self._sock):
            self._drop()
        if self._sock is None:
            sock = socket.create_connection(self.config.address, timeout=self.config.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
            self._signer = PushSigner.handshake(sock, self._token, self.config.run, "%s:%d" % self.config.address, DEFAULT_TOKEN_ENV)
            hello = self._signer.hello
            if hello.get("node_id") != self._node_id:
                self._host.take_back_all()
                self._held = None
                self._node_id = hello.get("node_id")
            self._host.lends = bool(hello.get("adopts_segments"))
        return self._sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None  # reconnect (and greet again) on the next save
            self._signer = None


def _ref_json(ref: ParentRef) -> dict[str, Any]:
    return {"step": ref.step, "manifest_digest": ref.manifest_digest}


def _closed_by_peer(sock: socket.socket) -> bool:
    """True when an idle connection has something to read: the node only answers frames, so that is its close
    (EOF or a reset) — sending on it would lose this save."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)
