"""What a Checkpointer sends (a mixin of Checkpointer): the entries of the host buffer — each tensor's box of its
canonical tensor, the data-parallel share of this rank — and which entries a save may send as kept (frozen
parameters whose version did not move, buffers equal to what the node holds)."""
from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from flowcheck.errors import ConfigError, FlowcheckError
from flowcheck.torch import dtensor
from flowcheck.torch.host_buffer import HostBuffers
from flowcheck.torch.megatron import MEGATRON_KEY
from flowcheck.torch.state import _json_ready, capture_rng


log = logging.getLogger(__name__)


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


class PushPlan:
    """What is sent (a mixin of Checkpointer: it uses the model, optimizer, coordinates and host buffers)."""

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
            self._job.done.wait(self.config.timeout_s)
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
        if self.config.budget_bytes is not None and at > self.config.budget_bytes:
            raise FlowcheckError(f"Checkpointer: this rank's share of the state is {at / 2**20:.1f} MiB, over the "
                                 f"host memory budget of {self.config.budget_bytes / 2**20:.1f} MiB")
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
        self._host = HostBuffers(nbytes, self.config.segments if self.config.shm else 1, self.config.shm)
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
                "rng": capture_rng() if self.config.rng else {}, "extra": _json_ready(extra, "extra")}

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


def _key(piece: torch.Tensor, whole: Any) -> tuple:
    """What says a frozen piece's bytes did not change between saves: its storage (held by the key, so no other tensor
    can be allocated at its address meanwhile), its address in it, and the version counters of the piece and of the
    tensor it is cut from (in-place ops on a DTensor bump the DTensor's counter, not its local shard's)."""
    return piece.untyped_storage(), piece.data_ptr(), piece._version, whole._version


def _same(held: tuple | None, key: tuple) -> bool:
    return held is not None and held[0].data_ptr() == key[0].data_ptr() and held[1:] == key[1:]
