"""``flowcheck restore``: read a step (verified), reshard it, write a Megatron checkpoint directory atomically.

Order of work, so that bad input never leaves anything behind: resolve the
step and its model, check the target layout and every tensor's shape, then
write into ``<out>.tmp-<pid>`` (tracker file last) and rename it into place.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from flowcheck import dtypes
from flowcheck.branches import MAIN
from flowcheck.errors import FlowcheckError, StepExistsError
from flowcheck.restore import direct
from flowcheck.restore.arch import ModelArch
from flowcheck.restore.megatron_common import DTYPES, TRACKER, StepMeta, Target, megatron_args
from flowcheck.restore.megatron_dist import DistWriter
from flowcheck.restore.megatron_legacy import LegacyWriter
from flowcheck.restore.megatron_map import Param, VocabRows
from flowcheck.restore.megatron_optim import ResumePlan, resume_plan
from flowcheck.restore.outputs import failed_write, remove
from flowcheck.restore.source import OPT, StepReader, megatron_extra
from flowcheck.tiers.durable import fsync_dir, make_tree_durable

if TYPE_CHECKING:
    from flowcheck.store import Store

log = logging.getLogger(__name__)


@dataclass
class RestoreReport:
    out: str
    step: int
    run: str
    tier: str
    target: Target
    files: list[str] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    branch: str = MAIN
    resume: ResumePlan | None = None  # what the checkpoint resumes, where from, the Megatron flags it needs
    vocab: VocabRows | None = None  # the embedding rows: kept as stored, dropped, or new (and how initialised)


def restore(
    store: Store,
    step: int | str,
    target: Target,
    out: str,
    *,
    prefer: str = "auto",
    arch: ModelArch | None = None,
    force: bool = False,
    progress: bool = False,
    workers: int = 4,
    branch: str | None = None,
) -> RestoreReport:
    """Write step ``step`` of ``store`` into ``out`` as a Megatron checkpoint in ``target``'s layout
    (``step`` resolves on ``branch``, default the current branch; see flowcheck/branches.py)."""
    t0 = time.perf_counter()
    reader = StepReader.open(store, step, prefer, arch, branch)
    target.check(reader.arch)
    params = reader.params()
    moments = [s for s in reader.slots() if s not in ("step", "fp32_param")]
    target.check_optimizer(bool(moments))
    slots = moments if target.optim else []
    out = os.path.abspath(out)
    _check_replaceable(out, force)
    meta = _meta(reader, target, params, moments)
    vocab = VocabRows.of(reader.arch, target.tp)
    staging = f"{out}.tmp-{os.getpid()}"
    placed = False
    try:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        writer_cls = DistWriter if target.fmt == "megatron-dist" else LegacyWriter
        writer = writer_cls(reader.arch, target, staging, meta, slots + (["fp32_param"] if slots else []), workers)
        for param, slot, prepared in _tensors(reader, target, params, slots, workers, progress, writer.prepare,
                                              writer.destination):
            writer.add(param, slot, prepared)
        files = writer.finish()
        _write_record(staging, reader, target, meta.resume, vocab)
        with open(os.path.join(staging, TRACKER), "w", encoding="utf-8") as f:
            f.write(str(reader.step))  # written last: Megatron reads the tracker to find the iteration
        make_tree_durable(staging, "fsync")  # data files are already synced: this covers small files and dirs
        _replace_dir(staging, out)
        placed = True
        fsync_dir(os.path.dirname(out))
    except BaseException as e:
        error = _failed(e, reader, target, out, None if placed else remove(staging), placed)
        if error is None:
            raise
        raise error from e
    for warning in meta.resume.warnings:  # said once the checkpoint exists: they are about loading it
        log.warning("%s", warning)
    if not vocab.exact:  # a layout change, not a fault: the report, the CLI and the record say it too
        log.info("vocabulary: %s", vocab.note())
    files = [os.path.join(out, os.path.relpath(p, staging)) for p in files] + [os.path.join(out, TRACKER)]
    size = sum(os.path.getsize(p) for p in files if os.path.isfile(p))
    return RestoreReport(out, reader.step, reader.manifest.run, reader.tier.name, target, files, size,
                         time.perf_counter() - t0, reader.tier.branch, meta.resume, vocab)


def _failed(e: BaseException, reader: StepReader, target: Target, out: str, stuck: str | None,
            placed: bool) -> FlowcheckError | None:
    """A disk that refused the checkpoint, or memory that ran out, as one error (None: ``e`` says it already)."""
    if placed:
        left = f"the checkpoint is complete at {out} but its folder entry may not be durable"
    elif stuck:
        left = f"the staging folder {stuck}"
    else:
        left = f"nothing was left half-written (the staging folder was removed; {out} was not touched)"
    need = sum(math.prod(t.global_shape) * dtypes.dtype(t.dtype).itemsize for n, t in reader.manifest.tensors.items()
               if target.optim or not n.startswith(OPT))
    return failed_write(e, out, what="the restored checkpoint", need=need, left=left)


def _tensors(reader: StepReader, target: Target, params: list[Param], slots: list[str], workers: int, progress: bool,
             prepare: Callable[[Param, str | None, torch.Tensor], Any] | None = None,
             destination: direct.Destination | None = None):
    """(param, slot, tensor) for every tensor the writer needs: slot None is the weight, ``fp32_param`` the
    fp32 master (stored, or the weight itself), others optimizer moments; with ``prepare``, (param, slot,
    prepare(param, slot, tensor)), prepared on the reading threads (e.g. a writer's cut into rank pieces; from the
    object tier, on this thread, overlapping its one reader).

    Read on a thread pool with a bounded window; from the object tier in manifest order by one reader, so
    the tier's read-ahead fetches many shards per request; with a writer's ``destination`` (restore/direct.py),
    from the object tier straight into the writer's tensors.
    """
    want = DTYPES.get(target.dtype) if target.dtype else None
    jobs = []  # (param, slot, stored name)
    for p in params:
        master = f"{OPT}fp32_param.{p.name}"
        jobs.append((p, None, master if want == torch.float32 and reader.has(master) else p.name))
        if slots and reader.has(master):
            jobs.append((p, "fp32_param", master))
        jobs.extend((p, s, f"{OPT}{s}.{p.name}") for s in slots)
    here = prepare  # prepared on the reading threads ...
    if reader.tier.name == "object":
        position = {n: i for i, n in enumerate(reader.manifest.tensors)}
        jobs.sort(key=lambda j: position[j[2]])
        workers, here = 1, None  # ... except behind the one object reader: there, on this thread, beside its reads

    def load(job, stored: torch.Tensor | None = None):
        param, slot, name = job
        stored = reader.tensor(name) if stored is None else stored
        if slot is not None:
            out = [(param, slot, stored.float())]
        else:
            out = [(param, None, stored if want is None else stored.to(want))]
            if slots and not reader.has(f"{OPT}fp32_param.{param.name}"):
                out.append((param, "fp32_param", stored.float()))  # no stored master: the weight is the master
        return out if here is None else [(p, s, here(p, s, t)) for p, s, t in out]

    def ready(items):
        return items if prepare is None or here is not None else [(p, s, prepare(p, s, t)) for p, s, t in items]

    bar = _bar(len(jobs), progress, f"restore step {reader.step}")
    if reader.tier.name == "object" and destination is not None and hasattr(reader.tier, "read_shards_into"):
        def into(param: Param, slot: str | None, shape: tuple[int, ...], dtype: torch.dtype):
            taken = (want or dtype) if slot is None else torch.float32  # what load() hands the writer
            return destination(param, slot, shape, dtype) if dtype == taken else None  # no conversion on the way

        for items in direct.read_into(reader, jobs, into, load):
            yield from ready(items)
            bar.update()
        bar.close()
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        window: deque = deque()
        for job in jobs:
            window.append(pool.submit(load, job))
            if len(window) >= 2 * workers:
                yield from ready(window.popleft().result())
                bar.update()
        while window:
            yield from ready(window.popleft().result())
            bar.update()
    bar.close()


def _bar(total: int, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, leave=False)


def _meta(reader: StepReader, target: Target, params: list[Param], moments: list[str]) -> StepMeta:
    m = reader.manifest
    stored = m.tensors[params[0].name].dtype
    dtype = DTYPES[target.dtype] if target.dtype else (torch.bfloat16 if stored == "bfloat16" else torch.float32)
    why_not = "--no-optim asked for weights only" if moments else "the step carries no optimizer state"
    resume = resume_plan(m, target.fmt, target.optim and bool(moments), why_not, target.adam)
    imported = megatron_extra(m)
    args = megatron_args(reader.arch, target, reader.step, imported.get("args"), dtype, resume)
    return StepMeta(reader.step, args, resume, float(imported.get("num_floating_point_operations_so_far", 0.0)))


def _write_record(root: str, reader: StepReader, target: Target, resume: ResumePlan, vocab: VocabRows) -> None:
    """Say which stored step this directory is, so a resumed run's lineage links back to it, and what it resumes
    (where its optimizer groups, schedule and counters came from; the Megatron flags it needs; the vocabulary rows)."""
    import json

    from flowcheck.restore.importer import RESTORE_RECORD

    m = reader.manifest
    record = {"run": m.run, "step": m.step, "manifest_digest": m.digest(), "tier": reader.tier.name,
              "target": {"tp": target.tp, "pp": target.pp, "vpp": target.vpp, "format": target.fmt},
              "resume": {"optimizer": resume.optimizer, "sources": resume.sources,
                         "megatron_flags": list(resume.flags)},
              "vocabulary": vocab.to_json()}
    with open(os.path.join(root, RESTORE_RECORD), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)


def _check_replaceable(out: str, force: bool) -> None:
    """``--out`` must not exist, or (with ``--force``) be a directory holding a Megatron checkpoint or a previous
    restore (or nothing): ``--force --out ~/`` must never delete a home directory."""
    if not os.path.lexists(out):
        return
    if not force:
        raise StepExistsError(f"{out} already exists; pass --force to replace it")
    if os.path.islink(out) or not os.path.isdir(out):
        raise StepExistsError(f"--force --out {out}: expected a directory holding a Megatron checkpoint, found "
                              f"{'a symlink' if os.path.islink(out) else 'a file'}; nothing was replaced")
    entries = os.listdir(out)
    from flowcheck.restore.importer import RESTORE_RECORD

    megatron = TRACKER in entries or RESTORE_RECORD in entries or any(e.startswith("iter_") for e in entries)
    if entries and not megatron:
        shown = ", ".join(sorted(entries)[:3]) + (", ..." if len(entries) > 3 else "")
        raise StepExistsError(
            f"--force --out {out}: expected a directory holding a Megatron checkpoint ({TRACKER}, iter_*/) or a "
            f"previous restore ({RESTORE_RECORD}), found {len(entries)} other entries ({shown}); nothing was "
            "replaced: give a new or empty --out")


def _replace_dir(staging: str, out: str) -> None:
    """Rename the finished directory into place; an existing one (``--force``) goes only after that."""
    if not os.path.exists(out):
        os.rename(staging, out)
        return
    old = f"{out}.old-{os.getpid()}"
    os.rename(out, old)
    try:
        os.rename(staging, out)
    except OSError as e:
        os.rename(old, out)
        raise FlowcheckError(f"cannot move the restored checkpoint into {out}: {e}") from e
    shutil.rmtree(old, ignore_errors=True)
