"""The step a restore reads: the fastest tier holding it, its manifest, its model, its verified tensors.

Every tensor comes out of ``assemble_tensor`` — each stored shard's digest is
checked before a byte is used, and shards from any number of sources (DP
groups of several nodes, mirror capture and push mixed) are placed by their
global offsets, so how the step was cut when stored does not matter.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flowcheck.errors import FormatError, StepNotFoundError
from flowcheck.manifest import Manifest
from flowcheck.restore.arch import ModelArch
from flowcheck.restore.assemble import assemble_tensor
from flowcheck.restore.megatron_map import Param, model_params
from flowcheck.tiers.base import Tier

log = logging.getLogger(__name__)

OPT = "optimizer."
MODEL_KEY = "model"  # scalars.extra[MODEL_KEY]: the model description (Megatron argument names)
MEGATRON_KEY = "megatron"  # scalars.extra[MEGATRON_KEY]: args / scheduler / counters of an imported checkpoint


@dataclass
class StepReader:
    """One committed step in one tier, with the model it holds."""

    tier: Tier
    manifest: Manifest
    arch: ModelArch

    @classmethod
    def open(cls, store: Any, step: int | str, prefer: str = "auto", arch: ModelArch | None = None,
             branch: str | None = None) -> StepReader:
        tier, manifest = open_step(store, step, prefer, branch)
        return cls(tier, manifest, arch or arch_of(manifest))

    @property
    def step(self) -> int:
        return self.manifest.step

    def params(self) -> list[Param]:
        """The model's canonical tensors, checked against what the step holds (before anything is written)."""
        params = model_params(self.arch)
        problems = []
        for p in params:
            entry = self.manifest.tensors.get(p.name)
            if entry is None:
                problems.append(f"{p.name}: missing")
                continue
            shape = tuple(entry.global_shape)
            ok = shape == p.shape or (p.role == "vocab" and shape[1:] == p.shape[1:] and shape[0] >= p.shape[0])
            if not ok:
                problems.append(f"{p.name}: expected shape {list(p.shape)}, found {list(shape)}")
        if problems:
            raise FormatError(
                f"step {self.step} does not hold the model its description names "
                f"({len(problems)} problem(s)): " + "; ".join(problems[:6])
                + ("; ..." if len(problems) > 6 else "")
                + " — check --arch, or that this step was stored from this model"
            )
        known = {p.name for p in params}
        stray = [n for n in self.manifest.tensors if not n.startswith(OPT) and n not in known]
        if stray:
            log.warning("step %d holds %d tensors the model does not use (ignored): %s", self.step, len(stray), stray[:5])
        return params

    def slots(self) -> list[str]:
        """Optimizer slots stored for every model tensor (e.g. exp_avg, exp_avg_sq, fp32_param)."""
        names = [p.name for p in model_params(self.arch)]
        found: dict[str, int] = {}
        for n in self.manifest.tensors:
            if n.startswith(OPT):
                slot = n[len(OPT):].split(".", 1)[0]
                found[slot] = found.get(slot, 0) + 1
        return [s for s, count in sorted(found.items()) if all(f"{OPT}{s}.{p}" in self.manifest.tensors for p in names)
                and count >= len(names)]

    def has(self, name: str) -> bool:
        return name in self.manifest.tensors

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The verified global tensor as torch (own memory), optionally converted."""
        from flowcheck.torch.state import from_numpy

        arr = assemble_tensor(self.tier, self.manifest, name)
        t = from_numpy(arr, self.manifest.tensors[name].dtype) if arr.dtype == np.uint16 else torch.from_numpy(arr)
        return t if dtype is None or t.dtype == dtype else t.to(dtype)


def open_step(store: Any, step: int | str, prefer: str = "auto", branch: str | None = None) -> tuple[Tier, Manifest]:
    """The fastest persistent tier holding ``step`` (a number or 'latest' on ``branch``, default the current
    branch; or a ``sha256:`` digest prefix), opened at the state's branch, and its manifest."""
    tier, number = store.locate(step, prefer, branch)
    if tier is store.memory:  # the in-process memory tier only exists inside a node
        try:
            tier, number = store.locate(number, "local", branch)
        except StepNotFoundError:
            tier, number = store.locate(number, "object", branch)
    return tier, tier.manifest(number)


def arch_of(manifest: Manifest) -> ModelArch:
    raw = (manifest.scalars.get("extra") or {}).get(MODEL_KEY)
    if raw is None:
        raise FormatError(
            f"step {manifest.step} of run {manifest.run} carries no model description "
            "(Megatron argument names); give it with --arch FILE.yaml"
        )
    return ModelArch.from_mapping(raw, f"step {manifest.step} manifest scalars.extra.model")
