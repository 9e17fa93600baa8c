"""One simulator run: train, all-reduce on a wire, write the mirror pcaps, the job and the truth.

Files written under ``options.out``:
  job.yaml                       the job description a checkpoint node is given (``load_job`` reads it)
  mirror-r<RANK>-<DIR>.pcap      one per mirror port (nanosecond pcap, Ethernet); with ``tail``, each ends inside
                                 the step after the last allreduce (SimOptions.tail, tail_frames)
  injected.json                  per pcap: frames offered/written, dropped/duplicated indices, reordered pairs
  truth/step-<k>.safetensors     k = 0..iters: parameters + optimizer state under canonical names
  truth/allreduces.json          every allreduce in wire order: index, iteration, bucket, elements, sha256, channels
  truth/losses.json              per iteration: each rank's loss
  truth/traffic.json             endpoints, every connection's QPNs/ports/buffers, counts of non-allreduce traffic
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import yaml

from flowcheck.capture.mirror.job import Bucket, Job, Member, Param, job_to_dict
from flowcheck.capture.mirror.ring import RingParams
from flowcheck.simulate.allreduce import ring_allreduce
from flowcheck.simulate.mirror import MirrorPort
from flowcheck.simulate.options import SimOptions
from flowcheck.simulate.traffic import Wire, rank_endpoint
from flowcheck.simulate.trainer import Plan, Trainer

log = logging.getLogger(__name__)

P2P_EVERY = 5  # iterations between pipeline-style p2p sends (the first after iteration 2)
UD_EVERY = 3  # iterations between management datagrams
COMPUTE_NS = 2_000_000  # forward/backward time between iterations on the wire's clock


@dataclass(frozen=True)
class SimResult:
    out: str
    job: Job
    job_path: str
    pcaps: dict[str, str]  # "RANK:DIR" -> path
    allreduces: tuple[dict, ...]  # the records of truth/allreduces.json
    losses: tuple[tuple[float, ...], ...]  # [iteration-1][rank]
    injected: dict  # the content of injected.json
    seconds: float
    finals: tuple[np.ndarray, ...] = field(default=(), repr=False)  # reduced vectors (keep_finals=True)


def ring_params(options: SimOptions) -> RingParams:
    simple = options.proto == "simple"
    return RingParams(nranks=options.dp, nchannels=options.channels, protocol=options.proto, itemsize=4,
                      step_bytes=524288 if simple else 65536, chunk_steps=4 if simple else 1)


def build_job(options: SimOptions, trainer: Trainer, rp: RingParams) -> Job:
    eps = [rank_endpoint(r, ipv4=options.ipv4, vlan=options.vlan) for r in range(options.dp)]
    numel = {n: p.numel() for n, p in trainer.params.items()}

    def buckets(plan: Plan) -> tuple[Bucket, ...]:
        return tuple(Bucket(sum(numel[n] for n in names), names) for names in plan)

    return Job(
        name=f"sim-{options.model}-dp{options.dp}-{options.proto}-c{options.channels}-s{options.seed}",
        ring=tuple(Member(r, (e.mac,), (e.ip,)) for r, e in enumerate(eps)),
        dtype="float32", protocol=options.proto, channels=options.channels, reduction="avg",
        align_bytes=rp.align_bytes, step_bytes=rp.step_bytes, chunk_steps=rp.chunk_steps,
        parameters=tuple(Param(n, tuple(p.shape)) for n, p in trainer.params.items()),
        first_buckets=buckets(trainer.first_plan), buckets=buckets(trainer.steady_plan),
        optimizer=trainer.spec, clip_grad_norm=options.clip, start_step=0,
        init="truth/step-0.safetensors", resync="truth",
        extra={"simulator": {"model": options.model, "seed": options.seed, "iters": options.iters,
                             "mtu": options.mtu, "vlan": options.vlan,
                             "optimizer": f"torch.optim {trainer.spec.kind} with foreach=False",
                             "clip": "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm), defaults"}},
    )


def write_truth_step(out: str, step: int, trainer: Trainer) -> None:
    from safetensors.numpy import save_file

    save_file(trainer.state(), os.path.join(out, "truth", f"step-{step}.safetensors"), metadata={"step": str(step)})


def _dump(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def simulate(options: SimOptions, *, keep_finals: bool = False) -> SimResult:
    """Run the simulator; see the module docstring for what it writes."""
    started = time.perf_counter()
    os.makedirs(os.path.join(options.out, "truth"), exist_ok=True)
    trainer = Trainer(options.train)
    rp = ring_params(options)
    job = build_job(options, trainer, rp)
    job_path = os.path.join(options.out, "job.yaml")
    with open(job_path, "w", encoding="utf-8") as f:
        yaml.safe_dump(job_to_dict(job), f, sort_keys=False)

    eps = [rank_endpoint(r, ipv4=options.ipv4, vlan=options.vlan) for r in range(options.dp)]
    mirrors = options.mirrors
    seen = {(s, d) for s in range(options.dp) for d in range(options.dp) if any(m.sees(s, d) for m in mirrors)}
    wire = Wire(eps, rp, mtu=options.mtu, seed=options.seed, wanted=lambda s, d: (s, d) in seen)
    ports = [MirrorPort(m, os.path.join(options.out, m.filename), options.injection, options.seed, i)
             for i, m in enumerate(mirrors)]

    def flush() -> None:
        frames = wire.drain()
        for port in ports:
            port.feed(frames)

    write_truth_step(options.out, 0, trainer)
    _startup(wire, trainer, options)
    flush()
    records: list[dict] = []
    finals: list[np.ndarray] = []
    losses: list[tuple[float, ...]] = []
    rng = np.random.default_rng([options.seed, 0x50325020])
    for it in range(1, options.iters + 1):
        wire.idle(COMPUTE_NS)
        rank_losses, inputs = trainer.rank_buckets(it)
        reduced = []
        for b, per_rank in enumerate(inputs):
            red = ring_allreduce(per_rank, rp)
            wire.allreduce(red)
            reduced.append(red.final)
            records.append({"index": len(records) + 1, "iteration": it, "bucket": b, "elements": red.count,
                            "dtype": "float32", "sha256": hashlib.sha256(red.final.tobytes()).hexdigest(),
                            "channels": rp.nchannels})
        trainer.apply(it, reduced)
        losses.append(tuple(rank_losses))
        if keep_finals:
            finals += [np.array(v) for v in reduced]
        if it == options.iters and options.tail is not None:
            _tail(wire, ports, red, trainer, options, flush)  # the capture ends inside it
        else:
            _between_iterations(wire, it, options, rng)
            flush()
        write_truth_step(options.out, it, trainer)
    for port in ports:
        port.close()

    injected = {"loss": options.loss, "reorder": options.reorder, "dup": options.dup, "seed": options.seed,
                "pcaps": {m.filename: {"rank": m.rank, "direction": m.direction, **p.record.to_json()}
                          for m, p in zip(mirrors, ports)}}
    _dump(os.path.join(options.out, "injected.json"), injected)
    _dump(os.path.join(options.out, "truth", "allreduces.json"), records)
    _dump(os.path.join(options.out, "truth", "losses.json"),
          [{"iteration": i + 1, "losses": list(l)} for i, l in enumerate(losses)])
    _dump(os.path.join(options.out, "truth", "traffic.json"),
          {"endpoints": [{"rank": r, "mac": e.mac, "ip": e.ip, "vlan": e.vlan} for r, e in enumerate(eps)],
           "connections": wire.connection_table(), "counts": wire.counts})
    seconds = time.perf_counter() - started
    log.info("simulated %d iterations, %d allreduces in %.1f s", options.iters, len(records), seconds)
    return SimResult(options.out, job, job_path, {str(m): os.path.join(options.out, m.filename) for m in mirrors},
                     tuple(records), tuple(losses), injected, seconds, tuple(finals))


def _tail(wire: Wire, ports: list[MirrorPort], red, trainer: Trainer, options: SimOptions, flush) -> None:
    """The step after the last allreduce (``SimOptions.tail``), each port keeping its first ``tail_frames`` frames;
    "next" starts the allreduce the job's schedule has next (the first bucket of the next iteration)."""
    flush()
    after = None
    if options.tail == "next":
        rng = np.random.default_rng([options.seed, 0x4E455854])
        numel = {n: p.numel() for n, p in trainer.params.items()}
        count = sum(numel[n] for n in trainer.steady_plan[0])
        after = ring_allreduce([rng.standard_normal(count).astype(red.final.dtype) for _ in range(options.dp)],
                               red.params)
    wire.tail(red, options.tail, after)
    frames = wire.drain()
    for port in ports:
        port.feed(frames, keep=options.tail_frames, tail=True)


