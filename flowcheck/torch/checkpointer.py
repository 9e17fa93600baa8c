"""The trainer-side Checkpointer: lazy asynchronous push of the training state to a checkpoint node.

DataStates-LLM's recipe: one host buffer per rank, allocated once and reused (pinned when CUDA is
present; a shared-memory segment when the node is on the same host, so the node reads it in place);
``save(step)`` returns at once and a side thread copies every tensor into its slice of the buffer
while forward/backward run; ``wait()`` — called by a hook right before ``optimizer.step()`` — is the
only point that blocks; then the buffer streams to the node.  Over TCP the payload carries its xxh3-128
digest; through shared memory nothing can corrupt it on the way, only a rewrite while the node still
copies (a push the trainer gave up on): a generation counter after the payload (odd while the side
thread writes, even when done) tells the node exactly that, and nobody hashes 0.7 GB twice per save.
A save asked while the previous one is still in flight is coalesced (skipped) or waits (the only other
point that may block, bounded by ``timeout_s``); a slow or dead node is reported (``stats``, log) and
training goes on.  When the node has a token (``FLOWCHECK_NODE_TOKEN``) the trainer needs the same one
(``token=``, read from that variable by default): every push is signed for its connection
(flowcheck/capture/push/auth.py), and a node that cannot prove it holds the token gets nothing.

Data-parallel replicas are not sent N times: each DP rank sends a disjoint share of the tensors
(FFTrainer's "Checkpoint Razor"), and the manifest's ``scalars.extra.push`` says so.  A Megatron trainer
(``arch=``) sends boxes of the canonical tensors, and with megatron-core's distributed optimizer each DP rank
sends the optimizer shards it owns (flowcheck/torch/megatron.py).  An FSDP2 / DTensor trainer sends each rank's
piece of every DTensor at its global offset, replicated placements once (flowcheck/torch/dtensor.py); it resumes
through ``flowcheck.dcp.Reader``.  Settings are one checked PushConfig (flowcheck/torch/push_config.py).
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any

import torch
import xxhash

from flowcheck import _native
from flowcheck.capture.push.auth import DEFAULT_TOKEN_ENV, PushSigner, read_token
from flowcheck.capture.push.wire import encode_header, recv_header
from flowcheck.errors import AuthError, ConfigError, FlowcheckError
from flowcheck.logs import oneline
from flowcheck.torch import dtensor
from flowcheck.torch.coords import Coordinates
from flowcheck.torch.megatron import MEGATRON_KEY, MegatronRank, hook_targets, model_key
from flowcheck.torch.push_config import PushConfig, push_config
from flowcheck.torch.state import _flatten_optimizer, _json_ready, capture_rng, optimizer_param_names

log = logging.getLogger(__name__)


@dataclass
class CheckpointerStats:
    saves: int = 0
    sent: int = 0
    coalesced: int = 0
    failures: int = 0
    blocked_s: float = 0.0  # total time the trainer was held: wait() and save()'s back-pressure wait
    last_copy_s: float = 0.0
    last_send_s: float = 0.0
    last_error: str | None = None
    buffer_bytes: int = 0
    last_sent_bytes: int = 0  # payload bytes the last push carried (less than buffer_bytes when frozen tensors are kept)
    sent_bytes: int = 0  # payload bytes of every push the node acknowledged
    kept_bytes: int = 0  # bytes of frozen tensors and unchanged buffers not sent again: the node holds them
    resends: int = 0  # pushes sent again whole because the node lacked the frozen tensors (restarted, stale)


@dataclass
class _Entry:
    name: str  # canonical tensor name
    tensor: torch.Tensor  # the box of the local tensor this entry copies
    at: int
    nbytes: int
    offsets: list[int]  # of the box in the canonical global tensor
    local: str  # local state-dict (or optimizer.<slot>.<param>) name
    view: Any  # local tensor -> the box
    # a frozen parameter's key (``_key``) when the node last acknowledged its bytes under the node state
    # ``Checkpointer._node_state``; a save whose key still matches sends it as "kept" (no bytes)
    held: tuple | None = None
    # a buffer's (non-parameter tensor's) slice of the host buffer holds the bytes the node holds: written by a push
    # the node acknowledged, not rewritten since; a save that finds the tensor equal to it sends it as "kept"
    mirrored: bool = False


@dataclass
class _Job:
    step: int
    scalars: dict[str, Any]
    frozen: dict[int, tuple] = field(default_factory=dict)  # entry index -> key (``_key``), frozen when saved
    kept: frozenset[int] = frozenset()  # entries not copied nor sent: the node holds their bytes
    buffers: frozenset[int] = frozenset()  # entries of non-parameter tensors (buffers)
    compare: frozenset[int] = frozenset()  # buffers compared with their mirrored slice before the copy (equal: kept)
    copied: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Checkpointer:
    """Push a trainer's state to a checkpoint node every ``save(step)``; block only in ``wait()``.

    Example::

        ckpt = Checkpointer(model, optimizer, lr_scheduler=sched, node="tcp://127.0.0.1:7377", run="gpt")
        for step, batch in enumerate(data):
            loss = model(batch).loss; loss.backward()
            optimizer.step()          # the hook calls ckpt.wait() first
            optimizer.zero_grad()
            ckpt.save(step + 1)       # returns at once; the copy overlaps the next forward/backward
        ckpt.close()
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, lr_scheduler: Any = None,
                 *, config: PushConfig | None = None, node: str | None = None, run: str | None = None,
                 extra: Any = None, coords: Coordinates | None = None, budget_mib: float | None = None,
                 on_busy: str | None = None, timeout_s: float | None = None, transport: str | None = None,
                 hook: bool | None = None, rng: bool | None = None, arch: Any = None, token: str | None = None) -> None:
        """``config`` (a PushConfig) or its fields as keywords (a keyword given with ``config`` overrides that field);
        ``extra``: JSON scalars (or a callable returning them) pushed with each step; ``coords``: where this rank sits
        (default: detected); ``arch``: a Megatron trainer's model description (flowcheck.restore.arch.ModelArch)."""
        self.config = config = push_config(config, node=node, run=run, budget_mib=budget_mib, on_busy=on_busy,
                                           timeout_s=timeout_s, transport=transport, hook=hook, rng=rng, token=token)
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.address, self.run, self.extra, self.rng = config.address, config.run, extra, config.rng
        self.coords = coords or Coordinates.detect()
        self.arch = arch  # flowcheck.restore.arch.ModelArch: needed for TP/PP trainers (global offsets)
        self.budget, self.on_busy, self.timeout_s, self.shm = config.budget_bytes, config.on_busy, config.timeout_s, config.shm
        self.stats = CheckpointerStats()
        # the node's shared secret: from $FLOWCHECK_NODE_TOKEN unless given; never logged, never sent (only MACs are)
        self._token = config.token if config.token is not None else read_token(DEFAULT_TOKEN_ENV)
        self._signer: PushSigner | None = None
        # set by load(): the first push accepted after it tells the node the state descends from that step
        self.parent: dict[str, Any] | None = None
        self._entries: list[_Entry] = []
        self._specs: list[dict[str, Any]] = []
        self._signature: tuple | None = None
        self._buffer: torch.Tensor | None = None
        self._segment: shared_memory.SharedMemory | None = None
        self._generation = 0  # the segment's counter: odd while the side thread writes the buffer
        self._sock: socket.socket | None = None
        # what the node said it holds: the id of its RAM state (from its last ack) — a state built by a full push;
        # a node that restarted, went stale or replaced its state has another id and refuses "kept" shards
        self._node_state: str | None = None
        self._job: _Job | None = None
        self._lock = threading.Lock()
        self._closed = False
        # a Megatron trainer: its tensors are boxes of the canonical ones (restore's rules need the model)
        self._megatron = MegatronRank(model, optimizer, arch, self.coords) if arch is not None else None
        self._hooks = [opt.register_step_pre_hook(lambda *_: self.wait()) for opt in hook_targets(optimizer)] \
            if config.hook else []

    # ---- the trainer's calls ---------------------------------------------------------------
    def save(self, step: int, *, consumed_train_samples: int | None = None) -> bool:
        """Start pushing the state as of now under ``step``; False if coalesced (a save still in flight).

        ``step`` is the iteration just finished; a Megatron trainer also gives the samples consumed so far (the data
        position), which restore writes back as Megatron's ``consumed_train_samples``."""
        self.stats.saves += 1
        with self._lock:
            job = self._job
        if job is not None and not job.done.is_set():
            if self.on_busy == "coalesce":
                self.stats.coalesced += 1
                return False
            t0 = time.perf_counter()
            finished = job.done.wait(self.timeout_s)  # back-pressure: the previous push is still in flight
            self.stats.blocked_s += time.perf_counter() - t0
            if not finished:
                self.stats.coalesced += 1
                return False
        if self._megatron is not None:
            tensors, scalars = self._megatron.tensors(), self._megatron_scalars(step, consumed_train_samples)
        else:
            opt_state = self.optimizer.state_dict() if self.optimizer is not None else None
            names = optimizer_param_names(self.model, self.optimizer) if self.optimizer is not None else []
            flat = _flatten_optimizer(opt_state, names) if opt_state is not None else None
            tensors, scalars = self._tensors(flat), self._scalars(flat)
        self._plan(tensors)
        job = self._frozen_job(step, scalars, tensors)
        with self._lock:
            self._job = job
        threading.Thread(target=self._run, args=(job,), name=f"flowcheck-push-{step}", daemon=True).start()
        return True

    def wait(self) -> None:
        """Block until the state of the last save is copied out (call before mutating parameters)."""
        job = self._job
        if job is None or job.copied.is_set():
            return
        t0 = time.perf_counter()
        job.copied.wait()
        self.stats.blocked_s += time.perf_counter() - t0

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the last save to reach the node; True if it was acknowledged."""
        job = self._job
        if job is None:
            return True
        job.done.wait(timeout if timeout is not None else self.timeout_s)
        return job.done.is_set() and job.error is None

    def mark_changed(self, *names: str) -> None:
        """Send these frozen parameters (state-dict names; a Megatron rank's: its chunks' keys without the wrappers'
        ``module.``; none given: all) again with the next save.

        Needed only after changing a frozen parameter in a way its version counter does not see (writes through
        ``.data``, or through memory shared with another tensor); in-place torch ops, ``copy_`` and
        ``load_state_dict`` are seen without it."""
        for e in self._entries:
            if not names or e.local in names or (self._megatron is not None and model_key(e.local) in names):
                e.held = None

    def load(self, step: int | str = "latest", *, store: Any = None, config: str | None = None, prefer: str = "auto") -> int:
        """Bring the trainer back to a stored step (model, optimizer, scheduler, RNG); later pushes descend
        from it, so a run that diverges after a restore is a branch in the lineage.  Returns the step."""
        from flowcheck.restore.source import open_step
        from flowcheck.store import open_store
        from flowcheck.torch.state import restore_rng, torch_state_from_snapshot

        if self._megatron is not None:
            raise ConfigError("Checkpointer.load: a Megatron trainer (arch=) resumes from a checkpoint directory: write "
                              "one with `flowcheck restore --step N --tp T --pp P --out DIR` and start Megatron with "
                              "--load DIR (it reshards and loads the distributed optimizer itself)")
        if any(dtensor.is_dtensor(t) for t in self.model.state_dict().values()):
            raise ConfigError("Checkpointer.load: an FSDP2/DTensor trainer resumes through DCP, which reshards to its "
                              "mesh: dcp.load(state, storage_reader=flowcheck.dcp.Reader(config, run=..., step=...)) "
                              "(README: 'PyTorch DCP and FSDP2')")
        store = store if store is not None else open_store(config)
        tier, manifest = open_step(store, step, prefer)
        snap = tier.load(manifest.step)
        model_sd, opt_sd = torch_state_from_snapshot(snap)
        self.model.load_state_dict(model_sd)
        if self.optimizer is not None and opt_sd is not None:
            self.optimizer.load_state_dict(opt_sd)
        if self.lr_scheduler is not None and snap.scalars.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(snap.scalars.lr_scheduler)
        if self.rng and snap.scalars.rng:
            restore_rng(snap.scalars.rng)
        self.parent = {"step": manifest.step, "manifest_digest": manifest.digest()}
        self.mark_changed()
        return manifest.step

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        for handle in self._hooks:
            handle.remove()
        if self._sock is not None:
            self._sock.close()
        if self._segment is not None:
            self._segment.close()
            self._segment.unlink()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- what is sent ------------------------------------------------------------------------
    def _frozen_job(self, step: int, scalars: dict[str, Any], tensors: dict[str, torch.Tensor]) -> _Job:
        """The save's job: which entries are frozen parameters now (and their keys), and which of those the node
        already holds unchanged — those are neither copied nor sent (the push carries them as "kept").

        Unchanged means the same storage, place in it and version counter as when the node acknowledged them: every
        in-place torch op bumps the counter (``.data`` writes do not: ``mark_changed``).  Plain parameters, a Megatron
        rank's boxes and an FSDP2 rank's DTensor pieces alike: the key is the piece's (``_key``)."""
        frozen_names = self._frozen_names()
        frozen = {i: _key(e.tensor, tensors[e.local]) for i, e in enumerate(self._entries) if e.local in frozen_names}
        kept = frozenset(i for i, key in frozen.items()
                         if self._node_state is not None and _same(self._entries[i].held, key) and self._entries[i].nbytes)
        buffer_names = self._buffer_names()
        buffers = frozenset(i for i, e in enumerate(self._entries) if e.local in buffer_names)
        compare = frozenset(i for i in buffers if self._node_state is not None and self._entries[i].mirrored
                            and self.config.skip_unchanged_buffers)
        return _Job(step, scalars, frozen, kept, buffers, compare)

    def _buffer_names(self) -> set[str]:
        """Local keys of the model's buffers (non-parameter tensors: rotary ``inv_freq``, an EMA copy, BatchNorm
        statistics) — compared byte for byte before each copy, since nothing else says exactly that they did not
        change (``.data`` writes do not bump the version counter)."""
        if self._megatron is not None:
            return set(self._megatron.buffers)
        return {n for n, _ in self.model.named_buffers(remove_duplicate=False)}

    def _frozen_names(self) -> set[str]:
        """Local keys of the parameters frozen now: state-dict names (an FSDP2 model's too: fully_shard keeps them),
        or a Megatron rank's chunk keys (flowcheck/torch/megatron.py)."""
        if not self.config.skip_frozen:
            return set()
        if self._megatron is not None:
            return set(self._megatron.frozen)
        return {n for n, p in self.model.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def _tensors(self, flat) -> dict[str, torch.Tensor]:
        state = {k: v for k, v in self.model.state_dict(keep_vars=False).items() if isinstance(v, torch.Tensor)}
        if flat is not None:
            state.update(flat[0])
        return state

    def _plan(self, tensors: dict[str, torch.Tensor]) -> None:
        """Cut this rank's share into shards (DP razor: every dp-th shard) and give each a slice of the host
        buffer — once; later saves only refresh the tensor references."""
        signature = tuple((k, t.dtype, tuple(t.shape)) for k, t in tensors.items())
        if signature == self._signature:
            for e in self._entries:
                e.tensor = e.view(tensors[e.local])
            return
        if self._megatron is not None:
            specs, shared, own = self._megatron.cut(tensors)
        else:
            specs, shared, own = self._plain(tensors)
        shared.sort(key=lambda sh: (sh[0], sh[1]))
        mine = [sh for i, sh in enumerate(shared) if i % self.coords.dp == self.coords.dp_rank]
        mine += sorted(own, key=lambda sh: (sh[0], sh[1]))  # distributed-optimizer shards: only this rank holds them
        entries, at = [], 0
        for name, offsets, local, view in mine:
            t = view(tensors[local])
            nbytes = t.numel() * t.element_size()
            entries.append(_Entry(name, t, at, nbytes, offsets, local, view))
            at += nbytes
        if self.budget is not None and at > self.budget:
            raise FlowcheckError(f"Checkpointer: this rank's share of the state is {at / 2**20:.1f} MiB, over the "
                                 f"host memory budget of {self.budget / 2**20:.1f} MiB")
        self._allocate(at)
        self._entries, self._signature, self._specs = entries, signature, specs

    def _plain(self, tensors: dict[str, torch.Tensor]) -> tuple[list[dict], list[tuple], list[tuple]]:
        """A plain (data-parallel) or FSDP2/DTensor trainer: plain tensors whole under their state-dict names (DP
        replicas share them out), DTensors as this rank's piece of the global tensor (flowcheck/torch/dtensor.py)."""
        c = self.coords
        if c.tp > 1 or c.pp > 1:
            raise ConfigError("Checkpointer: a tensor/pipeline-parallel trainer must pass arch= (a "
                              "flowcheck.restore.arch.ModelArch) so its shards are recorded in the global index space")
        return dtensor.cut(tensors)

    def _allocate(self, nbytes: int) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment.unlink()
            self._segment = None
        if self.shm:
            self._segment = shared_memory.SharedMemory(create=True, size=generation_at(nbytes) + 8)
            self._generation = 0
            self._buffer = torch.frombuffer(self._segment.buf, dtype=torch.uint8, count=max(nbytes, 1))
        else:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self._buffer = buf.pin_memory() if torch.cuda.is_available() else buf
        self.stats.buffer_bytes = nbytes

    def _scalars(self, flat) -> dict[str, Any]:
        _, opt, step_count = flat if flat is not None else (None, None, None)
        sched = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
        extra = dict(self.extra() if callable(self.extra) else (self.extra or {}))
        c = self.coords
        extra["push"] = {"dp": c.dp, "tp": c.tp, "pp": c.pp, "vpp": c.vpp,
                         "dedup": "each shard is sent by one data-parallel rank (round-robin by name); "
                                  "TP-replicated shards by TP rank 0 only; a distributed optimizer's shards by "
                                  "the data-parallel rank that owns them"}
        if self.arch is not None:
            extra["model"] = self.arch.to_json()  # restore needs the model description
        return {"optimizer_step": step_count, "optimizer": opt,
                "lr_scheduler": _json_ready(sched, "lr_scheduler.state_dict()") if sched is not None else None,
                "rng": capture_rng() if self.rng else {}, "extra": _json_ready(extra, "extra")}

    def _megatron_scalars(self, step: int, consumed: int | None) -> dict[str, Any]:
        """The optimizer's param groups and step, the scheduler, iteration and samples consumed: what restore needs
        to write Megatron's ``optimizer.param_groups``, ``opt_param_scheduler``, ``iteration`` and args."""
        groups, step_count = self._megatron.param_groups()
        groups = _json_ready(groups, "the optimizer's param_groups")
        scalars = self._scalars((None, {"param_groups": groups} if groups else None, step_count))
        mine = {"param_groups": groups, "iteration": step}
        if scalars["lr_scheduler"] is not None:
            mine["opt_param_scheduler"] = scalars["lr_scheduler"]
        if consumed is not None:
            mine["consumed_train_samples"] = int(consumed)
        given = scalars["extra"].get(MEGATRON_KEY)  # what the trainer's extra= adds (Megatron-LM's args, ...)
        scalars["extra"][MEGATRON_KEY] = {**(given if isinstance(given, dict) else {}), **mine}
        return scalars

    # ---- the side thread -----------------------------------------------------------------------
    def _run(self, job: _Job) -> None:
        try:
            t0 = time.perf_counter()
            self._copy(job)
            self.stats.last_copy_s = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001
            job.error = e
            job.copied.set()
            job.done.set()
            self._failed(job, e)
            return
        job.copied.set()
        try:
            t0 = time.perf_counter()
            self._send(job)
            self.stats.last_send_s = time.perf_counter() - t0
            self.stats.sent += 1
        except BaseException as e:  # noqa: BLE001 - the trainer goes on; the failure is reported
            job.error = e
            self._failed(job, e)
        finally:
            job.done.set()

    def _copy(self, job: _Job) -> None:
        """Copy every entry but the kept ones into the host buffer; a buffer equal to its mirrored slice (CPU tensors:
        compared in place, 1.3-1.8x the time of the copy it saves; a change usually shows in the first bytes) joins
        ``job.kept``.  A CUDA buffer is copied: comparing it would bring it to the host first, which is the copy."""
        seg = self._segment
        if seg is not None:  # odd: a node still reading the previous frame sees its copy torn and refuses it
            self._generation += 1 if self._generation % 2 == 0 else 2
            _native.generation_store(seg.buf, generation_at(self.stats.buffer_bytes), self._generation)
        buf = self._buffer
        stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        host = buf.numpy() if stream is None else None
        unchanged = set()
        with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else _null()):
            for i, e in enumerate(self._entries):
                if e.nbytes and i not in job.kept:
                    src = e.tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                    if i in job.compare and not src.is_cuda and _equal_bytes(src, buf[e.at:e.at + e.nbytes]):
                        unchanged.add(i)
                        continue
                    e.mirrored = False  # rewritten: it holds what the node holds once this push is acknowledged
                    if src.is_cuda or host is None:
                        buf[e.at:e.at + e.nbytes].copy_(src, non_blocking=stream is not None)
                    else:  # around the cache: the training step on the other core keeps its lines
                        _native.copy_into(host[e.at:e.at + e.nbytes], src.numpy(), threads=1, stream=True)
        if stream is not None:
            stream.synchronize()
        job.kept = job.kept | unchanged
        if seg is not None:
            self._generation += 1
            _native.generation_store(seg.buf, generation_at(self.stats.buffer_bytes), self._generation)

    def _send(self, job: _Job) -> None:
        """Send the job's push; a node that lacks the frozen tensors it carries as kept (it restarted, went stale or
        holds another state) answers ``resend`` and gets the whole buffer at once (it still holds their bytes)."""
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
            raise FlowcheckError(f"node refused step {job.step}: {answer.get('message')}")
        self._acknowledged(job, answer, sent, kept)
        if header["parent"] is not None and header["parent"] is self.parent:
            # the node now knows where this run resumed from; later steps descend from what it commits
            # next (sending the resume point with every push re-parented each snapshot onto it)
            self.parent = None

    def _push(self, job: _Job, kept: frozenset[int]) -> tuple[dict[str, Any], dict[str, Any], int, frozenset[int]]:
        """One push frame and the node's answer: (header, answer, payload bytes sent, the entries sent as kept).  Kept
        shards keep their slot in the buffer's byte layout (``at``) but carry no bytes: over TCP only the others are
        sent, in order; through shared memory the node does not read them."""
        sock = self._connect()
        if not self._signer.hello.get("kept_shards"):
            kept = frozenset()  # a node from before kept shards (its hello does not offer them): send everything
        buf = memoryview(self._buffer.numpy())[: self.stats.buffer_bytes]
        pieces = [buf] if not kept else [buf[e.at:e.at + e.nbytes] for i, e in enumerate(self._entries)
                                         if i not in kept and e.nbytes]
        sent = sum(len(p) for p in pieces)
        if self._segment is not None:
            payload = {"bytes": self.stats.buffer_bytes, "shm": self._segment.name, "generation": self._generation,
                       "generation_at": generation_at(self.stats.buffer_bytes)}
        else:
            h = xxhash.xxh3_128()
            for piece in pieces:
                h.update(piece)
            payload = {"bytes": self.stats.buffer_bytes, "digest": "xxh3-128:" + h.hexdigest()}
        c = self.coords
        header = {
            "kind": "push", "run": self.run, "step": job.step, "sender": c.sender, "senders": c.senders,
            "source_layout": {"tp": c.tp, "pp": c.pp, "dp": c.dp, "vpp": c.vpp}, "tensors": self._specs,
            "shards": [{"tensor": e.name, "offsets": e.offsets, "shape": list(e.tensor.shape), "at": e.at,
                        **({"kept": True} if i in kept else {})} for i, e in enumerate(self._entries)],
            "scalars": job.scalars, "parent": self.parent,
            "payload": payload,
        }
        if kept:
            header["base"] = self._node_state  # the node state that holds the kept shards' bytes
        header = self._signer.sign(header)
        sock.sendall(encode_header(header))
        if self._segment is None:
            for piece in pieces:
                sock.sendall(piece)
        return header, recv_header(sock), sent, kept

    def _acknowledged(self, job: _Job, answer: dict[str, Any], sent: int, kept: frozenset[int]) -> None:
        """Record what the node now holds: its state id, and the frozen tensors this push carried (their keys)."""
        state = answer.get("state")
        if state != self._node_state or not isinstance(state, str):
            for e in self._entries:  # another node state (or a node that names none): it holds nothing of ours yet
                e.held = None
            self._node_state = state if isinstance(state, str) else None
        for i, key in job.frozen.items():
            if i not in kept:  # sent: the node holds it as of this key (kept: what it holds is unchanged)
                self._entries[i].held = key
        for i in job.buffers:  # sent, or kept because equal to its slice: the slice is what the node holds
            self._entries[i].mirrored = True
        sent_kept = sum(self._entries[i].nbytes for i in kept)
        self.stats.last_sent_bytes = sent
        self.stats.sent_bytes += sent
        self.stats.kept_bytes += sent_kept

    def _connect(self) -> socket.socket:
        """The node connection, opened (and greeted: a fresh challenge, the node's proof) on first use, and again
        when the node closed it meanwhile (it closes push connections idle past its serve.idle_timeout_s)."""
        if self._sock is not None and _closed_by_peer(self._sock):
            self._drop()
        if self._sock is None:
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
            self._signer = PushSigner.handshake(sock, self._token, self.run, "%s:%d" % self.address, DEFAULT_TOKEN_ENV)
        return self._sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None  # reconnect (and greet again) on the next save
            self._signer = None

    def _failed(self, job: _Job, e: BaseException) -> None:
        self.stats.failures += 1
        self.stats.last_error = f"step {job.step}: {type(e).__name__}: {e}"
        log.warning("checkpoint push of step %d failed (%s); training continues", job.step, oneline(e))


