"""``flowcheck.dcp.Reader``: a PyTorch DCP StorageReader over any stored flowcheck step, so ``dcp.load`` reshards it.

``read_metadata`` describes the step to DCP — each tensor's global shape and its stored shards as DCP chunks
(boxes in the global index space: what DCP's chunks are), each bytes item — and DCP's own planner decides which
piece of which chunk every rank needs, at any world size or mesh.  ``read_data`` reads each stored shard the
plan touches once, through the fastest tier holding the step with its digest checked (falling back to an intact
copy in another tier): a shard DCP wants whole (a rank loading the layout it saved) straight into the rank's
tensor, any other into a buffer the asked-for pieces are copied out of.  Bytes items go through the
allow-listed loader first (flowcheck/dcp/objects.py says exactly where anything is unpickled).  Steps pushed
by a ``Checkpointer`` (no DCP index) are presented under ``get_state_dict``'s keys (flowcheck/dcp/index.py).
"""
from __future__ import annotations

import collections
import io
import logging
import math
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from flowcheck import dtypes, evidence
from flowcheck.config import Config
from flowcheck.dcp import objects
from flowcheck.dcp.index import PUSH_KEYS, PushKeys, View, view_of
from flowcheck.dcp.target import cores_per_rank, node_name, open_config
from flowcheck.errors import ConfigError, FlowcheckError
from flowcheck.manifest import Manifest, ParentRef
from flowcheck.store import Store
from flowcheck.tiers.cluster import NODES
from flowcheck.tiers.fallback import DAMAGE
from flowcheck.tiers.local import packed_runs

log = logging.getLogger(__name__)
PREFETCH_BYTES = 256 << 20  # what a rank asks the disk to start reading while the ranks plan (its part's first runs)
READERS = 4  # at most this many threads read a run (native, in parts of >= 16 MiB) per rank
RUN_ELEMENTS = 64 << 20  # the most one read spans (256 MiB of fp32; a pack holds at most 512 MB): few long reads
# keep the kernel's readahead going (BENCHMARKS.md: 16 MiB runs were clearly slower, 64 vs 256 MiB within noise)


class LoadMismatchError(FlowcheckError, RuntimeError):
    """The ranks of one ``dcp.load`` resolved different stored states (``latest`` moved while they read it)."""


