"""The mirror-capture job description: who is in the DP ring, what its allreduces carry, how to update.

A ``Job`` is what a checkpoint node must know to turn mirrored allreduce traffic into training
state, and nothing is guessed from the traffic that the job can say (see configs/mirror-job.yaml
for a commented example).  Loaded from YAML with every field checked; errors name the file and
the field, what was expected and what was found.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


from flowcheck.capture.mirror.ring import PROTOCOLS, RingParams
from flowcheck.errors import JobError

DTYPES = {"float32": 4, "bfloat16": 2, "int32": 4}
REDUCTIONS = ("avg", "sum", "sum-then-divide")
OPTIMIZERS = ("sgd", "adam", "adamw")
IMPLS = ("single", "foreach", "fused")
_MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")


@dataclass(frozen=True)
class Member:
    """One DP rank in ring order: the NIC addresses its RoCE frames come from."""

    rank: int
    macs: tuple[str, ...] = ()
    ips: tuple[str, ...] = ()  # normalised (ipaddress) text; IPv4 or IPv6


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Bucket:
    """One allreduce: its element count and, when known, the parameters it covers in flat order."""

    elements: int
    params: tuple[str, ...] = ()


@dataclass(frozen=True)
class OptimizerSpec:
    """The trainer's optimizer, with torch's argument names and defaults."""

    kind: str  # sgd | adam | adamw
    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    maximize: bool = False
    impl: str = "single"  # the trainer's torch implementation: single (foreach=False) | foreach | fused

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise JobError(f"optimizer.impl: expected one of {IMPLS} (the trainer's torch implementation), found {self.impl!r}")
        if self.kind not in OPTIMIZERS:
            raise JobError(f"optimizer.kind: expected one of {OPTIMIZERS}, found {self.kind!r}")
        if not self.lr > 0:
            raise JobError(f"optimizer.lr: expected > 0, found {self.lr!r}")


@dataclass(frozen=True)
class Job:
    name: str
    ring: tuple[Member, ...]  # DP ring order: position 0, 1, ...
    dtype: str = "float32"
    protocol: str = "ll"
    channels: int | None = None  # None: detected from the data connections seen per link
    reduction: str = "avg"  # avg: wire values are the mean | sum: the sum is the gradient | sum-then-divide
    align_bytes: int = 4096
    step_bytes: int | None = None  # wire bytes of one NCCL step (default: LL/LL128 64 KiB, Simple 512 KiB)
    chunk_steps: int | None = None  # steps per chunk (default: LL/LL128 1, Simple 4)
    parameters: tuple[Param, ...] = ()  # model.parameters() order
    first_buckets: tuple[Bucket, ...] = ()  # iteration 1 (DDP: one bucket before it rebuilds)
    buckets: tuple[Bucket, ...] = ()  # every later iteration
    optimizer: OptimizerSpec | None = None
    clip_grad_norm: float | None = None
    start_step: int = 0  # trainer step before the first captured iteration; iteration i stores step start_step+i
    init: str | None = None  # initial state: a .safetensors file (canonical names) or a stored step number
    resync: str | None = None  # directory of full states step-<N>.safetensors standing in for a trainer push
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise JobError(f"dtype: expected one of {sorted(DTYPES)}, found {self.dtype!r}")
        if self.reduction not in REDUCTIONS:
            raise JobError(f"reduction: expected one of {REDUCTIONS}, found {self.reduction!r}")
        if self.protocol not in PROTOCOLS:
            raise JobError(f"protocol: expected one of {PROTOCOLS}, found {self.protocol!r}")
        if len(self.ring) < 2:
            raise JobError(f"ring: expected at least 2 members, found {len(self.ring)}")
        if len({m.rank for m in self.ring}) != len(self.ring):
            raise JobError("ring: a rank appears twice")
        if not self.buckets:
            raise JobError("buckets.steady: expected at least one bucket (element counts in allreduce order)")
        self._check_params()

    def _check_params(self) -> None:
        if not self.parameters:
            return
        numel = {p.name: p.numel for p in self.parameters}
        if len(numel) != len(self.parameters):
            raise JobError("parameters: a name appears twice")
        for plan, label in ((self.first_buckets, "first"), (self.buckets, "steady")):
            seen: list[str] = []
            for i, b in enumerate(plan):
                unknown = [n for n in b.params if n not in numel]
                if unknown:
                    raise JobError(f"buckets.{label}[{i}]: unknown parameter {unknown[0]!r}")
                if b.params and sum(numel[n] for n in b.params) != b.elements:
                    raise JobError(f"buckets.{label}[{i}]: parameters hold {sum(numel[n] for n in b.params)} "
                                   f"elements but the bucket has {b.elements}")
                seen += b.params
            if plan and sorted(seen) != sorted(numel):
                raise JobError(f"buckets.{label}: expected every parameter in exactly one bucket; "
                               f"missing {sorted(set(numel) - set(seen))[:3]}, repeated {len(seen) - len(set(seen))}")

    # ---- derived -------------------------------------------------------
    @property
    def nranks(self) -> int:
        return len(self.ring)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    def ring_params(self, nchannels: int) -> RingParams:
        simple = self.protocol == "simple"
        return RingParams(
            nranks=self.nranks, nchannels=nchannels, protocol=self.protocol, itemsize=self.itemsize,
            align_bytes=self.align_bytes,
            step_bytes=self.step_bytes or (524288 if simple else 65536),
            chunk_steps=self.chunk_steps or (4 if simple else 1),
        )

    def plan(self, iteration: int) -> tuple[Bucket, ...]:
        """Buckets all-reduced in ``iteration`` (1-based), in allreduce order."""
        return self.first_buckets if iteration == 1 and self.first_buckets else self.buckets

    def position_of(self, mac: str, ip: str) -> int | None:
        """Ring position of the member a frame came from (by MAC, else by IP), or None."""
        for pos, m in enumerate(self.ring):
            if mac in m.macs or ip in m.ips:
                return pos
        return None

    @property
    def trains(self) -> bool:
        """True when the job can update a replica (parameters, bucket contents and optimizer known)."""
        return bool(self.parameters and self.optimizer and all(b.params for b in self.buckets + self.first_buckets))


# ---- loading ----------------------------------------------------------------
def load_job(path: str) -> Job:
    """Read a job YAML file; relative ``init``/``resync`` paths are taken from the file's folder."""
    from flowcheck.config import read_yaml

    raw = read_yaml(path, JobError, "job file")
    try:
        job = job_from_dict(raw)
    except JobError as e:
        raise JobError(f"{path}: {e}") from e
    base = os.path.dirname(os.path.abspath(path))
    anchor = {k: os.path.normpath(os.path.join(base, v)) for k in ("init", "resync")
              if isinstance(v := getattr(job, k), str) and not v.isdigit() and not os.path.isabs(v)}
    return dataclasses.replace(job, **anchor) if anchor else job