def _startup(wire: Wire, trainer: Trainer, options: SimOptions) -> None:
    """What a DDP job puts on the ring before iteration 1: small collectives, then the parameter broadcast."""
    wire.broadcast(np.array([options.dp, options.seed], dtype=np.int64))  # 16 B
    wire.broadcast(np.arange(8, dtype=np.int64))  # 64 B: a shape/stride exchange
    flat = np.concatenate([p.detach().numpy().reshape(-1) for p in trainer.params.values()])
    wire.broadcast(flat, chunk=8192, spread=True)  # DDP's _sync_module_states
    wire.management(0, 1 % options.dp)


def _between_iterations(wire: Wire, it: int, options: SimOptions, rng: np.random.Generator) -> None:
    """Non-allreduce traffic after an iteration: bucket-rebuild broadcasts, p2p sends, UD datagrams."""
    n = options.dp
    if it == 1:  # DDP rebuilds its buckets after iteration 1
        wire.broadcast(np.array([it, 0], dtype=np.int64))
        wire.broadcast(np.array([len(wire.links), it], dtype=np.int64))
    if it % P2P_EVERY == 2:
        src = (it // P2P_EVERY) % n
        wire.p2p(src, (src + 1) % n, rng.standard_normal(3000).astype(np.float32))
    if it % UD_EVERY == 1:
        wire.management(it % n, (it + 1) % n)
