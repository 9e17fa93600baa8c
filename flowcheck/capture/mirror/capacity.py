"""How many cores a mirror-capture node needs: wire bytes per iteration and measured per-core rates -> cores.

A ring allreduce of G gradient bytes over N ranks sends 2·(N−1)/N·G bytes on every link; LL doubles that
(half of every 16-byte line is flag); each packet adds its headers (Ethernet, IP, UDP, BTH, ICRC and, per
message, RETH/immediate) to a payload of one path MTU.  The node decodes every mirrored stream it gets
(m of them), so it reads m times one link's wire per iteration, then applies the optimizer once.  Core-seconds
are that wire over the measured decode rate per core, plus the measured update time; the cores needed are the
core-seconds over the iteration time, divided by the measured parallel efficiency of the decode workers.

The default rates are this repository's measurements (BENCHMARKS.md, "Mirror capture"); pass your own from
``benchmarks/bench_mirror.py`` on the node's hardware.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from flowcheck.errors import ConfigError

# IPv6 RoCEv2 data packet: Ethernet 14 + IPv6 40 + UDP 8 + BTH 12 + ICRC 4 (+ 4 FCS not captured); the RETH or
# immediate of a message's first/last packet adds 4–16 bytes per 64 packets at most: counted as 1 byte/packet
HEADER_BYTES = 14 + 40 + 8 + 12 + 4 + 1
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "int32": 4}
# measured (BENCHMARKS.md, "Mirror capture (issue 22)"): decode of the 304.5M-parameter end-to-end run, wire
# bytes per core-second, and the replica's AdamW update per parameter on one core
DEFAULT_DECODE_GB_PER_CORE_S = 0.81
DEFAULT_UPDATE_NS_PER_PARAM = 1.64
DEFAULT_PARALLEL_EFFICIENCY = 0.9  # decode workers on separate cores (streams are independent); measure yours


@dataclass(frozen=True)
class MirrorLoad:
    """One data-parallel group as a mirror node sees it, and the node's measured per-core rates."""

    params: float  # parameters all-reduced per iteration (the DP group's gradient)
    dp: int  # N: ranks in the ring
    mirrored: int = 3  # m: mirrored streams the node decodes (FlowCheck recommends >= 3)
    iteration_s: float = 1.0
    protocol: str = "ll"  # ll | simple
    dtype: str = "float32"
    mtu: int = 1024
    decode_gb_per_core_s: float = DEFAULT_DECODE_GB_PER_CORE_S
    update_ns_per_param: float = DEFAULT_UPDATE_NS_PER_PARAM
    parallel_efficiency: float = DEFAULT_PARALLEL_EFFICIENCY

    def __post_init__(self) -> None:
        checks = {"params": self.params > 0, "dp": isinstance(self.dp, int) and self.dp >= 2,
                  "mirrored": isinstance(self.mirrored, int) and 1 <= self.mirrored <= 2 * self.dp,
                  "iteration_s": self.iteration_s > 0, "protocol": self.protocol in ("ll", "simple"),
                  "dtype": self.dtype in DTYPE_BYTES, "mtu": self.mtu in (256, 512, 1024, 2048, 4096),
                  "decode_gb_per_core_s": self.decode_gb_per_core_s > 0, "update_ns_per_param": self.update_ns_per_param >= 0,
                  "parallel_efficiency": 0 < self.parallel_efficiency <= 1}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ConfigError(f"MirrorLoad.{bad[0]}: found {getattr(self, bad[0])!r}; expected params > 0, dp >= 2, "
                              "1 <= mirrored <= 2·dp, iteration_s > 0, protocol ll|simple, dtype float32|bfloat16|int32, "
                              "mtu 256..4096, rates > 0, 0 < parallel_efficiency <= 1")


@dataclass(frozen=True)
class MirrorCapacity:
    wire_gb_per_stream: float  # one mirrored link's wire per iteration
    wire_gb: float  # everything the node reads per iteration
    decode_core_s: float
    update_core_s: float
    core_s: float  # per iteration
    cores: int  # to keep up with the iteration time
    load: MirrorLoad

    def to_json(self) -> dict:
        return {"wire_gb_per_stream": self.wire_gb_per_stream, "wire_gb": self.wire_gb,
                "decode_core_s": self.decode_core_s, "update_core_s": self.update_core_s, "core_s": self.core_s,
                "cores": self.cores, "rates": {"decode_gb_per_core_s": self.load.decode_gb_per_core_s,
                                               "update_ns_per_param": self.load.update_ns_per_param,
                                               "parallel_efficiency": self.load.parallel_efficiency}}


def wire_bytes_per_stream(load: MirrorLoad) -> float:
    """Bytes one ring link carries for one iteration's allreduces (headers included)."""
    payload = 2 * (load.dp - 1) / load.dp * load.params * DTYPE_BYTES[load.dtype]
    if load.protocol == "ll":
        payload *= 2
    return payload * (1 + HEADER_BYTES / load.mtu)


def capacity(load: MirrorLoad) -> MirrorCapacity:
    per_stream = wire_bytes_per_stream(load)
    wire = per_stream * load.mirrored
    decode_s = wire / (load.decode_gb_per_core_s * 1e9)
    update_s = load.params * load.update_ns_per_param * 1e-9
    core_s = decode_s + update_s
    cores = max(1, math.ceil(decode_s / load.iteration_s / load.parallel_efficiency + update_s / load.iteration_s))
    return MirrorCapacity(per_stream / 1e9, wire / 1e9, decode_s, update_s, core_s, cores, load)


def render(c: MirrorCapacity) -> list[str]:
    l = c.load
    return [f"Mirror capture node (N={l.dp}, {l.mirrored} mirrored streams, {l.params / 1e9:g}B parameters, "
            f"{l.protocol.upper()}, {l.dtype}, {l.iteration_s:g} s per iteration):",
            f"  wire per iteration: {c.wire_gb_per_stream:.2f} GB per stream, {c.wire_gb:.2f} GB in all",
            f"  core-seconds per iteration: {c.core_s:.1f} (decode {c.decode_core_s:.1f} at "
            f"{l.decode_gb_per_core_s:g} GB/s of wire per core, update {c.update_core_s:.1f} at "
            f"{l.update_ns_per_param:g} ns/parameter)",
            f"  cores to keep up: {c.cores} (decode workers at {l.parallel_efficiency:.0%} parallel efficiency)"]
