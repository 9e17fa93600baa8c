"""Mirror capture scaled out: which parameters one of K checkpoint nodes decodes, updates and stores.

Every node of a scaled-out mirror capture receives the same mirrored traffic (switch multicast, or one
mirror port per node) and parses all of it — the ring schedule it tracks needs every stream's sends —
but places only the final-chunk data of the parameters it owns and updates only them.  Ownership is by
whole parameters, in contiguous runs of the steady allreduce order balanced by element count, so node i
of K owns about 1/K of every iteration's gradient and its part of a step is the full tensors of its
parameters (and their optimizer slots); the cluster commit (tiers/cluster.py) merges the parts.

With global-norm clipping no node sees the whole gradient: each publishes the norms of its own
parameters' gradients (``NormExchange``) and every node computes the total from all of them in
``model.parameters()`` order, as ``clip_grad_norm_`` does.
"""
from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass

from flowcheck.capture.mirror.job import Bucket, Job
from flowcheck.errors import JobError


@dataclass(frozen=True)
class Partition:
    """This node's share: part ``index`` (0-based) of ``of``; ``of`` = 1 is the whole state."""

    index: int = 0
    of: int = 1

    def __post_init__(self) -> None:
        for name in ("index", "of"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise JobError(f"mirror partition.{name}: expected an integer, found {v!r}")
        if self.of < 1 or not 0 <= self.index < self.of:
            raise JobError(f"mirror partition: expected 0 <= index < of and of >= 1, found index {self.index}, "
                           f"of {self.of}")

    @property
    def whole(self) -> bool:
        return self.of == 1

    def owned(self, job: Job) -> frozenset[str]:
        """The parameters this part owns (every parameter when whole)."""
        return frozenset(n for n, part in owners(job, self.of).items() if part == self.index)

    def ranges(self, job: Job, bucket: Bucket) -> list[tuple[int, int]]:
        """[start, end) element ranges of ``bucket``'s allreduced vector that this part owns, merged."""
        if self.whole:
            return [(0, bucket.elements)]
        if not bucket.params:
            raise JobError("mirror partition: the job's buckets must list their parameters to split them across nodes")
        mine, numel = self.owned(job), {p.name: p.numel for p in job.parameters}
        out: list[tuple[int, int]] = []
        at = 0
        for name in bucket.params:
            end = at + numel[name]
            if name in mine and end > at:
                if out and out[-1][1] == at:
                    out[-1] = (out[-1][0], end)
                else:
                    out.append((at, end))
            at = end
        return out


def owners(job: Job, parts: int) -> dict[str, int]:
    """Parameter -> part: contiguous runs of the steady allreduce order, split where the running element count
    crosses k/parts of the total (a parameter belongs to the part its middle element falls in)."""
    if not job.trains:
        raise JobError("mirror partition: the job must name its parameters, bucket contents and optimizer "
                       "(the parts are sets of parameters)")
    if parts > len(job.parameters):
        raise JobError(f"mirror partition: of {parts} parts, but the job has only {len(job.parameters)} parameters; "
                       "expected at most one part per parameter")
    numel = {p.name: p.numel for p in job.parameters}
    order = [n for b in job.buckets for n in b.params]
    total = sum(numel.values()) or 1
    out, at = {}, 0
    for i, name in enumerate(order):
        # never leave a later part empty: the last parts-1-k parameters go one per remaining part at worst
        part = min((2 * at + numel[name]) * parts // (2 * total), parts - 1)
        part = max(part, parts - (len(order) - i))
        if out and part < out[order[i - 1]]:
            part = out[order[i - 1]]
        out[name] = part
        at += numel[name]
    empty = sorted(set(range(parts)) - set(out.values()))
    if empty:
        raise JobError(f"mirror partition: part {empty[0]} of {parts} would own no parameter (one parameter holds "
                       "most of the gradient); expected fewer parts")
    return out


class NormExchange:
    """Per-parameter gradient norms of one iteration, shared by the parts through a directory every node sees.

    Each part writes ``iter-<N>/part-<i>-of-<K>.json`` (the float32 bit patterns, so the total every node
    computes is exactly the trainer's) by write-then-rename, and reads the others' as they appear.
    """

    def __init__(self, directory: str, partition: Partition, wait_s: float = 60.0) -> None:
        if not directory:
            raise JobError("mirror partition: a job that clips gradients needs an exchange directory for the norms")
        self.directory, self.partition, self.wait_s = directory, partition, wait_s

    def _path(self, iteration: int, index: int) -> str:
        return os.path.join(self.directory, f"iter-{iteration:09d}", f"part-{index}-of-{self.partition.of}.json")

    def publish(self, iteration: int, norms: dict[str, float]) -> None:
        path = self._path(iteration, self.partition.index)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        body = {n: struct.pack("<f", v).hex() for n, v in norms.items()}
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, path)

    def gather(self, iteration: int) -> dict[str, float] | None:
        """Every part's norms for ``iteration``; None when some part's did not appear within ``wait_s``."""
        deadline = time.monotonic() + self.wait_s
        out: dict[str, float] = {}
        pending = set(range(self.partition.of))
        while pending:
            for i in sorted(pending):
                try:
                    with open(self._path(iteration, i)) as f:
                        body = json.load(f)
                except FileNotFoundError:
                    continue
                out.update({n: struct.unpack("<f", bytes.fromhex(h))[0] for n, h in body.items()})
                pending.discard(i)
            if pending:
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.02)
        return out
