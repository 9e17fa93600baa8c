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

import logging
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from flowcheck import _native, evidence
from flowcheck.capture.push.auth import DEFAULT_TOKEN_ENV, PushSigner, read_token
from flowcheck.capture.push.buffers import generation_at  # noqa: F401 - where a segment's counter is (tests, tools)
from flowcheck.errors import ConfigError, FlowcheckError
from flowcheck.logs import oneline
from flowcheck.manifest import ParentRef
from flowcheck.torch import dtensor
from flowcheck.torch.coords import Coordinates
from flowcheck.torch.device_copy import DeviceCopier, order_after
from flowcheck.torch.host_buffer import HostBuffers
from flowcheck.torch.launch import agree_launch
from flowcheck.torch.megatron import MegatronRank, hook_targets, model_key
from flowcheck.torch.push_client import PushClient
from flowcheck.torch.push_config import PushConfig, push_config
from flowcheck.torch.push_plan import PushPlan, _Entry, _Job
from flowcheck.torch.state import OPT_PREFIX, _flatten_optimizer, optimizer_param_names

if TYPE_CHECKING:
    from flowcheck.store import Store

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


class Checkpointer(PushPlan, PushClient):
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

    # the push settings as attributes, read from ``config`` (code written against them keeps working)
    run = property(lambda self: self.config.run)
    address = property(lambda self: self.config.address)
    on_busy = property(lambda self: self.config.on_busy)
    timeout_s = property(lambda self: self.config.timeout_s)
    shm = property(lambda self: self.config.shm)
    budget = property(lambda self: self.config.budget_bytes)
    rng = property(lambda self: self.config.rng)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, lr_scheduler: Any = None,
                 *, config: PushConfig | None = None, coords: Coordinates | None = None, arch: Any = None,
                 extra: Any = None, parent: Any = "auto", **settings: Any) -> None:
        """``config``: a PushConfig, or its fields as keywords (``node=``, ``run=``, ``budget_mib=``, ``on_busy=``,
        ``timeout_s=``, ``transport=``, ...; a keyword given with ``config`` overrides that field);
        ``extra``: JSON scalars (or a callable returning them) pushed with each step; ``coords``: where this rank sits
        (default: detected); ``arch``: a Megatron trainer's model description (flowcheck.restore.arch.ModelArch);
        ``parent``: what the first push descends from — ``"auto"`` (what ``load()``, a ``flowcheck.dcp.Reader`` or an
        earlier save of this process brought the run to, flowcheck/evidence.py; none: a new root, logged), None (a
        new root), a step number N (step N of the node's current branch: a job that resumed from a directory
        ``flowcheck restore`` wrote), a ``ParentRef``, or the ``Reader`` the trainer loaded with."""
        evidence.check_parent("Checkpointer", parent)
        self.config = config = push_config(config, **settings)
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.extra = extra
        self.coords = coords or Coordinates.detect()
        self.launch = agree_launch(self.coords)  # which launch of the job this is: a newer one supersedes it at the node
        self.superseded: str | None = None  # why the node refuses this trainer's pushes (a newer launch took over)
        self.arch = arch  # flowcheck.restore.arch.ModelArch: needed for TP/PP trainers (global offsets)
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
        if self.config.on_busy == "coalesce":
            self.stats.coalesced += 1
            self._busy_log(f"checkpoint: save of step {step} skipped (coalesced): the push of step {job.step} is still "
                      f"in flight ({self.stats.coalesced} of {self.stats.saves} saves skipped)")
            return False
        t0 = time.perf_counter()
        finished = free.wait(self.config.timeout_s)  # back-pressure: the previous push is still in flight
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
        job.done.wait(timeout if timeout is not None else self.config.timeout_s)
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

    def load(self, step: int | str = "latest", *, store: Store | None = None, config: str | None = None, prefer: str = "auto") -> int:
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
        if self.config.rng and snap.scalars.rng:
            restore_rng(snap.scalars.rng)
        self.parent = manifest.parent_ref()
        evidence.loaded(self.config.run, self.parent)
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
            region = host.acquire(self._held, self.config.timeout_s)
        if region is None:
            raise FlowcheckError(f"step {job.step}: the node still holds all {len(host)} shared-memory segments after "
                                 f"{self.config.timeout_s:.0f} s (a snapshot in flight reads them); this save is not pushed")
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

    def _failed(self, job: _Job, e: BaseException) -> None:
        self.stats.failures += 1
        self.stats.last_error = f"step {job.step}: {type(e).__name__}: {e}"
        log.warning("checkpoint push of step %d failed (%s); training continues", job.step, oneline(e))


def _equal_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two uint8 CPU tensors hold the same bytes: torch.equal over the widest integer view both allow (byte
    by byte it runs ~20x slower; integers compare bits, so NaNs and -0.0 are told apart exactly)."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if a.numel() % size == 0 and a.storage_offset() % size == 0 and b.storage_offset() % size == 0:
            return torch.equal(a.view(dtype), b.view(dtype))
    return torch.equal(a, b)


STEP_PREFIX = OPT_PREFIX + "step."  # an optimizer's per-parameter step counters (torch Adam/AdamW)
_BUSY_LOG_EVERY_S = 10.0  # back-pressure is logged at most this often (saving every iteration may hit it often)
