"""The step a restore reads: the fastest tier holding it, its manifest, its model, its verified tensors.

Every tensor comes out of ``assemble_tensor`` — each stored shard's digest is
checked before a byte is used, and shards from any number of sources (DP
groups of several nodes, mirror capture and push mixed) are placed by their
global offsets, so how the step was cut when stored does not matter.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flowcheck.errors import FormatError, ManifestError
from flowcheck.manifest import Manifest
from flowcheck.restore.arch import ModelArch
from flowcheck.restore.assemble import assemble_tensor
from flowcheck.restore.megatron_map import Param, model_params
from flowcheck.tiers.base import Tier

if TYPE_CHECKING:
    from flowcheck.store import Store

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
    def open(cls, store: Store, step: int | str, prefer: str = "auto", arch: ModelArch | None = None,
             branch: str | None = None) -> StepReader:
        tier, manifest = open_step(store, step, prefer, branch)
        return cls(tier, manifest, stored_rows(arch or arch_of(manifest), manifest))

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
            if shape != p.shape:
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


def open_step(store: Store, step: int | str, prefer: str = "auto", branch: str | None = None) -> tuple[Tier, Manifest]:
    """The fastest persistent tier holding ``step`` (a number or 'latest' on ``branch``, default the current
    branch; or a ``sha256:`` digest prefix), opened at the state's branch, and its manifest.

    ``prefer="auto"``: a copy found damaged while reading (a shard's digest, a zarr CRC, a safetensors header)
    is read from another tier holding the same state, with a WARNING naming the damaged tier, step and file
    (``Store.open_step``, tiers/fallback.py); an explicit tier never falls back."""
    return store.open_step(step, prefer, branch)


def stored_rows(arch: ModelArch, manifest: Manifest) -> ModelArch:
    """``arch`` with the vocabulary rows the step holds: a trainer without ``arch=``, or a safetensors file, may have
    stored Megatron's padding rows with a description that names only the true vocabulary."""
    entry = manifest.tensors.get("embedding.word_embeddings.weight")
    rows = entry.global_shape[0] if entry is not None and entry.global_shape else None
    if arch.padded_vocab_size is not None or rows is None or rows <= arch.vocab_size:
        return arch  # anything else that does not match is params()'s to report
    return arch.with_stored_rows(rows, f"step {manifest.step} embedding.word_embeddings.weight")


def arch_of(manifest: Manifest) -> ModelArch:
    raw = (manifest.scalars.get("extra") or {}).get(MODEL_KEY)
    if raw is None:
        raise FormatError(
            f"step {manifest.step} of run {manifest.run} carries no model description "
            "(Megatron argument names); give it with --arch FILE.yaml"
        )
    return ModelArch.from_mapping(raw, f"step {manifest.step} manifest scalars.extra.model")


# what `flowcheck import` (and a pushing trainer) keep of Megatron in scalars.extra.megatron, as restore reads it
_MEGATRON_FIELDS = {
    "args": (dict, "an object of Megatron arguments"),
    "opt_param_scheduler": (dict, "an object"),
    "param_groups": (list, "a list of objects"),
    "num_floating_point_operations_so_far": ((int, float), "a number"),
}


def megatron_extra(m: Manifest) -> dict[str, Any]:
    """``scalars.extra.megatron``, every field restore reads of the type it reads it as."""
    raw = (m.scalars.get("extra") or {}).get(MEGATRON_KEY)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise bad_field(m, f"extra.{MEGATRON_KEY}", "an object", raw)
    for key, (kind, expected) in _MEGATRON_FIELDS.items():
        value = raw.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise bad_field(m, f"extra.{MEGATRON_KEY}.{key}", expected, value)
    if not all(isinstance(g, dict) for g in raw.get("param_groups") or []):
        raise bad_field(m, f"extra.{MEGATRON_KEY}.param_groups", "a list of objects", raw["param_groups"])
    return raw


def bad_field(m: Manifest, field_: str, expected: str, found: Any) -> ManifestError:
    """A stored scalar restore cannot use, named by its manifest field."""
    shown = repr(found)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ManifestError(f"step {m.step} of run {m.run}: manifest field 'scalars.{field_}': expected {expected}, found "
                         f"{shown}; restore cannot build the checkpoint's args and optimizer from it")
