"""The trainer-side Checkpointer: lazy asynchronous push of the training state to a checkpoint node.

DataStates-LLM's recipe: host buffers allocated once per rank and reused (page-locked when CUDA is
present; shared-memory segments when the node is on the same host, which it adopts as its RAM state without a
copy — flowcheck/torch/host_buffer.py); ``save(step)`` returns at once and a side thread copies every tensor out
while forward/backward run; ``wait()`` — called by a hook right before ``optimizer.step()`` — is the only point
that blocks; then the push goes to the node.  CUDA tensors are copied on a side stream ordered after the
trainer's streams by events, staged device-to-device when memory allows, so ``wait()`` holds the optimizer step
(on the device, not the host) only for a device-to-device copy (flowcheck/torch/device_copy.py).  Over TCP the
payload carries its xxh3-128 digest; through shared memory nothing can corrupt it on the way: a generation counter
after the payload (odd while the side thread writes, even when done) and a lease word (set while the node holds
the segment) keep both sides off each other's bytes, and nobody hashes 0.7 GB twice per save.  A push is
acknowledged once the node holds it as its RAM state.  A save asked while the previous one is still in flight is
coalesced (skipped) or waits (the only other point that may block, bounded by ``timeout_s``), and
``stats`` and the log say which; a slow or dead node is reported and training goes on.  When the node has a token (``FLOWCHECK_NODE_TOKEN``) the trainer needs the same one
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

import itertools
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import xxhash

from flowcheck import _native, evidence
from flowcheck.capture.push.auth import DEFAULT_TOKEN_ENV, PushSigner, read_token
from flowcheck.capture.push.buffers import generation_at  # noqa: F401 - where a segment's counter is (tests, tools)
from flowcheck.capture.push.launch import Superseded
from flowcheck.capture.push.wire import ROOT, encode_header, recv_header
from flowcheck.errors import AuthError, ConfigError, FlowcheckError
from flowcheck.logs import oneline
from flowcheck.manifest import ParentRef
from flowcheck.torch import dtensor
from flowcheck.torch.coords import Coordinates
from flowcheck.torch.device_copy import DeviceCopier, order_after
from flowcheck.torch.host_buffer import HostBuffers
from flowcheck.torch.launch import agree_launch
from flowcheck.torch.megatron import MEGATRON_KEY, MegatronRank, hook_targets, model_key
from flowcheck.torch.push_config import PushConfig, push_config
from flowcheck.torch.state import OPT_PREFIX, _flatten_optimizer, _json_ready, capture_rng, optimizer_param_names

log = logging.getLogger(__name__)


@dataclass
class CheckpointerStats:
    saves: int = 0
    sent: int = 0
    coalesced: int = 0
    failures: int = 0
    blocked_s: float = 0.0  # total time the trainer was held: wait() and save()'s back-pressure wait
    busy_waits: int = 0  # saves that waited for the previous push (on_busy="wait")
    busy_wait_s: float = 0.0  # of blocked_s, the time those saves waited
    lease_waits: int = 0  # pushes whose copy waited for the node to give a host segment back (a snapshot held it)
    staged: bool = False  # whether the last save was staged on the device (gpu_staging)
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
    # the host region whose slice of this buffer (non-parameter tensor) holds the bytes the node holds: written by a
    # push the node acknowledged, not rewritten since; a save that finds the tensor equal to it sends it as "kept"
    mirrored_in: int | None = None


@dataclass
class _Job:
    step: int
    scalars: dict[str, Any]
    frozen: dict[int, tuple] = field(default_factory=dict)  # entry index -> key (``_key``), frozen when saved
    kept: frozenset[int] = frozenset()  # entries not copied nor sent: the node holds their bytes
    buffers: frozenset[int] = frozenset()  # entries of non-parameter tensors (buffers)
    compare: frozenset[int] = frozenset()  # buffers compared with their mirrored slice before the copy (equal: kept)
    after: list = field(default_factory=list)  # (device, event) on the trainer's streams at save(): copies follow
    copied_on: list = field(default_factory=list)  # (device, event) marking the device copies wait() orders after
    region: int | None = None  # the host region the push is in
    digest: tuple | None = None  # (kept entries, payload digest) computed after the copy (TCP)
    copied: threading.Event = field(default_factory=threading.Event)  # the trainer may change its tensors (host side)
    drained: threading.Event = field(default_factory=threading.Event)  # in the host region: the staging buffer is free
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def end(self) -> None:
        for ev in (self.copied, self.drained, self.done):
            ev.set()


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
                 hook: bool | None = None, rng: bool | None = None, arch: Any = None, token: str | None = None,
                 gpu_staging: int | str | None = None, parent: Any = "auto") -> None:
        """``config`` (a PushConfig) or its fields as keywords (a keyword given with ``config`` overrides that field);
        ``extra``: JSON scalars (or a callable returning them) pushed with each step; ``coords``: where this rank sits
        (default: detected); ``arch``: a Megatron trainer's model description (flowcheck.restore.arch.ModelArch);
        ``parent``: what the first push descends from — ``"auto"`` (what ``load()``, a ``flowcheck.dcp.Reader`` or an
        earlier save of this process brought the run to, flowcheck/evidence.py; none: a new root, logged), None (a
        new root), a step number N (step N of the node's current branch: a job that resumed from a directory
        ``flowcheck restore`` wrote), a ``ParentRef``, or the ``Reader`` the trainer loaded with."""
        evidence.check_parent("Checkpointer", parent)
        self.config = config = push_config(config, node=node, run=run, budget_mib=budget_mib, on_busy=on_busy,
                                           timeout_s=timeout_s, transport=transport, hook=hook, rng=rng, token=token,
                                           gpu_staging=gpu_staging)
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.address, self.run, self.extra, self.rng = config.address, config.run, extra, config.rng
        self.coords = coords or Coordinates.detect()
        self.launch = agree_launch(self.coords)  # which launch of the job this is: a newer one supersedes it at the node
        self.superseded: str | None = None  # why the node refuses this trainer's pushes (a newer launch took over)
        self.arch = arch  # flowcheck.restore.arch.ModelArch: needed for TP/PP trainers (global offsets)
        self.budget, self.on_busy, self.timeout_s, self.shm = config.budget_bytes, config.on_busy, config.timeout_s, config.shm
        self.stats = CheckpointerStats()
        # the node's shared secret: from $FLOWCHECK_NODE_TOKEN unless given; never logged, never sent (only MACs are)
        self._token = config.token if config.token is not None else read_token(DEFAULT_TOKEN_ENV)
        self._signer: PushSigner | None = None
        # set by load(): the first push accepted after it tells the node the state descends from that step
        self.parent: ParentRef | None = None
        self._parent_arg = parent  # what the first push descends from when load() was not called
        self._lineage_told = False  # a push was acknowledged: the node chains later steps to what it commits
        self._root_logged = False
        self._entries: list[_Entry] = []
        self._specs: list[dict[str, Any]] = []
        self._signature: tuple | None = None
        self._host: HostBuffers | None = None  # the host regions pushes are copied into (segments, or one buffer)
        self._held: int | None = None  # the region the node's RAM state was last acknowledged in
        self._copier = DeviceCopier(config.gpu_staging)
        self._sock: socket.socket | None = None
        self._node_id: str | None = None  # the node (receiver instance) that holds our lent segments
        self._busy_logged_at = -_BUSY_LOG_EVERY_S
        self._cpu_at: dict[int, int] = {}
        self._cpu_stage: torch.Tensor | None = None
        # what the node said it holds: the id of its RAM state (from its last ack) — a state built by a full push;
        # a node that restarted, went stale or replaced its state has another id and refuses "kept" shards
        self._node_state: str | None = None
        self._job: _Job | None = None
        self._lock = threading.Lock()
        self._closed = False
        # a Megatron trainer: its tensors are boxes of the canonical ones (restore's rules need the model)
        self._megatron = MegatronRank(model, optimizer, arch, self.coords) if arch is not None else None
        if self._megatron is not None:
            self.arch = self._megatron.arch  # with the padded vocabulary the step stores
        self._hooks = [opt.register_step_pre_hook(lambda *_: self.wait()) for opt in hook_targets(optimizer)] \
            if config.hook else []

    # ---- the trainer's calls ---------------------------------------------------------------
    def save(self, step: int, *, consumed_train_samples: int | None = None) -> bool:
        """Start pushing the state as of now under ``step``; False if coalesced (a save still in flight).

        ``step`` is the iteration just finished; a Megatron trainer also gives the samples consumed so far (the data
        position), which restore writes back as Megatron's ``consumed_train_samples``."""
        self.stats.saves += 1
        if self.superseded is not None:
            self.stats.coalesced += 1
            return False
        with self._lock:
            job = self._job
        if job is not None and not self._may_follow(job, step):
            return False
        if self._megatron is not None:
            tensors, scalars = self._megatron.tensors(), self._megatron_scalars(step, consumed_train_samples)
        else:
            opt_state = self.optimizer.state_dict() if self.optimizer is not None else None
            names = optimizer_param_names(self.model, self.optimizer) if self.optimizer is not None else []
            flat = _flatten_optimizer(opt_state, names, device_steps=False) if opt_state is not None else None
            tensors, scalars = self._tensors(flat), self._scalars(flat)
        self._plan(tensors)
        job = self._frozen_job(step, scalars, tensors)
        job.after = self._copier.mark()  # the copies come after everything the trainer enqueued until now
        self.stats.staged = self._copier.staged
        with self._lock:
            previous, self._job = self._job, job
        threading.Thread(target=self._run, args=(job, previous), name=f"flowcheck-push-{step}", daemon=True).start()
        return True

    def _busy_log(self, message: str) -> None:
        now = time.monotonic()
        if now - self._busy_logged_at >= _BUSY_LOG_EVERY_S:
            self._busy_logged_at = now
            log.info("%s", message)

    def _may_follow(self, job: _Job, step: int) -> bool:
        """Whether a save may start behind ``job``, the push still in flight: once its copy left the staging buffer
        (or, unstaged, once it was acknowledged).  ``on_busy`` says whether to skip (coalesce) or wait, at most
        ``timeout_s``; both are counted and logged."""
        free = job.drained if self._copier.staged else job.done
        if free.is_set():
            return True
        if self.on_busy == "coalesce":
            self.stats.coalesced += 1
            self._busy_log(f"checkpoint: save of step {step} skipped (coalesced): the push of step {job.step} is still "
                      f"in flight ({self.stats.coalesced} of {self.stats.saves} saves skipped)")
            return False
        t0 = time.perf_counter()
        finished = free.wait(self.timeout_s)  # back-pressure: the previous push is still in flight
        waited = time.perf_counter() - t0
        self.stats.blocked_s += waited
        self.stats.busy_waits += 1
        self.stats.busy_wait_s += waited
        self._busy_log(f"checkpoint: save of step {step} waited {waited:.3f} s for the push of step {job.step}")
        if not finished:
            self.stats.coalesced += 1
            return False
        return True

    def wait(self) -> None:
        """Until the state of the last save is copied out (call before mutating parameters).  CUDA tensors: the host
        waits only until the copies are enqueued; the trainer's current streams then wait for them on the device."""
        job = self._job
        if job is None:
            return
        if not job.copied.is_set():
            t0 = time.perf_counter()
            job.copied.wait()
            self.stats.blocked_s += time.perf_counter() - t0
        if job.copied_on:
            order_after(job.copied_on)

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
                              "(docs/dcp.md)")
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
        self.parent = manifest.parent_ref()
        evidence.loaded(self.run, self.parent)
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
        if self._host is not None:
            self._host.close()

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
        compare = frozenset(i for i in buffers if self._node_state is not None
                            and self._entries[i].mirrored_in is not None and self.config.skip_unchanged_buffers)
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
        if self._job is not None:  # its push still reads the host regions and entries about to be replaced
            self._job.done.wait(self.timeout_s)
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
        self._copier.plan([e.tensor for e in entries], [e.at for e in entries], [e.nbytes for e in entries])
        cpu = [i for i, e in enumerate(entries) if not e.tensor.is_cuda and e.nbytes]
        self._cpu_at = dict(zip(cpu, itertools.accumulate((entries[i].nbytes for i in cpu), initial=0)))
        # a staged job's CPU tensors wait here for their host region (the staging buffer's host-side twin)
        self._cpu_stage = torch.empty(sum(entries[i].nbytes for i in cpu), dtype=torch.uint8) \
            if self._copier.staged else None

    def _plain(self, tensors: dict[str, torch.Tensor]) -> tuple[list[dict], list[tuple], list[tuple]]:
        """A plain (data-parallel) or FSDP2/DTensor trainer: plain tensors whole under their state-dict names (DP
        replicas share them out), DTensors as this rank's piece of the global tensor (flowcheck/torch/dtensor.py)."""
        c = self.coords
        if c.tp > 1 or c.pp > 1:
            raise ConfigError("Checkpointer: a tensor/pipeline-parallel trainer must pass arch= (a "
                              "flowcheck.restore.arch.ModelArch) so its shards are recorded in the global index space")
        return dtensor.cut(tensors)

    def _allocate(self, nbytes: int) -> None:
        """The host regions: ``segments`` shared-memory segments (the node adopts a filled one as its state, so the
        trainer fills another meanwhile), or one buffer streamed over TCP."""
        if self._host is not None:
            self._host.close()
        self._host = HostBuffers(nbytes, self.config.segments if self.shm else 1, self.shm)
        self._host.lends = bool(self._signer is not None and self._signer.hello.get("adopts_segments"))
        self._held = None
        for e in self._entries:
            e.mirrored_in = None
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
        adam = self._megatron.adam()
        if adam is not None:
            mine["adam"] = adam  # restore --adam auto writes the optimizer state in this Adam's form
        if scalars["lr_scheduler"] is not None:
            mine["opt_param_scheduler"] = scalars["lr_scheduler"]
        if consumed is not None:
            mine["consumed_train_samples"] = int(consumed)
        given = scalars["extra"].get(MEGATRON_KEY)  # what the trainer's extra= adds (Megatron-LM's args, ...)
        scalars["extra"][MEGATRON_KEY] = {**(given if isinstance(given, dict) else {}), **mine}
        return scalars

    # ---- the side thread -----------------------------------------------------------------------
    def _run(self, job: _Job, previous: _Job | None) -> None:
        try:
            self._copy_out(job, previous)
        except BaseException as e:  # noqa: BLE001
            job.error = e
            job.end()
            self._failed(job, e)
            return
        try:
            t0 = time.perf_counter()
            self._send(job)
            self.stats.last_send_s = time.perf_counter() - t0
            self.stats.sent += 1
        except BaseException as e:  # noqa: BLE001 - the trainer goes on; the failure is reported
            job.error = e
            self._failed(job, e)
        finally:
            job.end()

    def _copy_out(self, job: _Job, previous: _Job | None) -> None:
        """Copy the job's entries into a host region; ``job.copied`` as soon as the trainer may change its tensors.

        Staged: CUDA tensors device-to-device and CPU tensors into the CPU stage, then ``copied``; the host region
        (free once the previous push is acknowledged and the node gave the region back) is filled behind the
        trainer's next iterations.  Unstaged: the region first, then the copies straight into it."""
        t0 = time.perf_counter()
        cuda = frozenset(sl.entry for sl in self._copier.slots)
        cpu = [i for i in range(len(self._entries)) if i not in cuda]
        if self._copier.staged:
            job.copied_on = self._copier.copy([e.tensor for e in self._entries], job.kept, job.after, None)
            self._copy_host(job, cpu, lambda i: self._cpu_stage[self._cpu_at[i]:self._cpu_at[i] + self._entries[i].nbytes])
            job.copied.set()
            self.stats.last_copy_s = time.perf_counter() - t0
        if previous is not None:
            previous.done.wait()  # one push on the wire at a time, in order
        region = self._acquire(job)
        host, buf = self._host, self._host.regions[region]
        host.begin_write(region)
        if self._copier.staged:
            self._copier.drain(job.kept, buf)
            for i in cpu:
                e = self._entries[i]
                if i not in job.kept and e.nbytes:
                    stage = self._cpu_stage[self._cpu_at[i]:self._cpu_at[i] + e.nbytes]
                    _native.copy_into(buf[e.at:e.at + e.nbytes].numpy(), stage.numpy(), threads=1, stream=True)
        else:
            if cuda:
                job.copied_on = self._copier.copy([e.tensor for e in self._entries], job.kept, job.after, buf)
            self._copy_host(job, cpu, lambda i: buf[self._entries[i].at:self._entries[i].at + self._entries[i].nbytes])
            job.copied.set()
            self._copier.synchronize()
            self.stats.last_copy_s = time.perf_counter() - t0
        host.end_write(region)
        job.region = region
        job.drained.set()
        self._device_step_count(job, buf)
        if not host.shm:  # hashed now, not on the wire's time: the bytes were just written (and are still in cache)
            job.digest = (job.kept, self._digest(job.region, job.kept))

    def _copy_host(self, job: _Job, indices: list[int], dst) -> None:
        """Copy CPU entries into ``dst(i)``; a buffer equal to the slice the node holds (compared in place, 1.3-1.8x
        the time of the copy it saves; a change usually shows in the first bytes) joins ``job.kept`` instead.  A CUDA
        buffer is copied: comparing it would bring it to the host first, which is the copy."""
        unchanged = set()
        with torch.no_grad():
            for i in indices:
                e = self._entries[i]
                if not e.nbytes or i in job.kept:
                    continue
                src = e.tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                if i in job.compare and e.mirrored_in is not None and \
                        _equal_bytes(src, self._host.regions[e.mirrored_in][e.at:e.at + e.nbytes]):
                    unchanged.add(i)
                    continue
                e.mirrored_in = None  # rewritten: it holds what the node holds once this push is acknowledged
                # around the cache: the training step on the other core keeps its lines
                _native.copy_into(dst(i).numpy(), src.numpy(), threads=1, stream=True)
        job.kept = job.kept | unchanged

    def _acquire(self, job: _Job) -> int:
        """A host region the node does not hold, waiting (``timeout_s`` at most) for the node to give one back."""
        host = self._host
        region = host.acquire(self._held, 0.0)
        if region is None:
            self.stats.lease_waits += 1
            region = host.acquire(self._held, self.timeout_s)
        if region is None:
            raise FlowcheckError(f"step {job.step}: the node still holds all {len(host)} shared-memory segments after "
                                 f"{self.timeout_s:.0f} s (a snapshot in flight reads them); this save is not pushed")
        return region

    def _fill(self, job: _Job, indices: frozenset[int]) -> None:
        """Copy entries the job kept (not copied) into its region after all: the node lacks them (a resend)."""
        host, region = self._host, job.region
        buf = host.regions[region]
        host.begin_write(region)
        cuda = frozenset(sl.entry for sl in self._copier.slots)
        if indices & cuda:
            self._copier.copy([e.tensor for e in self._entries], frozenset(range(len(self._entries))) - indices,
                              [], buf)
            self._copier.synchronize()
        plain = replace(job, kept=frozenset(), compare=frozenset())
        self._copy_host(plain, sorted(indices - cuda),
                        lambda i: buf[self._entries[i].at:self._entries[i].at + self._entries[i].nbytes])
        host.end_write(region)

    def _device_step_count(self, job: _Job, buf: torch.Tensor) -> None:
        """The optimizer step count from CUDA ``step`` tensors, read from their host copy (``.item()`` in ``save()``
        would wait for the device)."""
        values = [float(torch.frombuffer(bytearray(buf[e.at:e.at + e.nbytes].numpy()), dtype=e.tensor.dtype).max())
                  for e in self._entries
                  if e.tensor.is_cuda and e.nbytes and e.local.startswith(STEP_PREFIX)]
        if values:
            known = job.scalars.get("optimizer_step")
            job.scalars["optimizer_step"] = max(int(max(values)), known if isinstance(known, int) else 0)

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
        evidence.pushed(self.run, job.step)

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
        header = {
            "kind": "push", "run": self.run, "step": job.step, "sender": c.sender, "senders": c.senders,
            "source_layout": {"tp": c.tp, "pp": c.pp, "dp": c.dp, "vpp": c.vpp}, "tensors": self._specs,
            "shards": [{"tensor": e.name, "offsets": e.offsets, "shape": list(e.tensor.shape), "at": e.at,
                        **({"kept": True} if i in kept else {})} for i, e in enumerate(self._entries)],
            "scalars": job.scalars, "parent": self._header_parent(job.step),
            **({"launch": self.launch.to_json()} if self.launch is not None else {}),
            "payload": payload, "trainer": self._trainer_report(),
        }
        if kept:
            header["base"] = self._node_state  # the node state that holds the kept shards' bytes
        header = self._signer.sign(header)
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
            known = evidence.parent_for(self.run, step)
            if known is None:
                if not self._root_logged:
                    self._root_logged = True
                    log.warning("%s", evidence.root_hint("Checkpointer", self.run, step))
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
                "on_busy": self.on_busy}

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
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
            self._signer = PushSigner.handshake(sock, self._token, self.run, "%s:%d" % self.address, DEFAULT_TOKEN_ENV)
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

    def _failed(self, job: _Job, e: BaseException) -> None:
        self.stats.failures += 1
        self.stats.last_error = f"step {job.step}: {type(e).__name__}: {e}"
        log.warning("checkpoint push of step %d failed (%s); training continues", job.step, oneline(e))


def _ref_json(ref: ParentRef) -> dict[str, Any]:
    return {"step": ref.step, "manifest_digest": ref.manifest_digest}


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


STEP_PREFIX = OPT_PREFIX + "step."  # an optimizer's per-parameter step counters (torch Adam/AdamW)
_BUSY_LOG_EVERY_S = 10.0  # back-pressure is logged at most this often (saving every iteration may hit it often)
