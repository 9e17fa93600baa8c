"""The state model: what a checkpoint *is*, independent of where it is stored.

TensorSpec names a canonical (Megatron-Core) tensor and how it splits across
tensor-parallel ranks; Shard is a box of it in the global index space;
StateLayout is the ordered set of specs plus the trainer's parallel layout;
Snapshot is one step's shard data plus its scalars.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from flowcheck import dtypes
from flowcheck.errors import FlowcheckError, UnsafeNameError

# How a tensor splits across TP ranks (see specs/megatron.md); plain PyTorch
# models are all "replicated".
ROLES = ("replicated", "column", "row", "vocab", "qkv", "swiglu_fc1", "expert")

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")  # whole name (fullmatch: '$' would let a '\n' through)


def check_name(name: str, what: str = "tensor name") -> str:
    """Refuse names that could escape a directory or a zarr/safetensors namespace."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name or name.startswith("__"):
        raise UnsafeNameError(
            f"{what} {name!r} is not allowed: expected letters, digits, '_', '-', '.' "
            "(no '/', no '..', no leading '.' or '__')"
        )
    return name


_BRANCH_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # whole name: fullmatch


def check_branch(name: str) -> str:
    """A branch name is one safe path component: letters, digits, '.', '_', '-' (at most 64)."""
    if not isinstance(name, str) or not _BRANCH_RE.fullmatch(name) or name.endswith(".tmp"):
        raise FlowcheckError(
            f"branch name {name!r}: expected letters, digits, '.', '_' or '-' (at most 64, not starting with "
            "'.' or '-'); see `flowcheck ls` for the run's branches"
        )
    return name


@dataclass(frozen=True)
class TensorSpec:
    """One canonical tensor: name, dtype, global shape, TP role."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    role: str = "replicated"

    def __post_init__(self) -> None:
        check_name(self.name)
        dtypes.dtype(self.dtype)
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if any(s < 0 for s in self.shape):
            raise FlowcheckError(f"tensor {self.name}: negative dimension in shape {self.shape}")
        if self.role not in ROLES:
            raise FlowcheckError(f"tensor {self.name}: role {self.role!r} is not one of {ROLES}")

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * dtypes.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Shard:
    """A box of a tensor in its global index space: ``global[offsets : offsets+shape]``."""

    tensor: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "offsets", tuple(int(o) for o in self.offsets))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if len(self.offsets) != len(self.shape):
            raise FlowcheckError(
                f"shard of {self.tensor}: offsets {self.offsets} and shape {self.shape} differ in rank"
            )

    @classmethod
    def whole(cls, spec: TensorSpec) -> Shard:
        return cls(spec.name, (0,) * len(spec.shape), spec.shape)

    def within(self, spec: TensorSpec) -> bool:
        return len(self.shape) == len(spec.shape) and all(
            o >= 0 and o + s <= g for o, s, g in zip(self.offsets, self.shape, spec.shape)
        )

    def intersect(self, region: tuple[slice, ...]) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
        """Overlap with a global region: (slices into this shard, slices into the region) or None."""
        local, out = [], []
        for off, size, sl in zip(self.offsets, self.shape, region):
            lo, hi = max(off, sl.start), min(off + size, sl.stop)
            if lo >= hi and size > 0:
                return None
            local.append(slice(lo - off, hi - off))
            out.append(slice(lo - sl.start, hi - sl.start))
        return tuple(local), tuple(out)


@dataclass(frozen=True)
class ParallelLayout:
    """The trainer's parallel layout the shards were cut for."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if not isinstance(v, int) or v < 1:
                raise FlowcheckError(f"parallel layout: {k} must be a positive integer, got {v!r}")


@dataclass(frozen=True)
class StateLayout:
    """The ordered tensor specs, the source parallel layout, and the gradient-bucket order."""

    tensors: tuple[TensorSpec, ...]
    source: ParallelLayout = ParallelLayout()
    buckets: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise FlowcheckError(f"layout lists tensors more than once: {dup[:5]}")

    def spec(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {
            # sorted: the digest names the set of tensors; the all-reduce order lives in `buckets`
            "tensors": sorted([t.name, t.dtype, list(t.shape), t.role] for t in self.tensors),
            "source": asdict(self.source),
            "buckets": [list(b) for b in self.buckets],
        }

    def digest(self) -> str:
        """sha256 of the canonical layout: two steps with the same digest can be diffed shard by shard."""
        raw = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True)
