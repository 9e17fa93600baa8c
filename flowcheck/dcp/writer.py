"""``flowcheck.dcp.Writer``: a PyTorch DCP StorageWriter that saves every rank's chunks as one flowcheck step.

DCP's protocol, and what each call does here: ``prepare_global_plan`` (coordinator) decides the step's specs, key
index, branch and parent once (flowcheck/dcp/target.py); ``write_data`` (every rank) stores the rank's chunks as
its part of the step (flowcheck/dcp/parts.py) and returns the part manifest and its bytes items in the write
results; ``finish`` (coordinator, called by DCP only when every rank's writes succeeded) stores the bytes items,
merges the parts and commits the step manifest.  ``dcp.save`` and ``dcp.async_save`` take the same Writer.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from flowcheck import evidence
from flowcheck.config import Config
from flowcheck.dcp import parts, staging
from flowcheck.dcp.index import object_name, tensor_name
from flowcheck.dcp.target import SaveTarget, check_tier, open_config, plan_save
from flowcheck.errors import ConfigError, FlowcheckError
from flowcheck.manifest import Manifest, ParentRef
from flowcheck.state import Shard, Snapshot, StateLayout, TensorSpec
from flowcheck.store import Store

log = logging.getLogger(__name__)
PART = MetadataIndex("_flowcheck_part")  # the write result carrying a rank's part manifest


@dataclass(frozen=True)
class Stored:
    """A write result's storage data: which part holds the item (bytes items carry their bytes to the coordinator;
    the ``PART`` result carries the rank's part manifest)."""

    node: str
    name: str  # tensor name in the step
    data: bytes | None = None
    # the part manifest as an object: DCP's gather already pickles the write results between the ranks of this job,
    # so it travels without a JSON round trip (~15x cheaper than parsing it back); nothing of it is read from storage,
    # and the step manifest that lists it is parsed back by the readers' own parser before it is committed
    part: Manifest | None = None