_TOP = {"name", "ring", "dtype", "protocol", "channels", "reduction", "nccl", "parameters", "buckets",
        "optimizer", "clip_grad_norm", "start_step", "init", "resync", "extra"}


def job_from_dict(raw: Any) -> Job:
    if not isinstance(raw, Mapping):
        raise JobError(f"expected a mapping at the top of the job, found {type(raw).__name__}")
    unknown = sorted(set(raw) - _TOP)
    if unknown:
        raise JobError(f"{unknown[0]!r}: unknown field; expected one of {sorted(_TOP)}")
    nccl = _mapping(raw.get("nccl", {}), "nccl", {"align_bytes", "step_bytes", "chunk_steps"})
    params = tuple(_param(p, i) for i, p in enumerate(_list(raw.get("parameters", []), "parameters")))
    buckets = _mapping(raw.get("buckets"), "buckets", {"first", "steady"})
    channels = raw.get("channels", "auto")
    return Job(
        name=_str(raw.get("name", "job"), "name"),
        ring=tuple(_member(m, i) for i, m in enumerate(_list(raw.get("ring"), "ring"))),
        dtype=_str(raw.get("dtype", "float32"), "dtype"),
        protocol=_str(raw.get("protocol", "ll"), "protocol").lower(),
        channels=None if channels == "auto" else _int(channels, "channels", 1),
        reduction=_str(raw.get("reduction", "avg"), "reduction"),
        align_bytes=_int(nccl.get("align_bytes", 4096), "nccl.align_bytes", 1),
        step_bytes=None if nccl.get("step_bytes") is None else _int(nccl["step_bytes"], "nccl.step_bytes", 16),
        chunk_steps=None if nccl.get("chunk_steps") is None else _int(nccl["chunk_steps"], "nccl.chunk_steps", 1),
        parameters=params,
        first_buckets=_plan(buckets.get("first"), "buckets.first", params),
        buckets=_plan(buckets.get("steady"), "buckets.steady", params),
        optimizer=_optimizer(raw.get("optimizer")),
        clip_grad_norm=None if raw.get("clip_grad_norm") is None else _float(raw["clip_grad_norm"], "clip_grad_norm"),
        start_step=_int(raw.get("start_step", 0), "start_step", 0),
        init=None if raw.get("init") is None else str(raw["init"]),
        resync=None if raw.get("resync") is None else _str(raw["resync"], "resync"),
        extra=dict(_mapping(raw.get("extra", {}), "extra", None)),
    )


