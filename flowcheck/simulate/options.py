"""What one simulator run is asked to do: ``SimOptions``, one field per ``flowcheck simulate`` flag."""
from __future__ import annotations

from dataclasses import dataclass

from flowcheck.errors import ConfigError
from flowcheck.simulate.mirror import (
    Injection,
    MirrorSpec,
    default_mirrors,
    parse_mirrors,
)
from flowcheck.simulate.model import MODELS
from flowcheck.simulate.trainer import OPTIMIZER_SPECS, TrainConfig

PROTOCOLS = ("ll", "simple")
TAILS = ("resend", "next")  # what follows the last allreduce (SimOptions.tail)
MTUS = (256, 512, 1024, 2048, 4096)  # RoCE path MTUs
MAX_RANKS = 8
MAX_CHANNELS = 8


@dataclass(frozen=True)
class SimOptions:
    """A simulator run; every field is checked on construction and errors name the CLI flag."""

    out: str  # output directory (created)
    dp: int = 4  # data-parallel ranks in the ring (2..8)
    iters: int = 3  # training iterations (one allreduce per bucket each)
    model: str = "tiny"  # tiny (~30k parameters) | small (~0.86M)
    proto: str = "ll"  # NCCL protocol of the ring: ll | simple
    channels: int = 1  # NCCL channels (parallel ring connections per link)
    mirror: tuple[MirrorSpec, ...] | str | None = None  # None: 0:out,1:out,2:out capped at dp
    loss: float = 0.0  # per-frame drop probability at each mirror port
    reorder: float = 0.0  # per-frame probability of swapping with one of the next few frames
    dup: float = 0.0  # per-frame duplication probability
    optimizer: str = "adam"  # sgd | adam | adamw (hyper-parameters in trainer.OPTIMIZER_SPECS)
    clip: float | None = 1.0  # global-norm gradient clipping; None disables
    mtu: int = 1024  # RoCE path MTU (payload bytes per packet)
    ipv4: bool = False  # IPv4 addresses instead of IPv6 link-local
    vlan: int | None = None  # 802.1Q VLAN id on every frame
    bucket_kb: int | None = None  # DDP bucket capacity (KiB); None: 32 for tiny, 512 for small
    seed: int = 0
    # after the last allreduce, one more step on every ring connection: "resend" — each rank re-sends the final
    # chunk it received last (an NCCL that adds that step); "next" — the first step of an allreduce that never
    # finishes (partial sums of new values); None: nothing
    tail: str | None = None
    tail_frames: int | None = None  # each mirror port keeps only the first K frames of the tail (None: all)

    def __post_init__(self) -> None:
        def bad(flag: str, expected: str, found: object) -> ConfigError:
            return ConfigError(f"--{flag}: expected {expected}, found {found!r}")

        if not isinstance(self.dp, int) or not 2 <= self.dp <= MAX_RANKS:
            raise bad("dp", f"an integer from 2 to {MAX_RANKS}", self.dp)
        if not isinstance(self.iters, int) or self.iters < 1:
            raise bad("iters", "an integer >= 1", self.iters)
        if self.model not in MODELS:
            raise bad("model", f"one of {sorted(MODELS)}", self.model)
        if self.proto not in PROTOCOLS:
            raise bad("proto", f"one of {PROTOCOLS}", self.proto)
        if not isinstance(self.channels, int) or not 1 <= self.channels <= MAX_CHANNELS:
            raise bad("channels", f"an integer from 1 to {MAX_CHANNELS}", self.channels)
        if self.optimizer not in OPTIMIZER_SPECS:
            raise bad("optimizer", f"one of {sorted(OPTIMIZER_SPECS)}", self.optimizer)
        if self.clip is not None and not self.clip > 0:
            raise bad("clip", "a positive max norm or none", self.clip)
        if self.mtu not in MTUS:
            raise bad("mtu", f"one of {MTUS}", self.mtu)
        if self.vlan is not None and not 1 <= self.vlan <= 4094:
            raise bad("vlan", "an id from 1 to 4094", self.vlan)
        if self.bucket_kb is not None and self.bucket_kb < 1:
            raise bad("bucket-kb", "an integer >= 1", self.bucket_kb)
        if not isinstance(self.seed, int) or self.seed < 0:
            raise bad("seed", "an integer >= 0", self.seed)
        if self.tail is not None and self.tail not in TAILS:
            raise bad("tail", f"one of {TAILS} or none", self.tail)
        if self.tail_frames is not None and (not isinstance(self.tail_frames, int) or self.tail_frames < 0
                                             or self.tail is None):
            raise bad("tail-frames", "an integer >= 0, with --tail", self.tail_frames)
        Injection(self.loss, self.reorder, self.dup)  # checks the probabilities
        mirrors = self.mirror
        if mirrors is None:
            mirrors = default_mirrors(self.dp)
        elif isinstance(mirrors, str):
            mirrors = parse_mirrors(mirrors)
        for m in mirrors:
            if m.rank >= self.dp:
                raise ConfigError(f"--mirror: rank {m.rank} is not in the ring of {self.dp} ranks (0..{self.dp - 1})")
        if not mirrors:
            raise bad("mirror", "at least one RANK:in|out|both", self.mirror)
        object.__setattr__(self, "mirror", tuple(mirrors))

    @property
    def mirrors(self) -> tuple[MirrorSpec, ...]:
        return self.mirror  # type: ignore[return-value]  # normalised in __post_init__

    @property
    def injection(self) -> Injection:
        return Injection(self.loss, self.reorder, self.dup)

    @property
    def train(self) -> TrainConfig:
        return TrainConfig(model=self.model, dp=self.dp, optimizer=self.optimizer, clip=self.clip,
                           bucket_kb=self.bucket_kb, seed=self.seed)
