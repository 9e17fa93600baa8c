"""Where a DCP save goes: the store a Writer or Reader opens, and the plan the coordinator makes for every rank.

The coordinator decides once, before any rank writes, everything the ranks' parts must agree on (tiers/cluster.py
merges only parts that agree): the step's tensor specs (from every rank's write items: DCP's chunk offsets and
sizes are already boxes of the global tensors), the index of keys and bytes items, the branch the step goes to
and its parent, and a save id that names this save's temporary folder.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flowcheck import config as config_mod
from flowcheck import dtypes
from flowcheck.config import Config, LocalConfig, ObjectConfig, TiersConfig
from flowcheck.dcp.index import KEY, DcpIndex, tensor_name
from flowcheck.errors import ConfigError, FlowcheckError, FormatError
from flowcheck.manifest import ParentRef
from flowcheck.state import ParallelLayout, Scalars, StateLayout, TensorSpec

TIERS = ("local", "object")


class DcpPlanError(FlowcheckError, ValueError):
    """The ranks of a DCP save describe a tensor differently, or hold something flowcheck cannot store."""


def open_config(where: Config | str | None, run: str | None) -> tuple[Config, str]:
    """(config, default tier) from a Config, a YAML file, an fsspec URL (the object tier there: ``s3://b/p``,
    ``file:///dir``), a folder (the local tier's root) or None ($FLOWCHECK_CONFIG, else the defaults)."""
    if isinstance(where, Config):
        cfg, tier = where, "local"
    elif where is None or (isinstance(where, str) and where.endswith((".yaml", ".yml"))):
        cfg, tier = config_mod.load(where), "local"
    elif isinstance(where, str) and "://" in where:
        staging = os.path.join(tempfile.gettempdir(), "flowcheck-staging")
        local = LocalConfig(root=os.path.join(staging, "local"))  # holds nothing: the object tier's store
        cfg, tier = Config(tiers=TiersConfig(local=local, object=ObjectConfig(url=where, staging_dir=staging))), "object"
    elif isinstance(where, (str, os.PathLike)):
        cfg = Config(tiers=TiersConfig(local=LocalConfig(root=os.fspath(where)), object=ObjectConfig(enabled=False)))
        tier = "local"
    else:
        raise ConfigError(f"flowcheck.dcp: expected a Config, a config file (.yaml), a URL (s3://bucket/prefix) or a "
                          f"folder, found {type(where).__name__}")
    return (dataclasses.replace(cfg, run=run) if run is not None else cfg), tier


def cores_per_rank(most: int) -> int:
    """Threads a rank's reads or writes may use: its share of the host's cores (``LOCAL_WORLD_SIZE`` ranks per host, as
    torchrun sets it; else the world size), 1 to ``most`` — threads on cores the other ranks use only slow them."""
    import torch.distributed as dist

    local = os.environ.get("LOCAL_WORLD_SIZE")
    ranks = int(local) if local and local.isdigit() else (dist.get_world_size() if dist.is_initialized() else 1)
    return max(1, min(most, (os.cpu_count() or 1) // max(1, ranks)))


def check_tier(tier: str, cfg: Config) -> str:
    if tier not in TIERS:
        raise ConfigError(f"flowcheck.dcp: tier: expected one of {TIERS}, found {tier!r}")
    if tier == "object" and not cfg.tiers.object.enabled:
        raise ConfigError("flowcheck.dcp: tier='object' but tiers.object.enabled is false in the config; enable it "
                          "or save to the local tier")
    return tier


@dataclass(frozen=True)
class SaveTarget:
    """What every rank of one DCP save writes by (the coordinator's decision, sent in each rank's plan)."""

    run: str
    step: int
    tier: str  # local | object
    branch: str
    parent: ParentRef | None
    save_id: str  # names this save's temporary folder (local tier)
    specs: tuple[TensorSpec, ...]  # every tensor of the step but the bytes items (their sizes are known later)
    scalars: Scalars  # identical in every part: the DCP index
    world: int
    node: str = ""  # this rank's part: rank-<rank:05d>

    def layout(self, specs: tuple[TensorSpec, ...] | None = None) -> StateLayout:
        return StateLayout(self.specs if specs is None else specs, ParallelLayout(dp=max(1, self.world)))

    def index(self) -> DcpIndex:
        return DcpIndex.from_json(self.scalars.extra[KEY], f"save of step {self.step}")


def node_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def plan_save(plans: list[Any], *, run: str, step: int, tier: str, branch: str, parent: ParentRef | None) -> list[Any]:
    """Every rank's plan with its SaveTarget as ``storage_data`` (called on the coordinator)."""
    from torch.distributed.checkpoint.planner import WriteItemType

    specs: dict[str, tuple[str, TensorSpec]] = {}
    objects: list[str] = []
    merged: dict[str, Any] = {}
    for rank, plan in enumerate(plans):
        if isinstance(plan.planner_data, Mapping):
            merged.update(plan.planner_data)
        for item in plan.items:
            key = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                objects.append(key)
                continue
            spec = _spec(key, item.tensor_data, rank)
            seen = specs.setdefault(spec.name, (key, spec))
            if seen != (key, spec):
                raise DcpPlanError(f"DCP save of step {step}: key {key!r}: rank {rank} describes it as "
                                   f"{spec.dtype}{list(spec.shape)}, another rank as {seen[1].dtype}"
                                   f"{list(seen[1].shape)} (or two keys share the name {spec.name}); every rank must "
                                   "save the same global tensors")
    index = DcpIndex.of([k for k, _ in specs.values()], sorted(set(objects)), merged)
    target = SaveTarget(run, step, tier, branch, parent, uuid.uuid4().hex[:12],
                        tuple(s for _, s in sorted(specs.values(), key=lambda ks: ks[1].name)),
                        Scalars(extra={KEY: index.to_json()}), len(plans))
    return [dataclasses.replace(p, storage_data=dataclasses.replace(target, node=node_name(r)))
            for r, p in enumerate(plans)]


def _spec(key: str, data: Any, rank: int) -> TensorSpec:
    if data is None:
        raise DcpPlanError(f"DCP save: key {key!r} of rank {rank} is a tensor item without tensor_data")
    try:
        dtype = dtypes.from_torch(data.properties.dtype).name
    except FormatError as e:
        raise DcpPlanError(f"DCP save: key {key!r}: {e}; convert it before saving (or leave it out)") from e
    return TensorSpec(tensor_name(key), dtype, tuple(int(n) for n in data.size))
