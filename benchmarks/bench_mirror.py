"""Mirror capture throughput: decode (parse, reassemble, assemble) vs memcpy; the replica's AdamW vs torch's; e2e.

(a) decode: the frames of ring allreduces of fp32 vectors (N=8 ring, LL, 1024-byte MTU, the outbound streams of ring
    positions 0-2, --channels) are built in memory once with the simulator's wire (flowcheck.simulate.traffic, not
    timed); then `flowcheck.capture.mirror.decode.decode()` is consumed fully on one core (torch.set_num_threads(1); the native
    parser and reassembler are single-threaded, process CPU time / wall time is printed to show it) next to
    `np.copyto` of the same wire bytes. The split parse / reassemble / group+assemble comes from timing the two native
    calls inside that same decode; "group+assemble" is the rest (Msg objects, send grouping, matching, LL unpack, merge).
    A diagnostic row runs the native `roce.ll_unpack` over every data message of the same capture; three more give
    the floor under any decoder that checks every ICRC: one CRC32 call over all the wire bytes, and the native parse
    of every frame with and without its ICRC check.
(b) updater: one iteration of --update-mparams GPT-like fp32 parameters, gradients in DDP-like buckets of
    --bucket-mb: `Replica.apply_bucket` per bucket + `finish_iteration` (one AdamW over all parameters, stepped per
    bucket, for each job optimizer.impl: single = foreach=False, foreach, fused) vs one `torch.optim.AdamW` over the
    same tensors with fused=True (baseline), foreach=False and foreach=True; the torch alternatives copy each bucket
    into preallocated .grad tensors (a trainer's DDP does), the replica's gradients are views of the allreduced
    vector (fp32, averaged, no clipping: nothing to convert), so it does not copy. Optimizer state is initialised (steady state). At each of
    --update-threads torch thread counts.
(c) end to end: a GPT-2-like model of --e2e-layers x --e2e-hidden (tied embedding; 20 x 1024 = 303M parameters),
    DDP-like buckets of --bucket-mb (reverse parameter order, a bucket closes once it holds >= the cap). Per bucket: its
    traffic (N=8, 3 mirrored ranks, LL, fp32) is built in memory (not timed; cached by element count, since buckets of one
    size produce the same traffic structure), decoded with a one-bucket job and applied to the bucket's slice of one
    Replica of the whole model (AdamW, --e2e-impl). Only decode + update are timed; they are summed per iteration and extrapolated
    linearly in the parameter count to GPT-3 1.3B. torch uses --e2e-threads threads. On 2 cores, `run_pipeline` runs
    decode on one thread and the updater on another, so "2 cores" is reported as max(decode, update) (ideal overlap)
    next to the measured serial sum (1 core).

Rounds are interleaved (every alternative once per round), medians reported. Ratios are printed, never asserted.

  python benchmarks/bench_mirror.py --out /tmp/mirror.json
  python benchmarks/bench_mirror.py --grad-mb 4 --update-mparams 5 --e2e-layers 2 --e2e-hidden 256 --repeats 1  # smoke
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

SCRIPT = "bench_mirror.py"
NRANKS = 8
MTU = 1024
MIRRORED = 3  # outbound streams of ring positions 0..2
MIB = 1 << 20
GPT3_XL = 1.3e9  # GPT-3 1.3B parameters
PAPER_S = 6.0  # FlowCheck (EuroSys'25): ~6 s per iteration for GPT-3 1.3B on a 64-core checkpoint node
OPTIM = {"kind": "adamw", "lr": 1e-4, "weight_decay": 0.01}
IMPLS = ("single", "foreach", "fused")  # the job's optimizer.impl values
IMPL_KW = {"single": "foreach=False", "foreach": "foreach=True", "fused": "fused=True"}


# ---- traffic -------------------------------------------------------------------------
@dataclass
class Traffic:
    """Mirrored frames of some allreduces (in one buffer), the job to decode them, and the reduced vectors."""

    frames: Any  # flowcheck.capture.mirror.pcap.Frames
    job: Any  # flowcheck.capture.mirror.job.Job
    finals: list[np.ndarray]
    channels: int

    @property
    def wire_bytes(self) -> int:
        return int(self.frames.lengths.sum())

    @property
    def grad_bytes(self) -> int:
        return sum(f.nbytes for f in self.finals)


def ring_job(elements: list[int], channels: int, name: str = "bench"):
    """A decode-only job: the ring's NICs, LL fp32, and the allreduces' element counts (no parameters)."""
    from flowcheck.capture.mirror.job import Bucket, Job, Member
    from flowcheck.simulate.traffic import rank_endpoint

    eps = [rank_endpoint(r) for r in range(NRANKS)]
    return Job(name, tuple(Member(r, (e.mac,), (e.ip,)) for r, e in enumerate(eps)), dtype="float32", protocol="ll",
               channels=channels, buckets=tuple(Bucket(n) for n in elements))


def build_traffic(elements: list[int], channels: int, seed: int = 0) -> Traffic:
    """The frames the mirror ports of ring positions 0..MIRRORED-1 (outbound) copy for these allreduces."""
    from flowcheck.capture.mirror.pcap import Frames
    from flowcheck.capture.mirror.ring import RingParams
    from flowcheck.simulate.allreduce import ring_allreduce
    from flowcheck.simulate.traffic import Wire, rank_endpoint

    rp = RingParams(NRANKS, channels, "ll", 4, step_bytes=65536, chunk_steps=1)
    wire = Wire([rank_endpoint(r) for r in range(NRANKS)], rp, mtu=MTU, seed=seed,
                wanted=lambda src, dst: src < MIRRORED)
    rng = np.random.default_rng(seed)
    finals = []
    for count in elements:
        # gradient-like magnitudes (~1e-3), different per rank; the values do not change the decoder's work
        base = rng.standard_normal(count, dtype=np.float32) * np.float32(1e-3 / NRANKS)
        red = ring_allreduce([base * np.float32(1 + r / 8) for r in range(NRANKS)], rp)
        wire.allreduce(red)
        finals.append(red.final.copy())
        del red, base
    drained = wire.drain()
    frames = Frames.from_list([f.data for f in drained], [f.t_ns for f in drained], source="memory")
    del drained
    return Traffic(frames, ring_job(elements, channels), finals, channels)


@contextlib.contextmanager
def native_stage_times() -> Iterator[dict[str, float]]:
    """Seconds spent in ``roce.parse``, ``roce.reassemble`` and the merges of final sends (``roce.merge_row_columns``;
    ``merge_rows``, ``merge_sends`` or ``merge_send`` in trees before it) while the block runs: wall (summed over concurrent merges) and CPU
    (``cpu_<name>``: every thread's work).  ``roce.parse_reassemble`` (one call for both, what decode makes since
    issue 22's fused demux) counts as parse: its reassembly is then inside "parse" and "reassemble" is 0."""
    from flowcheck.capture.mirror import roce

    acc = {"parse": 0.0, "reassemble": 0.0, "merge": 0.0, "cpu_parse": 0.0, "cpu_reassemble": 0.0, "cpu_merge": 0.0}
    stage = {"parse": "parse", "parse_reassemble": "parse", "reassemble": "reassemble", "merge_send": "merge", "merge_sends": "merge",
             "merge_rows": "merge", "merge_row_columns": "merge"}
    originals = {name: getattr(roce, name) for name in stage if hasattr(roce, name)}
    lock = threading.Lock()

    def timed(name: str, fn: Callable) -> Callable:
        # parse and reassemble start their own native threads: process CPU; merges run on the calling (pool) thread,
        # several at once: that thread's CPU
        clock = time.thread_time if stage[name] == "merge" else time.process_time

        def inner(*a, **k):
            t0, c0 = time.perf_counter(), clock()
            try:
                return fn(*a, **k)
            finally:
                with lock:
                    acc[stage[name]] += time.perf_counter() - t0
                    acc["cpu_" + stage[name]] += clock() - c0
        return inner

    for name, fn in originals.items():
        setattr(roce, name, timed(name, fn))
    try:
        yield acc
    finally:
        for name, fn in originals.items():
            setattr(roce, name, fn)


def decode_all(traffic: Traffic, workers: int = 1) -> list:
    from flowcheck.capture.mirror.decode import Decoded, decode

    return list(decode(traffic.job, traffic.frames, Decoded(), workers=workers))


def verify(traffic: Traffic, allreduces: list) -> str:
    """'' when every allreduce came out complete and bit-equal to the simulator's final vector, else why not."""
    if len(allreduces) != len(traffic.finals):
        return f"{len(allreduces)} of {len(traffic.finals)} allreduces decoded"
    for a, want in zip(allreduces, traffic.finals):
        if not a.complete:
            return f"allreduce {a.index} incomplete ({len(a.missing())} missing runs, {len(a.conflicts)} conflicts)"
        if a.data.tobytes() != want.tobytes():
            return f"allreduce {a.index} differs from the reduced vector"
    return ""


# ---- (a) decode throughput ---------------------------------------------------------------
@dataclass
class DecodeRow:
    method: str
    wire_bytes: int
    grad_bytes: int
    times: list[float] = field(default_factory=list)
    split: dict[str, list[float]] = field(default_factory=dict)
    cpu_ratio: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)  # process CPU seconds per round (every thread's)
    note: str = ""
    baseline: bool = False
    # (wall s, CPU s) of the round just run, when the row's function times its own work (decode: not its check)
    measured: tuple[float, float] | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def med(self, key: str) -> float:
        return statistics.median(self.split[key]) if self.split.get(key) else float("nan")