def _key(piece: torch.Tensor, whole: Any) -> tuple:
    """What says a frozen piece's bytes did not change between saves: its storage (held by the key, so no other tensor
    can be allocated at its address meanwhile), its address in it, and the version counters of the piece and of the
    tensor it is cut from (in-place ops on a DTensor bump the DTensor's counter, not its local shard's)."""
    return piece.untyped_storage(), piece.data_ptr(), piece._version, whole._version


def _equal_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two uint8 CPU tensors hold the same bytes: torch.equal over the widest integer view both allow (byte
    by byte it runs ~20x slower; integers compare bits, so NaNs and -0.0 are told apart exactly)."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if a.numel() % size == 0 and a.storage_offset() % size == 0 and b.storage_offset() % size == 0:
            return torch.equal(a.view(dtype), b.view(dtype))
    return torch.equal(a, b)


def _same(held: tuple | None, key: tuple) -> bool:
    return held is not None and held[0].data_ptr() == key[0].data_ptr() and held[1:] == key[1:]


def _closed_by_peer(sock: socket.socket) -> bool:
    """True when an idle connection has something to read: the node only answers frames, so that is its close
    (EOF or a reset) — sending on it would lose this save."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def generation_at(nbytes: int) -> int:
    """Where a shared-memory segment holding an ``nbytes`` payload keeps its generation counter (8-aligned)."""
    return (nbytes + 7) // 8 * 8


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