class Writer(StorageWriter, AsyncStager):
    """Save a DCP checkpoint as step ``step`` of ``run``, in the local tier (zarr) or the object tier (safetensors).

    ``where``: a ``Config``, a config file, an fsspec URL (the object tier there) or a folder (a local tier root).
    ``parent``: ``"auto"`` (what this process loaded or last saved in the run, flowcheck/evidence.py; a process that
    did neither starts a new root and logs how to name the parent), None (a new lineage), a step number (that step
    of the current branch), a ``ParentRef``, or the ``Reader`` the trainer resumed with (its step, once: a save
    after a resume is a branch of the resumed step, see docs/format.md, "Branches").  ``reuse_staging``: ``dcp.async_save`` stages the state into the
    CPU copy the previous async save of this run and tier used, once that save has stored it (flowcheck/dcp/staging.py;
    False: a fresh copy each time).  Example::

        dcp.save(state, storage_writer=flowcheck.dcp.Writer("flowcheck.yaml", run="gpt", step=step))
    """

    _synchronize_after_execute = False  # staging is done when ``stage`` returns

    def __init__(self, where: Config | str | None = None, *, step: int, run: str | None = None,
                 tier: str | None = None, parent: Any = "auto", reuse_staging: bool = True) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"flowcheck.dcp.Writer: step: expected a non-negative integer, found {step!r}")
        evidence.check_parent("flowcheck.dcp.Writer", parent)
        self.config, default_tier = open_config(where, run)
        self.tier = check_tier(tier or default_tier, self.config)
        self.step, self.parent, self.reuse_staging = step, parent, reuse_staging
        self.committed: Manifest | None = None
        self._staged: staging.Staged | None = None
        self.reset()

    # ---- DCP's calls ------------------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``dcp.async_save``'s copy of the state into CPU memory (what it blocks on)."""
        staged, self._staged = staging.stage(state_dict, (self.config.run, self.tier) if self.reuse_staging else None)
        return staged

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_staged"] = None  # a process-based async save: the staged copy stays this process's (never reused)
        # and what this process loaded or saved goes with it: the saving process knows nothing of it otherwise
        state["_known"] = evidence.parent_for(self.config.run, self.step)
        return state

    def synchronize_staging(self) -> None:
        pass  # ``stage`` returns once the copy is made

    def close(self) -> None:
        pass

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            log.debug("flowcheck.dcp.Writer: ignoring checkpoint_id %r (the step is step=%d)", checkpoint_id, self.step)
        self.rank, self.is_coordinator, self._target = 0, True, None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ConfigError("flowcheck.dcp.Writer: use_collectives=False saves each rank on its own, but a flowcheck "
                              "step is committed once for all ranks by the coordinator; save with use_collectives=True")
        self.is_coordinator, self.rank = is_coordinator, int(kwargs.get("rank", 0) or 0)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"flowcheck:{self.config.run}/step-{self.step}")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        store = Store(self.config)
        parent = self._parent(store)
        target = store.placement(self.step, self.tier, parent)  # the branch, its fork record written first
        return plan_save(plans, run=self.config.run, step=self.step, tier=self.tier, branch=target.branch,
                         parent=parent)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            return self._write_data(plan, planner)
        finally:
            if self._staged is not None:  # this rank's staged bytes are stored (or the save failed): free for reuse
                self._staged.release()
                self._staged = None

    def _write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        target: SaveTarget = plan.storage_data
        self._target = target
        results, data = [], {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raw = bytes(planner.resolve_data(item).getbuffer())
                results.append(WriteResult(item.index, len(raw), Stored(parts.OBJECTS_NODE, object_name(item.index.fqn),
                                                                        raw)))
                continue
            name = tensor_name(item.index.fqn)
            chunk = item.tensor_data.chunk
            data[Shard(name, tuple(chunk.offsets), tuple(chunk.sizes))] = _host(planner.resolve_data(item))
            results.append(WriteResult(item.index, item.tensor_storage_size() or 0, Stored(target.node, name)))
        if data:
            snap = Snapshot(target.run, target.step, target.layout(), data, target.scalars)
            part = parts.write_part(Store(self.config), target, snap, target.node)
            results.append(WriteResult(PART, part.nbytes, Stored(target.node, "", part=part)))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        target = self._target
        if target is None:
            raise FlowcheckError("flowcheck.dcp.Writer.finish: this rank planned nothing of the save (DCP calls finish "
                                 "on the coordinator, after its write_data)")
        found = {r.storage_data.node: _part(r.storage_data, self.step) for rs in results for r in rs if r.index == PART}
        blobs = {r.storage_data.name: r.storage_data.data for rs in results for r in rs
                 if isinstance(r.storage_data, Stored) and r.storage_data.node == parts.OBJECTS_NODE}
        store = Store(self.config)
        objects = parts.write_part(store, target, _objects(target, blobs), parts.OBJECTS_NODE) if blobs else None
        manifest = parts.step_manifest(target, found, objects, "dcp")
        same = store.committed_same_state(manifest, target.tier)
        if same is not None:  # the same state saved again at its step (a retried save): a no-op, as Store.commit
            parts.discard(store, target, {**found, **({parts.OBJECTS_NODE: objects} if objects else {})})
            log.info("%s tier: step %d of run %s is already committed with this state (manifest %s); nothing new "
                     "committed", target.tier, target.step, target.run, same.digest())
            self.committed = same
        else:
            self.committed = parts.commit(store, target, manifest)
        evidence.saved(self.config.run, self.committed.parent_ref())
        consumed = getattr(self.parent, "resumed", None)
        if consumed is not None and self.committed.parent == consumed:
            self.parent.resumed = None  # the resume point is in the lineage now: later saves continue this branch

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # chosen explicitly (storage_writer=), never from a bare checkpoint_id

    # ---- helpers --------------------------------------------------------------------------
    def _parent(self, store: Store) -> ParentRef | None:
        p = self.parent
        if hasattr(p, "resumed"):  # a flowcheck.dcp.Reader: its step, until a save recorded it
            p = p.resumed if p.resumed is not None else "auto"
        if p == "auto":
            return self._auto_parent(store)
        if isinstance(p, int):  # checked in the constructor: a step number
            tier, n = store.locate(p)  # StepNotFoundError names the branches that hold it
            return tier.manifest(n).parent_ref()
        return p  # None or a ParentRef

    def _auto_parent(self, store: Store) -> ParentRef | None:
        """What this process loaded or last saved in the run (flowcheck/evidence.py), held by this store; else a new
        root, said in one line when the run already holds states (where the newest would have been taken)."""
        run = self.config.run
        known = evidence.parent_for(run, self.step) or getattr(self, "_known", None)
        if known is not None and known.ref is None:  # this process pushed the run: the node committed it
            return store.head_before(self.step)
        hist = store.history()
        if known is not None and hist.by_digest(known.ref.manifest_digest):
            return known.ref
        if hist.states:
            log.warning("%s", evidence.root_hint("flowcheck.dcp.Writer", run, self.step))
        return None


def _part(stored: Any, step: int) -> Manifest:
    part = getattr(stored, "part", None)
    if not isinstance(part, Manifest):
        raise FlowcheckError(f"flowcheck.dcp.Writer.finish: step {step}: a rank's part result carries "
                             f"{type(part).__name__}, expected its part manifest (a rank of another flowcheck version?)")
    return part


def _host(t: Any) -> np.ndarray:
    """A CPU numpy view of a resolved chunk (copied off an accelerator; a non-contiguous view made contiguous)."""
    from flowcheck.torch.state import to_numpy

    if not isinstance(t, torch.Tensor):
        raise FlowcheckError(f"flowcheck.dcp.Writer: DCP resolved a tensor item to a {type(t).__name__}")
    return to_numpy(t)


def _objects(target: SaveTarget, blobs: dict[str, bytes]) -> Snapshot:
    specs = tuple(TensorSpec(name, "uint8", (len(raw),)) for name, raw in sorted(blobs.items()))
    data = {Shard.whole(s): np.frombuffer(blobs[s.name], dtype=np.uint8) for s in specs}
    layout = StateLayout(specs, target.layout().source)
    return Snapshot(target.run, target.step, layout, data, target.scalars)
