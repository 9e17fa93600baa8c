"""Stored tensors read straight into a writer's memory: from the object tier, ranged GETs land in place.

A restore into ``torch_dist`` holds the whole checkpoint in memory before DCP writes it (layers stacked, the
vocabulary padded).  Read shard by shard, every byte would land in a read buffer and be copied into the stacked
tensor; read here, a tensor stored as one whole shard is fetched into the writer's own tensor (the tier's
``read_shards_into``: its digest checked as its last bytes land), IN_FLIGHT batches of about BATCH bytes at a
time, handed on in order as each completes.  A batch found damaged is read again tensor by tensor
through the tier (which names the damage, or reads an intact copy from another tier).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from flowcheck import dtypes
from flowcheck.errors import FormatError, IntegrityError, ManifestError, TierError

BATCH = 256 << 20  # bytes of tensors read per request batch (the object tier's read-ahead size)
IN_FLIGHT = 2  # batches read at once (each as ranged GETs of up to 64 MiB on the tier's reader threads)
# a copy that reads wrong or not at all (a missing file included): read tensor by tensor, the errors name it
_DAMAGE = (IntegrityError, FormatError, ManifestError, TierError, OSError)

Job = tuple[Any, Any, str]  # (param, slot, stored tensor name)
Destination = Callable[[Any, Any, tuple[int, ...], torch.dtype], "torch.Tensor | None"]


def read_into(reader: Any, jobs: list[Job], destination: Destination,
              finish: Callable[[Job, torch.Tensor | None], list]) -> Iterator[list]:
    """``finish(job, tensor)`` for every job, in order: ``tensor`` is the writer's own tensor the stored bytes were
    read into (``destination(param, slot, shape, dtype)`` gave it), or None where the job reads the usual way (no
    destination, several shards, or a damaged batch)."""
    m = reader.manifest
    plan: list[tuple[Job, torch.Tensor | None]] = []
    for job in jobs:
        t = m.tensors[job[2]]
        whole = len(t.shards) == 1 and tuple(t.shards[0].shape) == tuple(t.global_shape)
        dt = getattr(torch, dtypes.dtype(t.dtype).torch)
        plan.append((job, destination(job[0], job[1], tuple(t.global_shape), dt) if whole else None))
    batches = _batches(plan, m)
    pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="flowcheck-restore-read")
    reads: list[Future] = [pool.submit(_read_batch, reader, batch) for batch in batches]
    try:
        for batch, read in zip(batches, reads):
            placed = read.result()
            for job, dest in batch:
                yield finish(job, dest if placed and dest is not None else None)
    finally:
        for f in reads:
            f.cancel()  # a restore that failed reads nothing more
        pool.shutdown(wait=True)


def _batches(plan: list, m: Any) -> list[list]:
    """The plan in runs of about BATCH bytes, cut where the next tensor lies in another file than the last one
    (a store is asked for each file's bytes once: moto reads a whole object for every ranged GET), or past
    4 x BATCH in one file (a retry re-reads one batch)."""
    out: list[list] = [[]]
    size, last = 0, None
    for job, dest in plan:
        t = m.tensors[job[2]]
        n = math.prod(t.global_shape) * dtypes.dtype(t.dtype).itemsize
        pieces = t.shards[0].location if t.shards else ()
        where = pieces[0].path if pieces else None
        if out[-1] and size + n > BATCH and (where != last or size + n > 4 * BATCH):
            out.append([])
            size = 0
        out[-1].append((job, dest))
        size, last = size + n, where
    return out


def _read_batch(reader: Any, batch: list) -> bool:
    """The batch's tensors that have a destination read into it; False when the batch was found damaged (its
    destinations then hold bytes that must not be used: the caller reads those tensors again the usual way)."""
    m = reader.manifest
    items = [(job[2], m.tensors[job[2]].shards[0]) for job, dest in batch if dest is not None]
    if not items:
        return True
    dests = [dest.reshape(-1).view(torch.uint8).numpy() for _, dest in batch if dest is not None]
    try:
        reader.tier.read_shards_into(m, items, dests)
    except _DAMAGE:
        return False
    return True
