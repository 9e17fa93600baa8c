"""Read a trainer's saved state file (safetensors, or torch with weights_only) into a Snapshot."""
from __future__ import annotations

import logging
import os
from typing import Any

from flowcheck.errors import FormatError
from flowcheck.state import Snapshot

log = logging.getLogger(__name__)

SOURCE = "snapshot"  # the manifest's producer.source for `flowcheck snapshot` (import is `flowcheck import`)
_EXPECTED = "a torch.save file (zip archive) of a state_dict, or a .safetensors file"


def load_snapshot_file(path: str, run: str, step: int) -> Snapshot:
    """A snapshot of a state file; torch files are read with ``weights_only=True`` (never unpickled freely).

    Non-tensor entries that JSON can hold (numbers, strings, lists and dicts of them: an ``iteration``, a
    ``config``) are kept in ``scalars.extra``; anything else is named in a warning, never dropped silently.  A
    safetensors file's model description in ``__metadata__`` (Megatron argument names, as `flowcheck export`
    writes it) is kept as `import` keeps it, so `flowcheck restore` can reshard the step.
    """
    _check_kind(path)
    if path.endswith(".safetensors"):
        return _from_safetensors(path, run, step)
    from flowcheck.restore.unpickle import load_pt
    from flowcheck.torch import snapshot_from_torch

    # one loader for every torch file flowcheck reads: an unsafe global is named on one line, never run
    obj = load_pt(path, path, hint="save the state as tensors only (or as .safetensors) and snapshot that")
    if not isinstance(obj, dict):
        raise FormatError(f"{path}: expected a state_dict (a dict of tensors) or {{'model', 'optimizer'}}, found {type(obj).__name__}")
    model, optimizer, rest = (obj["model"], obj.get("optimizer"), _without(obj, "model", "optimizer")) \
        if isinstance(obj.get("model"), dict) else (obj, None, {})
    extra = _scalars(path, {**_non_tensors(model), **rest})
    return snapshot_from_torch(run, step, _tensors(model), optimizer, rng=False, extra=extra, source=SOURCE)


def _check_kind(path: str) -> None:
    """An empty or text file gets a one-line answer naming what was expected, not a loader's own advice."""
    with open(path, "rb") as f:
        head = f.read(8)
    if not head:
        raise FormatError(f"{path}: expected {_EXPECTED}, found an empty file (0 bytes)")
    if path.endswith(".safetensors") or head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return  # safetensors (checked by its reader), torch's zip format, or torch's legacy pickle format
    kind = "a text file" if _is_text(path) else f"an unknown binary format (first bytes {head.hex()})"
    raise FormatError(f"{path}: expected {_EXPECTED}, found {kind} ({os.path.getsize(path)} bytes)")


def _is_text(path: str) -> bool:
    with open(path, "rb") as f:
        sample = f.read(4096)
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return b"\x00" not in sample


def _from_safetensors(path: str, run: str, step: int) -> Snapshot:
    from safetensors import safe_open

    from flowcheck.restore.arch import arch_from_metadata
    from flowcheck.restore.source import MODEL_KEY
    from flowcheck.torch import snapshot_from_torch

    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error type for a damaged file
        raise FormatError(f"{path}: not a readable safetensors file ({e})") from e
    arch = arch_from_metadata(meta, f"{path} __metadata__")
    extra = {MODEL_KEY: arch.to_json()} if arch is not None else {}
    return snapshot_from_torch(run, step, tensors, rng=False, extra=extra, source=SOURCE)


def _tensors(d: dict) -> dict:
    import torch

    return {k: v for k, v in d.items() if isinstance(v, torch.Tensor)}


def _non_tensors(d: dict) -> dict:
    import torch

    return {k: v for k, v in d.items() if not isinstance(v, torch.Tensor)}


def _without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def _scalars(path: str, entries: dict[str, Any]) -> dict[str, Any]:
    """The entries a manifest's scalars can hold; the rest named in one warning."""
    kept, dropped = {}, []
    for key, value in entries.items():
        if _json_plain(value):
            kept[str(key)] = value
        else:
            dropped.append(f"{key} ({type(value).__name__})")
    if dropped:
        log.warning("%s: not stored (neither a tensor nor a JSON scalar): %s", path, ", ".join(dropped))
    return kept


def _json_plain(value: Any, depth: int = 0) -> bool:
    if depth > 16:
        return False
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))  # JSON has no NaN/inf
    if isinstance(value, (list, tuple)):
        return all(_json_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_plain(v, depth + 1) for k, v in value.items())
    return False
