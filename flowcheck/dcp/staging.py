"""What ``dcp.async_save`` blocks on with a ``flowcheck.dcp.Writer``: the copy of the state into CPU memory.

DCP stages a writer that is not an ``AsyncStager`` with its ``DefaultStager``, which allocates a new CPU copy of the
whole state on every save; faulting those pages in costs more than the copy itself (270 MB on one core: 0.11 s fresh,
0.04 s into memory already touched).  The Writer stages itself instead, into the CPU copy the previous save of the
same run and tier used, when that copy is free: its save's ``write_data`` has stored it on this rank.  A copy still
being written (an ``async_save`` started before the previous one finished) is never reused — the new save gets a new
copy, which the next save reuses — so a save never sees another save's bytes.  A state of another structure (a key,
shape, dtype or placement changed) gets a new copy too.  The memory held between saves is one CPU copy of the rank's
state, what every ``async_save`` allocates anyway; ``Writer(reuse_staging=False)`` stages a fresh copy each time.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.tensor import DTensor


@dataclass(eq=False)
class Staged:
    """One CPU copy of a state's tensors: ``state`` mirrors the staged state dict; ``busy`` while a save holds it."""

    signature: tuple = field(repr=False)
    state: dict[str, Any] = field(repr=False)
    busy: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def release(self) -> None:
        with self.lock:
            self.busy = False


_LOCK = threading.Lock()
_LATEST: dict[tuple, Staged] = {}  # (run, tier) -> the copy its last async save staged into


def stage(state_dict: dict[str, Any], key: tuple | None) -> tuple[dict[str, Any], Staged]:
    """A CPU copy of ``state_dict`` (tensors copied, other values as they are: DCP's own staging semantics) and the
    ``Staged`` copy it lives in, busy until its save calls ``release``; ``key`` None: a fresh copy, kept by no one."""
    sig = signature(state_dict)
    if key is None:
        held = Staged(sig, _create_cpu_state_dict(state_dict))
        return _copy_state_dict(state_dict, held.state, type_check=False), held
    with _LOCK:
        held = _LATEST.get(key)
        if held is not None:
            with held.lock:
                reuse = not held.busy and held.signature == sig
                if reuse:
                    held.busy = True
        if held is None or not reuse:
            held = _LATEST[key] = Staged(sig, _create_cpu_state_dict(state_dict))
    try:
        return _copy_state_dict(state_dict, held.state, type_check=False), held
    except BaseException:
        held.release()
        raise


def forget(key: tuple) -> None:
    """Drop the copy kept for ``key`` (a test's, or a trainer's that will not save again)."""
    with _LOCK:
        _LATEST.pop(key, None)


def signature(obj: Any) -> tuple:
    """What a staged copy must match to be reused: every tensor's path, kind, dtype, shape, local shape and layout."""
    out: list[tuple] = []
    _walk(obj, (), out)
    return tuple(out)


def _walk(obj: Any, path: tuple, out: list[tuple]) -> None:
    if isinstance(obj, DTensor):
        out.append((path, "dtensor", obj.dtype, tuple(obj.shape), tuple(obj.to_local().shape), str(obj.placements),
                    obj.device_mesh))
    elif isinstance(obj, torch.Tensor):
        out.append((path, "tensor", obj.dtype, tuple(obj.shape)))
    elif isinstance(obj, dict):
        out.append((path, "dict", tuple(sorted(map(str, obj)))))
        for k, v in obj.items():
            _walk(v, (*path, k), out)
    elif isinstance(obj, (list, tuple)):
        out.append((path, type(obj).__name__, len(obj)))
        for i, v in enumerate(obj):
            _walk(v, (*path, i), out)
