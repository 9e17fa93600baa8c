"""How many cores a mirror-capture node needs: wire bytes per iteration and measured per-core rates -> cores.

A ring allreduce of G gradient bytes over N ranks sends 2·(N−1)/N·G bytes on every link; LL doubles that
(half of every 16-byte line is flag); each packet adds its headers (Ethernet, IP, UDP, BTH, ICRC and, per
message, RETH/immediate) to a payload of one path MTU.  The node decodes every mirrored stream it gets
(m of them), so it reads m times one link's wire per iteration, then applies the optimizer once.  Core-seconds
are that wire over the measured decode rate per core, plus the measured update time; the cores needed are the
core-seconds over the iteration time, divided by the measured parallel efficiency of the decode workers.

Scaled out over K checkpoint nodes (flowcheck/capture/mirror/partition.py), every node still reads and parses
every mirrored frame (the ring schedule needs all of them) but places and updates only its 1/K of the
parameters: per node, decode costs ``decode_core_s · (s + (1 − s)/K)`` and update ``update_core_s / K``, where s
is the measured share of decode work that does not shrink with the part (reading, parsing, ICRC,
reassembly).  ``scale_out`` finds the smallest K whose per-node cores fit a node's cores.

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
# decode speed: wire bytes per core-second of process CPU time for the 304.5M-parameter end-to-end capture on the
# 2-core VM (BENCHMARKS.md, "Mirror capture"): 4.15-4.20 GB measured, normalised by an A/B on one capture for the
# host's speed that hour and rounded down to 3.5.  The replica's AdamW update per parameter on one core: the larger
# of the two measurements (1.31 and 1.64 ns)
DEFAULT_DECODE_GB_PER_CORE_S = 3.5
DEFAULT_UPDATE_NS_PER_PARAM = 1.64
# decode workers on separate cores (streams are independent); measure yours.  An assumption for independent decoders
# (processes or nodes per stream group): inside one decode process only the native work runs on K threads (parse
# with the demux, reassembly, merge: ~0.9 of its CPU since the demux moved into the parse threads, 0.84-0.85 with it
# serial), and this VM's memory gives a plain copy 1.3-1.8x on 2 threads; decode on 2 threads measured 1.39-1.48x
# of one (BENCHMARKS.md, "Mirror capture")
DEFAULT_PARALLEL_EFFICIENCY = 0.9
# measured (BENCHMARKS.md, "Mirror capture scaled out"): a part of K costs (s + (1 - s)/K) of the whole decode;
# 0.83 at K = 2 and 0.74 at K = 4 on a 496 MB capture (parsing, ICRC, reassembly and matching every frame dominate;
# merging final chunks, the part that shrinks, is the smaller share)
DEFAULT_SHARED_DECODE_FRACTION = 0.8


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
    shared_decode_fraction: float = DEFAULT_SHARED_DECODE_FRACTION  # s: decode work every scaled-out node repeats

    def __post_init__(self) -> None:
        checks = {"params": self.params > 0, "dp": isinstance(self.dp, int) and self.dp >= 2,
                  "mirrored": isinstance(self.mirrored, int) and 1 <= self.mirrored <= 2 * self.dp,
                  "iteration_s": self.iteration_s > 0, "protocol": self.protocol in ("ll", "simple"),
                  "dtype": self.dtype in DTYPE_BYTES, "mtu": self.mtu in (256, 512, 1024, 2048, 4096),
                  "decode_gb_per_core_s": self.decode_gb_per_core_s > 0, "update_ns_per_param": self.update_ns_per_param >= 0,
                  "parallel_efficiency": 0 < self.parallel_efficiency <= 1,
                  "shared_decode_fraction": 0 <= self.shared_decode_fraction <= 1}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ConfigError(f"MirrorLoad.{bad[0]}: found {getattr(self, bad[0])!r}; expected params > 0, dp >= 2, "
                              "1 <= mirrored <= 2·dp, iteration_s > 0, protocol ll|simple, dtype float32|bfloat16|int32, "
                              "mtu 256..4096, rates > 0, 0 < parallel_efficiency <= 1, "
                              "0 <= shared_decode_fraction <= 1")


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
    return MirrorCapacity(per_stream / 1e9, wire / 1e9, decode_s, update_s, core_s, _cores(load, decode_s, update_s), load)


def _cores(load: MirrorLoad, decode_s: float, update_s: float) -> int:
    return max(1, math.ceil(decode_s / load.iteration_s / load.parallel_efficiency + update_s / load.iteration_s))


@dataclass(frozen=True)
class ScaleOut:
    """The fewest checkpoint nodes sharing one mirror capture (each its part of the parameters) that keep up."""

    cores_per_node: int  # what one node has
    nodes: int | None  # K; None: no K fits (the decode work every node repeats alone needs more cores)
    cores_needed_per_node: int | None  # at that K
    core_s_per_node: float | None  # per iteration, at that K
    shared_core_s: float  # per node per iteration whatever K: the decode work every node repeats

    def to_json(self) -> dict:
        return {"cores_per_node": self.cores_per_node, "nodes": self.nodes,
                "cores_needed_per_node": self.cores_needed_per_node, "core_s_per_node": self.core_s_per_node,
                "shared_core_s": self.shared_core_s}


def per_node(c: MirrorCapacity, nodes: int) -> tuple[float, int]:
    """(core-seconds per iteration, cores) of one node of ``nodes`` sharing the capture."""
    s = c.load.shared_decode_fraction
    decode_s, update_s = c.decode_core_s * (s + (1 - s) / nodes), c.update_core_s / nodes
    return decode_s + update_s, _cores(c.load, decode_s, update_s)


def scale_out(c: MirrorCapacity, cores_per_node: int, max_nodes: int = 4096) -> ScaleOut:
    if isinstance(cores_per_node, bool) or not isinstance(cores_per_node, int) or cores_per_node < 1:
        raise ConfigError(f"cores_per_node: expected an integer >= 1, found {cores_per_node!r}")
    shared = c.decode_core_s * c.load.shared_decode_fraction
    for nodes in range(1, max_nodes + 1):
        core_s, cores = per_node(c, nodes)
        if cores <= cores_per_node:
            return ScaleOut(cores_per_node, nodes, cores, core_s, shared)
    return ScaleOut(cores_per_node, None, None, None, shared)


def render(c: MirrorCapacity) -> list[str]:
    l = c.load
    return [f"Mirror capture node (N={l.dp}, {l.mirrored} mirrored streams, {l.params / 1e9:g}B parameters, "
            f"{l.protocol.upper()}, {l.dtype}, {l.iteration_s:g} s per iteration):",
            f"  wire per iteration: {c.wire_gb_per_stream:.2f} GB per stream, {c.wire_gb:.2f} GB in all",
            f"  core-seconds per iteration: {c.core_s:.1f} (decode {c.decode_core_s:.1f} at "
            f"{l.decode_gb_per_core_s:g} GB/s of wire per core, update {c.update_core_s:.1f} at "
            f"{l.update_ns_per_param:g} ns/parameter)",
            f"  cores to keep up: {c.cores} (decode workers at {l.parallel_efficiency:.0%} parallel efficiency)"]


def render_scale_out(c: MirrorCapacity, so: ScaleOut) -> list[str]:
    head = (f"  scaled out over nodes of {so.cores_per_node} cores (each node parses every frame: "
            f"{so.shared_core_s:.1f} core-s per iteration whatever the node count; places and updates 1/K):")
    if so.nodes is None:
        return [head, "    no node count keeps up: the work every node repeats alone needs more cores than a node has"]
    return [head, f"    nodes needed: {so.nodes} ({so.cores_needed_per_node} cores each, {so.core_s_per_node:.1f} "
                  f"core-s per node per iteration)"]