def part_decode(args, log) -> dict[str, Any]:
    import torch

    from flowcheck import _mirror
    from flowcheck.capture.mirror import roce

    torch.set_num_threads(1)
    total = int(args.grad_mb * MIB) // 4
    nb = max(1, math.ceil(args.grad_mb / args.bucket_mb))
    elements = [total // nb + (1 if i < total % nb else 0) for i in range(nb)]
    traffics = []
    for ch in args.channels:
        t0 = time.perf_counter()
        tr = build_traffic(elements, ch, seed=ch)
        log(f"(a) built {len(tr.frames)} frames, {tr.wire_bytes / 1e6:.0f} MB wire for {nb} allreduces of "
            f"{elements[0]} fp32 ({tr.grad_bytes / 1e6:.0f} MB gradient), {ch} channel(s), in {time.perf_counter() - t0:.1f} s")
        traffics.append(tr)
    largest = max(tr.wire_bytes for tr in traffics)
    src = np.frombuffer(traffics[0].frames.buf, np.uint8)
    dst = np.empty_like(src)
    dst.fill(1)  # fault the pages in: memcpy measures copying, not page faults
    memcpy = DecodeRow("np.copyto of the wire bytes (memcpy)", src.nbytes, 0, baseline=True,
                       note=f"{src.nbytes / 1e6:.0f} MB, destination pre-faulted")
    rows: list[tuple[DecodeRow, Callable[[], Any]]] = [(memcpy, lambda: np.copyto(dst, src))]
    verified: dict[str, str] = {}

    def decoder(tr: Traffic, row: DecodeRow, workers: int = 1) -> Callable[[], Any]:
        def run():
            with native_stage_times() as acc:
                t0, c0 = time.perf_counter(), time.process_time()
                out = decode_all(tr, workers)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            row.split.setdefault("parse", []).append(acc["parse"])
            row.split.setdefault("reassemble", []).append(acc["reassemble"])
            row.split.setdefault("assemble", []).append(wall - acc["parse"] - acc["reassemble"])
            row.split.setdefault("merge", []).append(acc["merge"])
            row.split.setdefault("cpu", []).append(cpu)
            row.split.setdefault("native_cpu", []).append(min(cpu, acc["cpu_parse"] + acc["cpu_reassemble"] + acc["cpu_merge"]))
            row.cpu_ratio.append(cpu / wall)
            row.measured = (wall, cpu)  # the decode alone: the bit-for-bit check below is not decode's work
            status = verify(tr, out)  # every round; the first failure is kept
            if status or row.method not in verified:
                verified[row.method] = status
            return out
        return run

    for tr in traffics:
        row = DecodeRow(f"flowcheck decode, {tr.channels} channel(s)", tr.wire_bytes, tr.grad_bytes,
                        note=f"{len(tr.frames)} frames, {len(tr.finals)} allreduces")
        rows.append((row, decoder(tr, row)))
    copy_rows: dict[int, DecodeRow] = {}
    for k in args.decode_workers:  # what this machine's memory gives k threads streaming the same bytes: the ceiling
        if k > 1:                  # for the scaling of a decode that reads the wire (goal (b) asks 1.8x at k = 2)
            copy_rows[k] = DecodeRow(f"reference: np.copyto of the wire bytes on {k} threads (a 1/{k} slice each)",
                                     src.nbytes, 0, note="the memory-bandwidth ceiling for decode scaling at this k")
            rows.append((copy_rows[k], partial(threaded_copy, src, dst, k)))
    for k in args.decode_workers:  # (b) scaling: the same input, the first pass on k threads
        if k > 1:
            tr = traffics[0]
            row = DecodeRow(f"flowcheck decode, {tr.channels} channel(s), {k} parse workers", tr.wire_bytes,  # name kept: K threads parse, reassemble and merge now
                            tr.grad_bytes, note=f"{len(tr.frames)} frames, {len(tr.finals)} allreduces")
            rows.append((row, decoder(tr, row, k)))
    # diagnostic: the native LL unpack over every data message (what the per-packet Python unpack costs natively)
    tr0 = traffics[0]
    packets = roce.parse(tr0.frames)
    reas = roce.reassemble(tr0.frames, packets)
    data_msgs = [m for m in np.flatnonzero(reas.messages["kind"] == roce.KIND_WRITE)
                 if int(reas.messages["dma_len"][m]) > 32]  # not the 32-byte flow-control posts
    segs = [reas.segments_of(int(m)) for m in data_msgs]
    outs = [np.empty(int(reas.messages["dma_len"][m]) // 2, np.uint8) for m in data_msgs]
    unpack_bytes = sum(int(s["length"].sum()) for s in segs)
    diag = DecodeRow("diagnostic: native roce.ll_unpack of every data message", unpack_bytes, unpack_bytes // 2,
                     note=f"{len(data_msgs)} messages, {tr0.channels} channel(s); not part of decode today")

    def unpack_all():
        for s, o in zip(segs, outs):
            roce.ll_unpack(tr0.frames, s, o)
    rows.append((diag, unpack_all))
    del packets, reas
    # floors: what any decoder that checks every ICRC pays before it does anything else
    wire = np.frombuffer(tr0.frames.buf, np.uint8)
    offsets = np.ascontiguousarray(tr0.frames.offsets, dtype=np.int64)
    lengths = np.ascontiguousarray(tr0.frames.lengths, dtype=np.int32)
    table = np.empty(len(tr0.frames), dtype=roce.PACKET)
    table.fill(0)  # fault the pages in: the rows below time the parse itself
    floors = [
        ("diagnostic: CRC32 of all the wire bytes in one call (the cheapest possible ICRC pass)", wire.nbytes,
         lambda: _mirror.crc32(wire), "one native call, no per-frame work"),
        ("diagnostic: native parse of every frame with the ICRC check (decode's first pass)", wire.nbytes,
         lambda: _mirror.parse(wire, offsets, lengths, table, True), "packet table pre-faulted"),
        ("diagnostic: native parse of every frame without the ICRC check", wire.nbytes,
         lambda: _mirror.parse(wire, offsets, lengths, table, False), "packet table pre-faulted"),
    ]
    for method, nbytes, fn, note in floors:
        rows.append((DecodeRow(method, nbytes, 0, note=f"{len(tr0.frames)} frames; {note}"), fn))

    for r in range(args.repeats):
        for row, fn in rows:
            gc.collect()
            c0 = time.process_time()
            dt, _ = c.timed(fn)
            cpu = time.process_time() - c0
            if row.measured is not None:
                (dt, cpu), row.measured = row.measured, None
            row.times.append(dt)
            row.cpu_s.append(cpu)
            log(f"  (a) round {r + 1}/{args.repeats} {row.method}: {dt:.3f} s ({row.wire_bytes / 1e9 / dt:.3f} GB/s wire)")
    base_gbps = memcpy.wire_bytes / memcpy.median
    md = [("| method | median s | min s | max s | wire GB/s | gradient GB/s | ratio vs memcpy (wire GB/s) | parse s | "
           "reassemble s | group+assemble s | CPU s / wall s | CPU s | ratio vs memcpy (CPU s) | merge s | "
           "native share of CPU | notes |"), "|---|" + "---:|" * 14 + "---|"]
    base_cpu = statistics.median(memcpy.cpu_s)
    out_rows = []
    for row, _ in rows:
        gbps = row.wire_bytes / row.median / 1e9
        ratio = gbps * 1e9 / base_gbps
        status = verified.get(row.method)
        note = ("**baseline**; " if row.baseline else "") + row.note + (
            "" if status is None else ("; every allreduce complete and bit-exact" if not status else f"; NOT VERIFIED: {status}"))
        grad = f"{row.grad_bytes / row.median / 1e9:.3f}" if row.grad_bytes else "–"
        split = [f"{row.med(k):.3f}" if row.split else "–" for k in ("parse", "reassemble", "assemble")]
        cpu = f"{statistics.median(row.cpu_ratio):.2f}" if row.cpu_ratio else "–"
        cpu_s = statistics.median(row.cpu_s)
        native = (f"{row.med('native_cpu') / row.med('cpu'):.2f}" if row.split.get("native_cpu") and row.med("cpu") > 0
                  else "–")
        merge = f"{row.med('merge'):.3f}" if row.split.get("merge") else "–"
        md.append(f"| {row.method} | {row.median:.3f} | {min(row.times):.3f} | {max(row.times):.3f} | {gbps:.3f} | {grad} | "
                  f"{ratio:.3f}x | {' | '.join(split)} | {cpu} | {cpu_s:.3f} | {base_cpu / cpu_s if cpu_s > 0 else float('nan'):.3f}x | "
                  f"{merge} | {native} | {note} |")
        out_rows.append({"method": row.method, "times_s": row.times, "median_s": row.median, "wire_bytes": row.wire_bytes,
                         "grad_bytes": row.grad_bytes, "wire_gbps": gbps, "ratio_vs_memcpy": ratio,
                         "split_s": {k: row.med(k) for k in row.split}, "cpu_over_wall": row.cpu_ratio,
                         "cpu_s": row.cpu_s, "median_cpu_s": cpu_s, "ratio_vs_memcpy_cpu": base_cpu / cpu_s if cpu_s > 0 else None,
                         "verified": status, "baseline": row.baseline})
    one = next((r for r, _ in rows if r.method == f"flowcheck decode, {traffics[0].channels} channel(s)"), None)
    scaling = {}
    for k, copy_row in copy_rows.items():
        many = next((r for r, _ in rows if r.method.endswith(f", {k} parse workers")), None)
        if one is not None and many is not None:
            scaling[k] = {"decode": one.median / many.median, "memcpy": memcpy.median / copy_row.median,
                          "compute": compute_scaling(k)}
            md.append(f"\nScaling at {k} workers (wall, medians): decode {scaling[k]['decode']:.2f}x one worker; memcpy "
                      f"of the same bytes on {k} threads {scaling[k]['memcpy']:.2f}x one thread (the ceiling here); "
                      f"in-cache compute (SHA-256 of a 256 KiB buffer) on {k} threads {scaling[k]['compute']:.2f}x (the "
                      "cores alone, memory out of the way).")
    return {"rows": out_rows, "markdown": "\n".join(md), "elements": elements, "largest_wire_bytes": largest,
            "scaling": scaling}


def compute_scaling(k: int, calls: int = 1000, repeats: int = 5) -> float:
    """How much more work k threads do than one when the work stays in cache: ``calls`` SHA-256s of a 256 KiB buffer
    per thread (hashlib releases the GIL for each), best of ``repeats``.  Next to memcpy's scaling it tells the cores
    from the memory: what only computes scales with cores, what streams memory scales with the memory system."""
    buf = os.urandom(256 * 1024)  # well inside one core's L2

    def work() -> None:
        for _ in range(calls):
            hashlib.sha256(buf).digest()

    def run(n: int) -> float:
        threads = [threading.Thread(target=work) for _ in range(n)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    one, many = min(run(1) for _ in range(repeats)), min(run(k) for _ in range(repeats))
    return k * one / many


def threaded_copy(src: np.ndarray, dst: np.ndarray, k: int) -> None:
    """np.copyto of src into dst on k threads, each a contiguous 1/k slice (numpy releases the GIL for the copy)."""
    bounds = [len(src) * i // k for i in range(k + 1)]
    threads = [threading.Thread(target=np.copyto, args=(dst[a:b], src[a:b])) for a, b in zip(bounds, bounds[1:])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ---- (b) updater throughput ---------------------------------------------------------------
def replica_job(params: list[tuple[str, tuple[int, ...]]], bucket_mb: float, clip: float | None, name: str,
                impl: str = "single"):
    """A job that trains: the parameters, DDP-like buckets (reverse order, close at >= cap), AdamW (torch ``impl``)."""
    from flowcheck.capture.mirror.job import Bucket, Job, OptimizerSpec, Param
    from flowcheck.simulate.trainer import bucket_plan

    numel = {n: math.prod(s) for n, s in params}
    plan = bucket_plan([(n, numel[n]) for n, _ in params], int(bucket_mb * MIB))
    base = ring_job([1], 1)
    return Job(name, base.ring, dtype="float32", protocol="ll", channels=1,
               parameters=tuple(Param(n, s) for n, s in params),
               buckets=tuple(Bucket(sum(numel[n] for n in names), names) for names in plan),
               optimizer=OptimizerSpec(**OPTIM, impl=impl), clip_grad_norm=clip)


def initial_state(params: list[tuple[str, tuple[int, ...]]], seed: int) -> dict:
    """Parameters ~N(0, 0.02) and steady-state AdamW moments (step 10), canonical names."""
    import torch

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in params:
        state[name] = torch.empty(shape).normal_(0, 0.02, generator=g)
        state[f"optimizer.exp_avg.{name}"] = torch.empty(shape).normal_(0, 1e-4, generator=g)
        state[f"optimizer.exp_avg_sq.{name}"] = torch.empty(shape).uniform_(1e-9, 1e-7, generator=g)
        state[f"optimizer.step.{name}"] = torch.tensor(10.0)
    return state


def torch_adamw(state: dict, names: list[str], variant: str):
    """One torch.optim.AdamW over copies of the state, .grad preallocated; ``variant`` fused | foreach | single."""
    import torch

    params = [state[n].clone() for n in names]
    for p in params:
        p.grad = torch.zeros_like(p)
    kw = {"fused": True} if variant == "fused" else {"foreach": variant == "foreach"}  # see IMPL_KW
    opt = torch.optim.AdamW(params, lr=OPTIM["lr"], weight_decay=OPTIM["weight_decay"], **kw)
    for p, n in zip(params, names):
        opt.state[p] = {"step": state[f"optimizer.step.{n}"].clone(), "exp_avg": state[f"optimizer.exp_avg.{n}"].clone(),
                        "exp_avg_sq": state[f"optimizer.exp_avg_sq.{n}"].clone()}
    return opt, dict(zip(names, params))


def part_update(args, log) -> dict[str, Any]:
    import torch

    shapes = c.gpt_param_shapes(args.update_mparams * 1e6 * c.BYTES_PER_PARAM / 1e9)
    params = [(n, s) for n, s, _ in shapes]
    job = replica_job(params, args.bucket_mb, args.clip, "bench-update")
    n_params = sum(p.numel for p in job.parameters)
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(b.elements, dtype=np.float32) * np.float32(1e-3) for b in job.buckets]
    log(f"(b) {n_params / 1e6:.1f}M parameters in {len(job.parameters)} tensors, {len(job.buckets)} buckets "
        f"(<= {args.bucket_mb} MiB cap, largest {max(b.elements for b in job.buckets) * 4 / MIB:.0f} MiB)")
    out: dict[str, Any] = {"params": n_params, "buckets": len(job.buckets), "tables": {}}
    for threads in args.update_threads:
        torch.set_num_threads(threads)
        out["tables"][threads] = update_rounds(args, job, params, grads, threads, log)
        gc.collect()
    return out


def update_rounds(args, job, params: list[tuple[str, tuple[int, ...]]], grads: list[np.ndarray], threads: int,
                  log) -> dict[str, Any]:
    """(b) at one torch thread count: the replica (each torch implementation) and torch's AdamW, from the same state."""
    import dataclasses

    import torch

    from flowcheck.capture.mirror.replica import Replica

    state = initial_state(params, seed=2)
    replicas = {impl: Replica(dataclasses.replace(job, optimizer=dataclasses.replace(job.optimizer, impl=impl)), state, 10)
                for impl in IMPLS}
    names = [n for n, _ in params]
    torchs = {v: torch_adamw(state, names, v) for v in IMPLS}
    del state

    def flowcheck_iter(impl: str) -> Callable[[], None]:
        replica = replicas[impl]

        def run():
            for b, g in zip(job.buckets, grads):
                replica.apply_bucket(b, g)
            replica.finish_iteration()
        return run

    def torch_iter(variant: str) -> Callable[[], None]:
        opt, by_name = torchs[variant]
        ordered = list(by_name.values())

        def run():
            for b, g in zip(job.buckets, grads):
                flat = torch.from_numpy(g)
                off = 0
                for n in b.params:
                    p = by_name[n]
                    p.grad.view(-1).copy_(flat[off:off + p.numel()])
                    off += p.numel()
            if args.clip is not None:
                torch.nn.utils.clip_grad_norm_(ordered, args.clip)
            opt.step()
        return run

    nbytes = sum(p.numel for p in job.parameters) * 4
    rows = [c.Row(f"torch AdamW fused=True ({threads} thr)", nbytes=nbytes, baseline=True, note="one optimizer")]
    fns = [torch_iter("fused")]
    for impl in IMPLS:
        rows.append(c.Row(f"flowcheck Replica, impl={impl} ({threads} thr)", nbytes=nbytes,
                          note=f"apply_bucket + finish_iteration; one AdamW({IMPL_KW[impl]}) over all parameters, stepped per bucket; gradients are views of the allreduced vector (no copy)"))
        fns.append(flowcheck_iter(impl))
    for impl in ("single", "foreach"):
        rows.append(c.Row(f"torch AdamW {IMPL_KW[impl]} ({threads} thr)", nbytes=nbytes, note="one optimizer"))
        fns.append(torch_iter(impl))
    for fn in fns:  # one untimed warm-up each: first-touch of lazily built kernels and the replica's .grad clones
        fn()
    c.run_rounds([(r, f, None, None) for r, f in zip(rows, fns)], args.repeats, cold=False,
                 log=lambda s: log("  (b)" + s))
    md = c.table(rows, ratio_label="ratio vs fused (higher = faster)").replace("| GB/s |", "| gradient GB/s |")
    return {"rows": c.rows_json(rows), "markdown": md}


# ---- (c) end to end -------------------------------------------------------------------------
def gpt2_params(layers: int, hidden: int, vocab: int = 50304, ctx: int = 1024) -> list[tuple[str, tuple[int, ...]]]:
    """GPT-2-style parameters in model.parameters() order (tied input/output embedding)."""
    out = [("wte.weight", (vocab, hidden)), ("wpe.weight", (ctx, hidden))]
    for i in range(layers):
        p = f"h.{i}."
        out += [(p + "ln_1.weight", (hidden,)), (p + "ln_1.bias", (hidden,)),
                (p + "attn.c_attn.weight", (3 * hidden, hidden)), (p + "attn.c_attn.bias", (3 * hidden,)),
                (p + "attn.c_proj.weight", (hidden, hidden)), (p + "attn.c_proj.bias", (hidden,)),
                (p + "ln_2.weight", (hidden,)), (p + "ln_2.bias", (hidden,)),
                (p + "mlp.c_fc.weight", (4 * hidden, hidden)), (p + "mlp.c_fc.bias", (4 * hidden,)),
                (p + "mlp.c_proj.weight", (hidden, 4 * hidden)), (p + "mlp.c_proj.bias", (hidden,))]
    return out + [("ln_f.weight", (hidden,)), ("ln_f.bias", (hidden,))]


def part_e2e(args, log) -> dict[str, Any]:
    import torch

    from flowcheck.capture.mirror.replica import Replica

    torch.set_num_threads(args.e2e_threads)
    params = gpt2_params(args.e2e_layers, args.e2e_hidden)
    job = replica_job(params, args.bucket_mb, args.clip, "bench-e2e", impl=args.e2e_impl)
    n_params = sum(p.numel for p in job.parameters)
    sizes = sorted({b.elements for b in job.buckets})
    log(f"(c) {n_params / 1e6:.1f}M parameters, {len(job.buckets)} buckets, {len(sizes)} distinct sizes "
        f"({sizes[0] * 4 / MIB:.1f}..{sizes[-1] * 4 / MIB:.1f} MiB)")
    replica = Replica(job, initial_state(params, seed=3), 10)
    gc.collect()
    cache: dict[int, Traffic] = {}
    gen_s = 0.0
    iters = []
    for it in range(args.e2e_iters):
        per = {"decode_s": 0.0, "update_s": 0.0, "wire_bytes": 0, "buckets": [], "decode_cpu_s": 0.0, "update_cpu_s": 0.0}
        for b, bucket in enumerate(job.buckets):
            tr = cache.get(bucket.elements)
            if tr is None:
                t0 = time.perf_counter()
                tr = cache[bucket.elements] = build_traffic([bucket.elements], args.e2e_channels, seed=bucket.elements)
                gen_s += time.perf_counter() - t0
            gc.collect()
            t0, c0 = time.perf_counter(), time.process_time()
            ars = decode_all(tr)
            t1, c1 = time.perf_counter(), time.process_time()
            if it == 0 and (why := verify(tr, ars)):
                raise RuntimeError(f"(c) bucket {b}: {why}")
            t2, c2 = time.perf_counter(), time.process_time()
            replica.apply_bucket(bucket, ars[0].data)
            t3, c3 = time.perf_counter(), time.process_time()
            per["decode_cpu_s"] += c1 - c0  # core-seconds: on a shared box the wall waits for a core too
            per["update_cpu_s"] += c3 - c2
            per["decode_s"] += t1 - t0
            per["update_s"] += t3 - t2
            per["wire_bytes"] += tr.wire_bytes
            per["buckets"].append({"elements": bucket.elements, "decode_s": t1 - t0, "update_s": t3 - t2,
                                   "wire_bytes": tr.wire_bytes})
            del ars
        t0, c0 = time.perf_counter(), time.process_time()
        replica.finish_iteration()
        per["update_s"] += time.perf_counter() - t0
        per["update_cpu_s"] += time.process_time() - c0
        per["total_s"] = per["decode_s"] + per["update_s"]
        iters.append(per)
        log(f"  (c) iteration {it + 1}/{args.e2e_iters}: decode {per['decode_s']:.1f} s + update {per['update_s']:.1f} s "
            f"= {per['total_s']:.1f} s ({per['wire_bytes'] / 1e9:.2f} GB wire; traffic generation so far {gen_s:.0f} s, not timed)")
    del cache
    gc.collect()
    med = {k: statistics.median(i[k] for i in iters) for k in ("decode_s", "update_s", "total_s", "decode_cpu_s", "update_cpu_s")}
    # noise-robust alternative: buckets of one size repeat (layers are alike), so sum count x per-size median
    by_size: dict[int, list[dict]] = {}
    for i in iters:
        for bk in i["buckets"]:
            by_size.setdefault(bk["elements"], []).append(bk)
    robust = {k: sum(statistics.median(x[k] for x in v) * len(v) / len(iters) for v in by_size.values())
              for k in ("decode_s", "update_s")}
    scale = GPT3_XL / n_params
    wire = iters[0]["wire_bytes"]
    md = ["| quantity | decode s | update s | decode + update s | notes |", "|---|---:|---:|---:|---|",
          (f"| measured: {n_params / 1e6:.0f}M params, one iteration (median of {len(iters)}) | {med['decode_s']:.1f} | "
           f"{med['update_s']:.1f} | {med['total_s']:.1f} | {len(job.buckets)} buckets, {wire / 1e9:.2f} GB wire "
           f"({wire / 1e9 / med['decode_s']:.3f} GB/s decode); AdamW impl={args.e2e_impl}, torch {args.e2e_threads} thread(s) |"),
          (f"| same, Σ over bucket sizes of count × per-size median | {robust['decode_s']:.1f} | "
           f"{robust['update_s']:.1f} | {robust['decode_s'] + robust['update_s']:.1f} | "
           f"{len(by_size)} sizes; damps noise from the shared box; finish_iteration not included |"),
          (f"| measured: process CPU seconds (core-seconds), one iteration | {med['decode_cpu_s']:.1f} | "
           f"{med['update_cpu_s']:.1f} | {med['decode_cpu_s'] + med['update_cpu_s']:.1f} | every thread's CPU; "
           f"{wire / 1e9 / med['decode_cpu_s']:.3f} GB of wire per decode core-second |"),
          (f"| extrapolated x{scale:.2f} to GPT-3 1.3B, core-seconds | {med['decode_cpu_s'] * scale:.1f} | "
           f"{med['update_cpu_s'] * scale:.1f} | **{(med['decode_cpu_s'] + med['update_cpu_s']) * scale:.1f}** | "
           "(d): linear in parameters, from CPU time |"),
          (f"| extrapolated x{scale:.2f} to GPT-3 1.3B, serial (1 core) | {med['decode_s'] * scale:.1f} | "
           f"{med['update_s'] * scale:.1f} | **{med['total_s'] * scale:.1f}** | linear in parameters |"),
          (f"| extrapolated to GPT-3 1.3B, 2 cores (decode ‖ update) | | | "
           f"**{max(med['decode_s'], med['update_s']) * scale:.1f}** | max of the two stages: run_pipeline runs them on "
           "two threads; ideal overlap, not measured |"),
          f"| paper (FlowCheck, EuroSys'25), GPT-3 1.3B | | | {PAPER_S:.0f} | 64-core checkpoint node |"]
    return {"params": n_params, "buckets": len(job.buckets), "distinct_sizes": len(sizes), "iterations": iters,
            "median": med, "robust": robust, "scale_to_1_3b": scale, "extrapolated_s": med["total_s"] * scale,
            "generation_s": gen_s, "markdown": "\n".join(md)}


# ---- main ------------------------------------------------------------------------------------
def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="rounds of (a) and (b), interleaved; medians (default 3)")
    p.add_argument("--out", help="write the results as JSON to this file")
    p.add_argument("--only", default="a,b,c", help="parts to run, of a,b,c (default all)")
    p.add_argument("--grad-mb", type=float, default=32, help="(a) fp32 gradient MiB all-reduced (default 32: ~360 MB wire)")
    p.add_argument("--bucket-mb", type=float, default=25, help="bucket cap in MiB for (a), (b), (c) (default 25, DDP's)")
    p.add_argument("--channels", type=ints, default=[1, 2], help="(a) NCCL channels, comma-separated (default 1,2)")
    p.add_argument("--decode-workers", type=ints, default=[1, 2],
                   help="(a) also decode the first input with these parse-worker counts (default 1,2)")
    p.add_argument("--update-mparams", type=float, default=75, help="(b) millions of parameters (default 75)")
    p.add_argument("--update-threads", type=ints, default=[1, 2], help="(b) torch threads, comma-separated (default 1,2)")
    p.add_argument("--clip", type=float, default=None, help="global-norm clipping in (b) and (c) (default none)")
    p.add_argument("--e2e-layers", type=int, default=20, help="(c) transformer layers (default 20)")
    p.add_argument("--e2e-hidden", type=int, default=1024, help="(c) hidden size (default 1024: 20 x 1024 = 303M params)")
    p.add_argument("--e2e-iters", type=int, default=1, help="(c) iterations (default 1: ~5 min each on 2 cores)")
    p.add_argument("--e2e-impl", default="fused", choices=IMPLS,
                   help="(c) the job's optimizer.impl, the trainer's torch AdamW implementation (default fused)")
    p.add_argument("--e2e-channels", type=int, default=1, help="(c) NCCL channels (default 1)")
    p.add_argument("--e2e-threads", type=int, default=1,
                   help="(c) torch threads for the update (default 1: decode and update each hold one of 2 cores in "
                        "run_pipeline; and on a busy 2-core box a second OpenMP thread slows torch down, see (b))")
    args = p.parse_args(argv)
    cmd = c.command(SCRIPT, argv)
    parts = set(args.only.split(","))
    started = time.perf_counter()

    def log(s: str) -> None:
        print(s, flush=True)

    result: dict[str, Any] = {"benchmark": "mirror", "command": cmd, "machine": c.machine()}
    texts = [c.header("Mirror capture: decode vs memcpy, replica AdamW vs torch, end to end", None,
                      argparse.Namespace(dir=None), cmd,
                      f"- N={NRANKS} ring, LL, fp32, MTU {MTU}, outbound streams of ring positions 0..{MIRRORED - 1}; "
                      f"{args.repeats} rounds interleaved, medians")]
    if "a" in parts:
        result["decode"] = part_decode(args, log)
        texts += ["(a) decode throughput, one core (ratio = wire GB/s ÷ memcpy GB/s; goal ≥ 0.5x):",
                  result["decode"]["markdown"]]
    if "b" in parts:
        result["update"] = part_update(args, log)
        u = result["update"]
        texts.append(f"(b) updater, {u['params'] / 1e6:.1f}M parameters in {u['buckets']} buckets, one iteration "
                     f"(ratio = fused s ÷ method s; goal ≥ 1.0x; clip {args.clip}):")
        texts += [t["markdown"] for t in u["tables"].values()]
    if "c" in parts:
        result["e2e"] = part_e2e(args, log)
        e = result["e2e"]
        texts += [f"(c) end to end, seconds per iteration (traffic generation {e['generation_s']:.0f} s, not timed):",
                  e["markdown"]]
    result["wall_s"] = time.perf_counter() - started
    text = "\n\n".join(texts)
    print("\n" + text, flush=True)
    result["markdown"] = text
    c.save_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