class Scalars:
    """Everything of a step that is not a tensor: optimizer step, scheduler, RNG, hyper-parameters."""

    optimizer_step: int | None = None
    lr_scheduler: dict[str, Any] | None = None
    rng: dict[str, str] = field(default_factory=dict)  # name -> base64 of the RNG state bytes
    optimizer: dict[str, Any] | None = None  # param_groups and non-tensor per-param state
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Scalars:
        """Scalars from JSON (a manifest, a push header); a field of the wrong type is a FlowcheckError."""
        if not isinstance(raw, Mapping):
            raise FlowcheckError(f"scalars: expected an object, found {_shown(raw)}")
        bad = scalars_problem(raw)
        if bad is not None:
            field_, expected, found = bad
            raise FlowcheckError(f"scalars: field '{field_}': expected {expected}, found {_shown(found)}")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in raw.items() if k in known})


def scalars_problem(raw: Mapping[str, Any]) -> tuple[str, str, Any] | None:
    """The first field of JSON scalars whose type is wrong, as (field, expected, found); None when all fit.

    Unknown keys are left alone (a newer writer's); absent ones take their defaults.  Readers use these values
    as they are (``sorted(rng)``, ``extra.get``), so a forged manifest must not get this far with others."""
    step = raw.get("optimizer_step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        return "optimizer_step", "an integer or null", step
    rng = raw.get("rng", {})
    if not isinstance(rng, Mapping):
        return "rng", "an object of name -> base64 string", rng
    for name, state in rng.items():
        if not isinstance(state, str):
            return f"rng.{name}", "a base64 string", state
    for key in ("lr_scheduler", "optimizer"):
        if raw.get(key) is not None and not isinstance(raw[key], Mapping):
            return key, "an object or null", raw[key]
    groups = (raw.get("optimizer") or {}).get("param_groups")
    if groups is not None and not (isinstance(groups, list) and all(isinstance(g, Mapping) for g in groups)):
        return "optimizer.param_groups", "a list of objects", groups
    if not isinstance(raw.get("extra", {}), Mapping):
        return "extra", "an object", raw["extra"]
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


ArraySource = np.ndarray | Callable[[], np.ndarray]


@dataclass(frozen=True)
class Pin:
    """What a memory-tier pin (``MemoryTier.pin``) hands a writer along with the pinned arrays."""

    id: int  # for MemoryTier.release
    known_digests: Mapping[Shard, str]  # digests already known for these very arrays: a writer need not hash them
    written: Mapping[Shard, int]  # when each shard was last written, so MemoryTier.learn keeps only what still holds
    # a writer calls it once a shard's bytes are out (e.g. in the page cache): that shard may change from then on,
    # so updates arriving during a long snapshot copy only the shards not yet written
    on_shard_written: Callable[[Shard], None]


@dataclass(frozen=True)
class Snapshot:
    """One step of one run: shard data (arrays, or callables that load them) plus scalars.

    ``origin`` is set when the snapshot was read back from a tier (promotion,
    export): writers then keep its identity (producer, created_at, parent) so the
    step keeps its manifest digest in every tier.
    """

    run: str
    step: int
    layout: StateLayout
    data: Mapping[Shard, ArraySource]
    scalars: Scalars = Scalars()
    source: str = "push"
    origin: Any = None  # flowcheck.manifest.Manifest when read back from a tier
    pin: Pin | None = field(default=None, repr=False, compare=False)  # set by MemoryTier.pin

    def __post_init__(self) -> None:
        check_name(self.run, "run name")
        if not isinstance(self.step, int) or self.step < 0:
            raise FlowcheckError(f"step must be a non-negative integer, got {self.step!r}")
        specs = {t.name: t for t in self.layout.tensors}
        for shard in self.data:
            spec = specs.get(shard.tensor)
            if spec is None:
                raise FlowcheckError(f"shard of {shard.tensor!r} has no TensorSpec in the layout")
            if not shard.within(spec):
                raise FlowcheckError(
                    f"shard {shard.offsets}+{shard.shape} of {shard.tensor} lies outside its global shape {spec.shape}"
                )

    def shards(self) -> Iterator[Shard]:
        return iter(self.data)

    def array(self, shard: Shard) -> np.ndarray:
        """The shard's data as a C-contiguous numpy array in its storage dtype."""
        src = self.data[shard]
        arr = src() if callable(src) else src
        spec = self.layout.spec(shard.tensor)
        want = np.dtype(dtypes.dtype(spec.dtype).storage)
        if arr.dtype != want or tuple(arr.shape) != shard.shape:
            raise FlowcheckError(
                f"shard of {shard.tensor}: expected {want}{list(shard.shape)}, found {arr.dtype}{list(arr.shape)}"
            )
        # np.ascontiguousarray would turn a 0-d array into shape (1,)
        return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)

    @property
    def nbytes(self) -> int:
        size = {t.name: dtypes.dtype(t.dtype).itemsize for t in self.layout.tensors}
        return sum(int(np.prod(s.shape, dtype=np.int64)) * size[s.tensor] for s in self.data)