class Reader(StorageReader):
    """Load step ``step`` (a number, ``latest`` or ``sha256:<prefix>``) of ``run`` through DCP's own resharding.

    ``where`` as for ``Writer``; ``prefer``: ``auto`` (fastest tier, falling back to an intact copy), ``local`` or
    ``object``; ``trust_pickle`` / ``safe_globals``: see flowcheck/dcp/objects.py; ``push_keys``: the top-level keys
    a step pushed by a ``Checkpointer`` is loaded under (flowcheck/dcp/index.py); ``direct``: read a stored shard
    that DCP wants whole, into a CPU tensor of its dtype, straight into that tensor (False: always through a buffer,
    then copied — the benchmark's before/after); ``prefetch``: on the local tier, ask the disk for the first
    ``PREFETCH_BYTES`` of the part this rank saved as soon as the step is located, so it reads while the rank parses
    the manifest and DCP plans (False: reads start with ``read_data``).  After ``dcp.load``,
    ``resumed`` is the loaded state (``ParentRef``): pass the Reader as a ``Writer``'s ``parent`` so the next save
    descends from it.  Example::

        reader = flowcheck.dcp.Reader("flowcheck.yaml", run="gpt", step="latest")
        dcp.load(state, storage_reader=reader)
    """

    def __init__(self, where: Config | str | None = None, *, step: int | str = "latest", run: str | None = None,
                 branch: str | None = None, prefer: str = "auto", trust_pickle: bool = False,
                 safe_globals: Sequence[Any] = (), push_keys: PushKeys = PUSH_KEYS, direct: bool = True,
                 prefetch: bool = True) -> None:
        if prefer not in ("auto", "local", "object"):
            raise ConfigError(f"flowcheck.dcp.Reader: prefer: expected 'auto', 'local' or 'object', found {prefer!r}")
        self.config, _ = open_config(where, run)
        self.step, self.branch, self.prefer = _checked_step(step), branch, prefer
        # what can be checked now is: a missing folder, an unknown run, branch, step or digest is one FlowcheckError
        # here, not DCP's CheckpointException (a BaseException) after two logged tracebacks inside dcp.load
        Store(self.config).stored(self.step, prefer, branch)
        self.trust_pickle, self.safe_globals = trust_pickle, tuple(safe_globals)
        self.push_keys, self.direct, self.prefetch = push_keys, direct, prefetch
        self._resumed: ParentRef | Manifest | None = None  # the loaded manifest; its digest once asked for
        self._tier: Any = None
        self._manifest: Manifest | None = None
        self._view: View | None = None
        self._where: dict[MetadataIndex, Any] = {}

    # ---- DCP's calls ------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._where = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        store = Store(self.config)
        at = store.stored(self.step, self.prefer, self.branch)
        if self.prefetch and hasattr(at[0], "will_need"):
            _prefetch(*at)
        tier, m = store.open_step(self.step, self.prefer, self.branch, at=at)
        where = f"{tier.name} tier step {m.step} of run {m.run}"
        view = view_of(list(m.tensors), m.scalars, where, self.push_keys)
        entries: dict[str, Any] = {}
        self._where = {}
        for key, name in view.tensors.items():
            t = m.tensors[name]
            chunks = [ChunkStorageMetadata(torch.Size(s.offsets), torch.Size(s.shape)) for s in t.shards]
            dtype = getattr(torch, dtypes.dtype(t.dtype).torch)
            entries[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(t.global_shape), chunks)
            self._where.update({MetadataIndex(key, torch.Size(s.offsets)): (name, i) for i, s in enumerate(t.shards)})
        for key in [*view.objects, *view.made]:
            entries[key] = BytesStorageMetadata()
            self._where[MetadataIndex(key)] = key
        self._tier, self._manifest, self._view = tier, m, view
        self._resumed = m
        meta = StorageMeta(checkpoint_id=f"flowcheck:{m.run}/step-{m.step}")
        return Metadata(entries, planner_data=dict(view.planner_data) or None, storage_data=None, storage_meta=meta)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._manifest is None:
            raise FlowcheckError("flowcheck.dcp.Reader: set_up_storage_reader before read_metadata")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        m = self._manifest  # the state this rank read: every rank must have read the same (its digest costs a JSON pass)
        plan.storage_data = (m.step, self._branch(), m.created_at, m.layout_digest)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        states = {p.storage_data for p in plans}
        if len(states) > 1:
            raise LoadMismatchError(f"flowcheck.dcp.Reader: the ranks resolved step {self.step!r} to different states "
                                    f"({sorted(states)}): a save committed "
                                    "while they read; load again (or load a step number)")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_source: dict[Any, list[Any]] = {}
        for req in plan.items:
            by_source.setdefault(self._where[req.storage_index], []).append(req)
        for key in [k for k in by_source if k in self._view.made]:  # rebuilt from the step's JSON scalars
            for req in by_source.pop(key):
                planner.load_bytes(req, io.BytesIO(objects.saved(self._view.made[key])))
        stored = {(self._view.objects[k], 0): k for k in by_source if isinstance(k, str)}  # bytes items' uint8 shards
        direct = self._destinations(by_source, planner) if self.direct else {}
        for source, src in self._read(sorted(set(stored) | {k for k in by_source if not isinstance(k, str)}), direct):
            if source in stored:
                for req in by_source[stored[source]]:
                    planner.load_bytes(req, self._bytes(stored[source], src))
                continue
            if source in direct:
                req, dest = direct[source]
                if src.data_ptr() != dest.data_ptr():  # read elsewhere (a damaged run read again shard by shard)
                    dest.copy_(src.reshape(dest.shape))
                planner.commit_tensor(req, dest)
                continue
            for req in by_source[source]:
                piece = narrow_tensor_by_index(src, req.storage_offsets, req.lengths)
                dest = planner.resolve_tensor(req).detach()
                if dest.size() != piece.size():
                    raise FlowcheckError(f"flowcheck.dcp.Reader: {req.storage_index.fqn}: DCP asked for "
                                         f"{list(piece.size())} into a tensor of {list(dest.size())}")
                dest.copy_(piece)
                planner.commit_tensor(req, dest)
        if self.resumed is not None:  # what this process's next save of the run descends from (flowcheck/evidence.py)
            evidence.loaded(self.config.run, self.resumed)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    @property
    def resumed(self) -> ParentRef | None:
        """The state the last ``dcp.load`` read (None before one, or once a Writer recorded it as a save's parent)."""
        if isinstance(self._resumed, Manifest):
            self._resumed = self._resumed.parent_ref()
        return self._resumed

    @resumed.setter
    def resumed(self, value: ParentRef | None) -> None:
        self._resumed = value

    def _branch(self) -> str:
        return getattr(self._tier, "branch", "main")

    # ---- reads -------------------------------------------------------------------------
    def _destinations(self, by_source: dict[Any, list[Any]], planner: LoadPlanner) -> dict[Any, tuple[Any, torch.Tensor]]:
        """``{source: (read item, destination tensor)}`` for the stored shards a rank can read straight into DCP's
        destination: one read item asking for the whole shard, into a contiguous CPU tensor of the stored dtype and
        size (a rank loading what it saved, at the same layout).  Any other shard is read whole into a buffer (its
        digest covers the whole shard) and the asked-for pieces are copied out."""
        m, out = self._manifest, {}
        for source, reqs in by_source.items():
            if isinstance(source, str) or len(reqs) != 1:
                continue
            name, i = source
            req, entry = reqs[0], m.tensors[name].shards[i]
            if any(req.storage_offsets) or tuple(req.lengths) != tuple(entry.shape):
                continue
            dest = planner.resolve_tensor(req).detach()
            if (dest.device.type == "cpu" and dest.is_contiguous() and not dest.is_conj() and not dest.is_neg()
                    and tuple(dest.shape) == tuple(entry.shape)
                    and dest.dtype == getattr(torch, dtypes.dtype(m.tensors[name].dtype).torch)):
                out[source] = (req, dest)
        return out

    def _read(self, sources: list[tuple[str, int]], direct: dict[Any, tuple[Any, torch.Tensor]] | None = None
              ) -> Iterator[tuple[tuple[str, int], torch.Tensor]]:
        """``(source, shard)`` for each stored shard named, whole and digest-checked, as a CPU tensor of its dtype.

        On the local tier, shards lying together in a pack (a rank reads back what it saved: one part, in order)
        are read as runs, one native pass each (tiers/local.py ``read_packed_run``); a shard with a ``direct``
        destination is read straight into that tensor's memory (the shard yielded is then that tensor), the others
        into a buffer, and the next run is read while this one is copied out.  Anything else, and a run found
        damaged, is read shard by shard through the tier (which falls back to an intact copy in another tier)."""
        m, direct = self._manifest, direct or {}
        items = [(name, m.tensors[name].shards[i]) for name, i in sources]
        source = {(name, e.offsets): (name, i) for (name, i), (_, e) in zip(sources, items)}
        runs, rest = packed_runs(items, RUN_ELEMENTS) if hasattr(self._tier, "read_packed_run") else ([], items)
        threads = cores_per_rank(READERS)

        def into(name: str, entry: Any) -> np.ndarray | None:
            hit = direct.get(source[(name, entry.offsets)])
            return None if hit is None else hit[1].reshape(-1).view(torch.uint8).numpy()

        def read(unit: tuple[str, list[tuple[str, Any]]]) -> list[np.ndarray | torch.Tensor]:
            kind, run = unit
            try:
                if kind == "packed":
                    dests = [into(name, entry) for name, entry in run]
                    arrays = self._tier.read_packed_run(m, run, threads, dests)
                    return [direct[source[(n, e.offsets)]][1] if d is not None else a
                            for (n, e), d, a in zip(run, dests, arrays)]
                if kind == "into":
                    self._tier.read_shards_into(m, run, [into(name, entry) for name, entry in run])
                    return [direct[source[(n, e.offsets)]][1] for n, e in run]
            except DAMAGE:
                pass  # shard by shard: the error names the shard, or another tier holds an intact copy
            return [self._tier.read_shard(m, name, entry) for name, entry in run]

        # the object tier reads a shard DCP wants whole by ranged reads straight into its tensor, in batches of
        # up to a run's size (a few large concurrent requests); the others through its read-ahead, one by one
        batches = _batches([it for it in rest if source[(it[0], it[1].offsets)] in direct], RUN_ELEMENTS) \
            if hasattr(self._tier, "read_shards_into") else []
        batched = {(n, e.offsets) for b in batches for n, e in b}
        units = ([("packed", run) for run in runs] + [("into", b) for b in batches]
                 + [("single", [it]) for it in rest if (it[0], it[1].offsets) not in batched])
        # runs: one read ahead (at most two in memory, each read on `threads`); single shards: `threads` at once
        for (_, run), arrays in _ahead(read, units, 1 if runs or batches else threads):
            for (name, entry), arr in zip(run, arrays):
                got = arr if isinstance(arr, torch.Tensor) else _tensor(arr.reshape(entry.shape), m.tensors[name].dtype)
                yield source[(name, entry.offsets)], got

    def _bytes(self, key: str, src: torch.Tensor) -> io.BytesIO:
        """A bytes item from its stored uint8 shard, through the allow-listed loader (flowcheck/dcp/objects.py)."""
        name = self._view.objects[key]
        where = f"{self._tier.name} tier step {self._manifest.step} ({name})"
        return objects.for_planner(src.numpy().tobytes(), key, where, trust_pickle=self.trust_pickle,
                                   safe_globals=self.safe_globals)