def job_to_dict(job: Job) -> dict[str, Any]:
    """The YAML form of a job (what ``flowcheck simulate`` writes); ``job_from_dict`` reads it back."""
    out: dict[str, Any] = {
        "name": job.name,
        "ring": [{"rank": m.rank, "mac": list(m.macs), "ip": list(m.ips)} for m in job.ring],
        "dtype": job.dtype, "protocol": job.protocol,
        "channels": "auto" if job.channels is None else job.channels,
        "reduction": job.reduction,
        "nccl": {k: v for k, v in (("align_bytes", job.align_bytes), ("step_bytes", job.step_bytes),
                                   ("chunk_steps", job.chunk_steps)) if v is not None},
        "parameters": [{"name": p.name, "shape": list(p.shape)} for p in job.parameters],
        "buckets": {"first": [_bucket_out(b) for b in job.first_buckets], "steady": [_bucket_out(b) for b in job.buckets]},
        "clip_grad_norm": job.clip_grad_norm, "start_step": job.start_step, "init": job.init, "resync": job.resync,
    }
    if job.optimizer is not None:
        o = job.optimizer
        out["optimizer"] = {"kind": o.kind, "lr": o.lr, "momentum": o.momentum, "dampening": o.dampening,
                            "nesterov": o.nesterov, "betas": list(o.betas), "eps": o.eps,
                            "weight_decay": o.weight_decay, "amsgrad": o.amsgrad, "maximize": o.maximize, "impl": o.impl}
    if job.extra:
        out["extra"] = dict(job.extra)
    return out


def _bucket_out(b: Bucket) -> Any:
    return list(b.params) if b.params else b.elements


