"""How a DCP checkpoint's keys map onto a flowcheck step: tensor names, raw-bytes items, the planner's key paths.

A DCP key (``model.layers.0.attention.wq.weight``, ``optim.state.<fqn>.exp_avg``) is the tensor's name in the
step when it is a valid flowcheck name, else a digest-derived name; DCP's non-tensor items (``BytesIO``: the
``torch.save`` bytes of an lr scheduler's, a dataloader's, a param group's value) are uint8 tensors named
``_dcp_bytes.<key>``.  The step's ``scalars.extra.dcp`` (a ``DcpIndex``) records what each name stands for, so a
``Reader`` hands DCP back exactly the keys it saved.  A step written another way (a ``Checkpointer`` push) has no
index: ``push_view`` presents it under the keys of ``get_state_dict(model, optimizer)`` nested under ``PushKeys``
(``model.<param>``, ``optim.state.<param>.<slot>``, ``optim.param_groups.<i>.<field>``) and the scheduler's state
(``lr_scheduler.<field>``), rebuilt from the step's JSON scalars — nothing stored is unpickled.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flowcheck.errors import FlowcheckError, ManifestError, UnsafeNameError
from flowcheck.state import check_name

KEY = "dcp"  # scalars.extra[KEY]
FORMAT = 1
OBJECTS = "_dcp_bytes."  # prefix of the uint8 tensors holding DCP's BytesIO items
OPT = "optimizer."  # flowcheck's optimizer-slot tensors (flowcheck/torch/state.py): optimizer.<slot>.<param>


def _hashed(prefix: str, key: str) -> str:
    return prefix + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def tensor_name(key: str) -> str:
    """The step's name for a DCP tensor key: the key itself when flowcheck accepts it as a name."""
    try:
        if not key.startswith(OBJECTS):
            return check_name(key)
    except UnsafeNameError:
        pass
    return _hashed("dcp-key-", key)


def object_name(key: str) -> str:
    """The step's name for a DCP bytes item (a uint8 tensor of its ``torch.save`` bytes)."""
    try:
        return check_name(OBJECTS + key)
    except UnsafeNameError:
        return _hashed(OBJECTS + "key-", key)


MAX_PATH = 64  # names/indices in a planner_data path: far deeper than any state dict nests
MAX_INDEX = 1 << 20  # a list index in a planner_data path: DCP extends a list to it when it rebuilds the state dict


def _path_ok(path: Any) -> bool:
    """A planner_data path: a non-empty list of names and list indices, bounded (read from a stored manifest)."""
    return isinstance(path, (list, tuple)) and 0 < len(path) <= MAX_PATH and all(
        (isinstance(x, str) and len(x) <= 4096) or (type(x) is int and 0 <= x < MAX_INDEX) for x in path)


@dataclass(frozen=True)
class DcpIndex:
    """What the tensors of a step written through ``flowcheck.dcp`` stand for (``scalars.extra.dcp``)."""

    renamed: Mapping[str, str] = field(default_factory=dict)  # tensor name -> DCP key, where they differ
    objects: Mapping[str, str] = field(default_factory=dict)  # uint8 tensor name -> DCP key of a bytes item
    planner_data: Mapping[str, tuple] = field(default_factory=dict)  # DCP key -> its path in the nested state dict

    @classmethod
    def of(cls, tensor_keys: list[str], object_keys: list[str], planner_data: Any) -> DcpIndex:
        renamed = {tensor_name(k): k for k in tensor_keys if tensor_name(k) != k}
        paths = {}
        if isinstance(planner_data, Mapping):  # DefaultSavePlanner's flattening: key -> (str | int, ...)
            paths = {k: tuple(p) for k, p in planner_data.items() if isinstance(k, str) and _path_ok(p)}
        return cls(renamed, {object_name(k): k for k in object_keys}, paths)

    def key(self, name: str) -> str:
        return self.objects.get(name) or self.renamed.get(name, name)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "renamed": dict(self.renamed), "objects": dict(self.objects),
                "planner_data": {k: list(p) for k, p in self.planner_data.items()}}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> DcpIndex:
        """The index of a stored step; a field of the wrong shape is a ManifestError naming it."""
        def strings(name: str) -> dict[str, str]:
            value = raw.get(name, {})
            if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
                raise ManifestError(f"{where}: scalars.extra.{KEY}.{name}: expected an object of name -> DCP key")
            return dict(value)

        if not isinstance(raw, Mapping) or raw.get("format") != FORMAT:
            raise ManifestError(f"{where}: scalars.extra.{KEY}: expected format {FORMAT}, found "
                                f"{raw.get('format') if isinstance(raw, Mapping) else type(raw).__name__!r}; "
                                "a newer flowcheck wrote this step: upgrade flowcheck")
        paths = raw.get("planner_data", {})
        if not isinstance(paths, Mapping):
            raise ManifestError(f"{where}: scalars.extra.{KEY}.planner_data: expected an object of key -> path, found "
                                f"{type(paths).__name__}")
        bad = next((k for k, p in paths.items() if not _path_ok(p)), None)
        if bad is not None:  # DCP rebuilds nested containers from these paths: an index becomes a list's length
            raise ManifestError(f"{where}: scalars.extra.{KEY}.planner_data[{bad!r:.80}]: expected a path of up to "
                                f"{MAX_PATH} names or list indices below {MAX_INDEX}, found {paths[bad]!r:.80}")
        return cls(strings("renamed"), strings("objects"), {k: tuple(p) for k, p in paths.items()})