def _checked_step(step: Any) -> int | str:
    """A step reference as the store resolves it: a number, ``latest``, or a ``sha256:<hex>`` digest prefix."""
    if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        return step
    if isinstance(step, str) and (step == "latest" or _DIGEST_PREFIX.fullmatch(step)):
        return step.lower()
    raise ConfigError(f"flowcheck.dcp.Reader: step: expected a step number, 'latest' or a manifest digest prefix "
                      f"'sha256:<hex>', found {step!r}")


_DIGEST_PREFIX = re.compile(r"sha256:[0-9a-fA-F]{1,64}")


def _prefetch(tier: Any, n: int) -> None:
    """Let the disk start, on a thread, on what this rank most likely reads of step ``n``, while it parses the step's
    manifest and DCP plans the load: the local tier's part this rank saved (``nodes/rank-<rank>``: a load at the
    layout it saved), or every part in a process of its own."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    folder = "" if rank is None else f"{NODES}/{node_name(rank)}"

    def run() -> None:
        try:
            tier.will_need(n, folder, PREFETCH_BYTES)
        except OSError as e:  # only a head start: the reads find and report what is wrong
            log.debug("flowcheck.dcp.Reader: prefetch of step %d stopped: %s", n, e)

    threading.Thread(target=run, name="flowcheck-dcp-prefetch", daemon=True).start()


def _batches(items: list[tuple[str, Any]], most: int) -> list[list[tuple[str, Any]]]:
    """``items`` (whole shards) in order, cut into batches of at most ``most`` elements (a larger shard alone)."""
    out: list[list[tuple[str, Any]]] = []
    size = 0
    for item in items:
        n = math.prod(item[1].shape)
        if not out or size + n > most:
            out.append([])
            size = 0
        out[-1].append(item)
        size += n
    return out


def _tensor(arr: np.ndarray, dtype: str) -> torch.Tensor:
    if not arr.flags.writeable:
        arr = arr.copy()  # torch shares the buffer: it must be writable
    if dtype == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _ahead(read: Callable[[Any], Any], items: list[Any], workers: int) -> Iterator[tuple[Any, Any]]:
    """``(item, read(item))`` in order, with up to ``workers`` reads in flight on threads (the tiers' reads and digests
    release the GIL), so reading the next shards overlaps copying this one; at most ``workers`` + 1 shards in memory."""
    if len(items) <= 1:
        yield from ((item, read(item)) for item in items)
        return
    with ThreadPoolExecutor(min(workers, len(items)), thread_name_prefix="flowcheck-dcp-read") as pool:
        pending = collections.deque((item, pool.submit(read, item)) for item in items[:workers])
        rest = iter(items[workers:])
        try:
            while pending:
                item, fut = pending.popleft()
                nxt = next(rest, None)
                if nxt is not None:
                    pending.append((nxt, pool.submit(read, nxt)))
                yield item, fut.result()
        finally:
            for _, fut in pending:
                fut.cancel()