# ---- field readers ------------------------------------------------------------
def _mapping(v: Any, where: str, allowed: set[str] | None) -> Mapping[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise JobError(f"{where}: expected a mapping, found {v!r}")
    if allowed is not None and (bad := sorted(set(v) - allowed)):
        raise JobError(f"{where}.{bad[0]}: unknown field; expected one of {sorted(allowed)}")
    return v


def _list(v: Any, where: str) -> list[Any]:
    if not isinstance(v, list):
        raise JobError(f"{where}: expected a list, found {v!r}")
    return v


def _str(v: Any, where: str) -> str:
    if not isinstance(v, str) or not v:
        raise JobError(f"{where}: expected a non-empty string, found {v!r}")
    return v


def _int(v: Any, where: str, least: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise JobError(f"{where}: expected an integer >= {least}, found {v!r}")
    return v


def _float(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise JobError(f"{where}: expected a number, found {v!r}")
    return float(v)


def _member(raw: Any, i: int) -> Member:
    where = f"ring[{i}]"
    m = _mapping(raw, where, {"rank", "mac", "ip"})
    macs = m.get("mac", [])
    ips = m.get("ip", [])
    macs = [macs] if isinstance(macs, str) else _list(macs, f"{where}.mac")
    ips = [ips] if isinstance(ips, str) else _list(ips, f"{where}.ip")
    for mac in macs:
        if not isinstance(mac, str) or not _MAC.fullmatch(mac.lower()):
            raise JobError(f"{where}.mac: expected aa:bb:cc:dd:ee:ff, found {mac!r}")
    norm = []
    for ip in ips:
        try:
            norm.append(str(ipaddress.ip_address(str(ip))))
        except ValueError as e:
            raise JobError(f"{where}.ip: expected an IPv4 or IPv6 address, found {ip!r}") from e
    if not macs and not ips:
        raise JobError(f"{where}: expected at least one mac or ip to recognise the member's frames")
    return Member(_int(m.get("rank", i), f"{where}.rank", 0), tuple(x.lower() for x in macs), tuple(norm))


def _param(raw: Any, i: int) -> Param:
    m = _mapping(raw, f"parameters[{i}]", {"name", "shape"})
    shape = _list(m.get("shape"), f"parameters[{i}].shape")
    return Param(_str(m.get("name"), f"parameters[{i}].name"), tuple(_int(d, f"parameters[{i}].shape", 0) for d in shape))


def _plan(raw: Any, where: str, params: tuple[Param, ...]) -> tuple[Bucket, ...]:
    if raw is None:
        return ()
    numel = {p.name: p.numel for p in params}
    out = []
    for i, b in enumerate(_list(raw, where)):
        if isinstance(b, list):
            names = tuple(_str(n, f"{where}[{i}]") for n in b)
            bad = [n for n in names if n not in numel]
            if bad:
                raise JobError(f"{where}[{i}]: unknown parameter {bad[0]!r}; declare it under parameters")
            out.append(Bucket(sum(numel[n] for n in names), names))
        else:
            out.append(Bucket(_int(b, f"{where}[{i}]", 0)))
    return tuple(out)


def _optimizer(raw: Any) -> OptimizerSpec | None:
    if raw is None:
        return None
    allowed = {"kind", "lr", "momentum", "dampening", "nesterov", "betas", "eps", "weight_decay", "amsgrad", "maximize", "impl"}
    m = _mapping(raw, "optimizer", allowed)
    kw: dict[str, Any] = {"kind": _str(m.get("kind"), "optimizer.kind").lower(), "lr": _float(m.get("lr"), "optimizer.lr"),
                          "impl": _str(m.get("impl", "single"), "optimizer.impl")}
    for k in ("momentum", "dampening", "eps", "weight_decay"):
        if k in m:
            kw[k] = _float(m[k], f"optimizer.{k}")
    for k in ("nesterov", "amsgrad", "maximize"):
        if k in m:
            if not isinstance(m[k], bool):
                raise JobError(f"optimizer.{k}: expected true or false, found {m[k]!r}")
            kw[k] = m[k]
    if "betas" in m:
        b = _list(m["betas"], "optimizer.betas")
        if len(b) != 2:
            raise JobError(f"optimizer.betas: expected two numbers, found {b!r}")
        kw["betas"] = (_float(b[0], "optimizer.betas"), _float(b[1], "optimizer.betas"))
    return OptimizerSpec(**kw)
