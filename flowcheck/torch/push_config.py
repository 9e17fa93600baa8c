"""PushConfig: how a trainer's Checkpointer pushes — where to, which run, how much host memory, what to do when busy."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from urllib.parse import urlparse

from flowcheck.errors import ConfigError, FlowcheckError
from flowcheck.state import check_name

ON_BUSY = ("wait", "coalesce")
TRANSPORTS = ("auto", "tcp", "shm")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class PushConfig:
    """A Checkpointer's push settings, checked on construction (a ConfigError names the field and what to do).

    Example::

        cfg = PushConfig(node="tcp://127.0.0.1:7377", run="gpt", on_busy="coalesce", budget_mib=4096)
        ckpt = Checkpointer(model, optimizer, config=cfg)
    """

    node: str  # tcp://HOST:PORT: the node's push listener (its serve.push)
    run: str  # the run the pushed steps belong to
    budget_mib: float | None = None  # cap on this rank's host buffer (None: no cap); a larger share is refused
    on_busy: str = "wait"  # a save while the previous push is in flight: wait (up to timeout_s) or coalesce (skip)
    timeout_s: float = 30.0  # longest wait for the previous push, and for a connection to the node
    transport: str = "auto"  # shm: shared memory (the node on this host); tcp; auto: shm when the node is on loopback
    hook: bool = True  # call wait() from a pre-step hook on the optimizer (the copy is done before parameters change)
    rng: bool = True  # push the RNG states (torch, numpy, python) with each step
    token: str | None = field(default=None, repr=False)  # the node's token (default: $FLOWCHECK_NODE_TOKEN); never shown
    # (new fields go last: PushConfig's positional order is kept)
    # send a requires_grad=False parameter only when the node lacks it or it changed (its version counter moved);
    # False: every parameter every save (for code that changes frozen parameters through .data without mark_changed)
    skip_frozen: bool = True
    # compare each CPU buffer (a non-parameter tensor: rotary inv_freq, an EMA copy) with the bytes the node last
    # acknowledged, kept in the host buffer; an equal one is not sent again (exact: a byte compare, not a version)
    skip_unchanged_buffers: bool = True
    # stage CUDA tensors in a device buffer (a device-to-device copy: the optimizer step waits only for it) and copy it
    # to the host behind the next iterations: "auto" (when free device memory allows, keeping 10% free), a byte
    # budget (never more; also only when it fits), or 0 (never: device-to-host copies straight into the host buffer)
    gpu_staging: int | str = "auto"
    # shared-memory segments of this rank (transport shm): the node adopts a filled one as its RAM state while the
    # trainer fills the next; more than 2 lets a push go on while a slow snapshot still holds two states
    segments: int = 2

    def __post_init__(self) -> None:
        url = urlparse(self.node) if isinstance(self.node, str) else None
        try:
            port = url.port if url is not None else None
        except ValueError:
            port = None
        if url is None or url.scheme != "tcp" or not url.hostname or not port:
            raise ConfigError(f"node: expected tcp://HOST:PORT (the node's serve.push address), found {self.node!r}")
        try:
            check_name(self.run, "run name")
        except FlowcheckError as e:
            raise ConfigError(f"run: {e}") from e
        if self.on_busy not in ON_BUSY:
            raise ConfigError(f"on_busy: expected 'wait' or 'coalesce', found {self.on_busy!r}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport: expected 'auto', 'tcp' or 'shm', found {self.transport!r}")
        for name in ("timeout_s", "budget_mib"):
            value = getattr(self, name)
            if value is None and name == "budget_mib":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name}: expected a positive number{' or None (no cap)' if name == 'budget_mib' else ''}"
                                  f", found {value!r}")
        for name in ("hook", "rng", "skip_frozen", "skip_unchanged_buffers"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected True or False, found {getattr(self, name)!r}")
        staging = self.gpu_staging
        if not (staging == "auto" or (isinstance(staging, int) and not isinstance(staging, bool) and staging >= 0)):
            raise ConfigError(f"gpu_staging: expected 'auto', a byte budget >= 0 (0: never stage), found {staging!r}")
        if isinstance(self.segments, bool) or not isinstance(self.segments, int) or self.segments < 2:
            raise ConfigError(f"segments: expected an integer >= 2 (the node holds one while the trainer fills "
                              f"another), found {self.segments!r}")
        if self.token is not None and not isinstance(self.token, str):
            raise ConfigError(f"token: expected a string (or None: read $FLOWCHECK_NODE_TOKEN), found a "
                              f"{type(self.token).__name__}")

    @property
    def address(self) -> tuple[str, int]:
        url = urlparse(self.node)
        return url.hostname, url.port

    @property
    def shm(self) -> bool:
        """Whether the host buffer is a shared-memory segment the node reads in place."""
        return self.transport == "shm" or (self.transport == "auto" and self.address[0] in LOOPBACK)

    @property
    def budget_bytes(self) -> int | None:
        return None if self.budget_mib is None else int(self.budget_mib * (1 << 20))


def push_config(config: PushConfig | None, **given: object) -> PushConfig:
    """``config`` with the fields given as keywords replaced (None: not given), or a PushConfig of the keywords alone:
    what ``Checkpointer(config=..., node=..., ...)`` runs with."""
    unknown = sorted(set(given) - {f.name for f in fields(PushConfig)})
    if unknown:
        raise TypeError(f"Checkpointer: unexpected keyword{'s' * (len(unknown) > 1)} {', '.join(unknown)}: expected "
                        f"config=, coords=, arch=, extra=, parent= or a PushConfig field "
                        f"({', '.join(f.name for f in fields(PushConfig))})")
    given = {k: v for k, v in given.items() if v is not None}
    if config is None:
        missing = [k for k in ("node", "run") if k not in given]
        if missing:
            raise ConfigError(f"Checkpointer: expected node= and run= (or config=PushConfig(...)); missing "
                              f"{' and '.join(missing)}")
        return PushConfig(**given)
    if not isinstance(config, PushConfig):
        raise ConfigError(f"Checkpointer: config: expected a flowcheck.torch.PushConfig, found {type(config).__name__}")
    return replace(config, **given) if given else config