@dataclass(frozen=True)
class View:
    """A stored step as DCP sees it: tensor keys -> step tensor names, bytes items -> where their bytes come from."""

    tensors: Mapping[str, str]  # DCP key -> tensor name in the step
    objects: Mapping[str, str]  # DCP key -> uint8 tensor name in the step
    made: Mapping[str, Any]  # DCP key -> a value flowcheck rebuilt from the step's JSON scalars (push steps)
    planner_data: Mapping[str, tuple]


@dataclass(frozen=True)
class PushKeys:
    """Where a pushed step's parts appear in the state dict given to ``dcp.load`` (the top-level keys)."""

    model: str = "model"
    optim: str = "optim"
    lr_scheduler: str = "lr_scheduler"


PUSH_KEYS = PushKeys()


def view_of(tensors: list[str], scalars: Mapping[str, Any], where: str, keys: PushKeys = PUSH_KEYS) -> View:
    """The DCP view of a step: from its index when ``flowcheck.dcp`` wrote it, else ``push_view``."""
    extra = scalars.get("extra") or {}
    if KEY in extra:
        index = DcpIndex.from_json(extra[KEY], where)
        unknown = sorted(set(index.objects) - set(tensors))
        if unknown:
            raise ManifestError(f"{where}: scalars.extra.{KEY}.objects names {unknown[:3]}, which the step does not hold")
        names = {index.key(n): n for n in tensors if n not in index.objects}
        return View(names, {k: n for n, k in index.objects.items()}, {}, index.planner_data)
    return push_view(tensors, scalars, keys)


def push_view(tensors: list[str], scalars: Mapping[str, Any], keys: PushKeys) -> View:
    """A pushed step (flowcheck/torch/state.py names) under ``get_state_dict``'s keys: ``<model>.<param>``,
    ``<optim>.state.<param>.<slot>``, each param group field as ``<optim>.param_groups.<i>.<field>``, each of the
    scheduler's as ``<lr_scheduler>.<field>``."""
    names: dict[str, str] = {}
    for name in tensors:
        if name.startswith(OPT):
            slot, param = name[len(OPT):].split(".", 1)
            names[f"{keys.optim}.state.{param}.{slot}"] = name
        else:
            names[f"{keys.model}.{name}"] = name
    made: dict[str, Any] = {}
    groups = ((scalars.get("optimizer") or {}).get("param_groups")) or []
    if not isinstance(groups, list):
        raise FlowcheckError("scalars.optimizer.param_groups: expected a list")
    for i, group in enumerate(groups):
        for k, v in group.items():  # JSON turned tuples into lists; torch's optimizers hold betas as a tuple
            made[f"{keys.optim}.param_groups.{i}.{k}"] = tuple(v) if k == "betas" and isinstance(v, list) else v
    for k, v in (scalars.get("lr_scheduler") or {}).items():
        made[f"{keys.lr_scheduler}.{k}"] = v
    return View(names, {}, made, {})
