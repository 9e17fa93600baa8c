"""DTensor state (FSDP2, tensor parallel): what one rank pushes of it — its local shard, as a box of the global tensor.

An FSDP2 / DTensor trainer's state dict holds DTensors: each rank owns a piece (``to_local()``) at an offset of
the global tensor that ``compute_local_shape_and_global_offset`` gives (DCP uses it the same way), so the rank
sends that piece as a shard in the canonical global index space.  A placement ``Replicate()`` on a mesh dimension
means the ranks along it hold the same piece: only the one at coordinate 0 sends it (as data-parallel replicas of
plain tensors are sent once, by the Checkpointer's razor).  ``Partial()`` is a pending reduction, not state: refused.
"""
from __future__ import annotations

from typing import Any

import torch

from flowcheck import dtypes
from flowcheck.errors import ConfigError


def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor holds none
        return False
    return isinstance(t, DTensor)


def local_box(name: str, t: Any) -> tuple[list[int], tuple[int, ...]] | None:
    """(global offsets, shape) of this rank's piece of DTensor ``t``; None when another rank sends the same piece."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, t.placements
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None  # this rank is not in the tensor's mesh: it holds nothing of it
    for dim, p in enumerate(placements):
        if p.is_partial():
            raise ConfigError(f"Checkpointer: {name} is a DTensor with a Partial placement on mesh dimension {dim} "
                              "(a reduction still pending); push after the optimizer step, when the state is whole")
        if p.is_replicate() and coordinate[dim] != 0:
            return None
    shape, offsets = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    local = tuple(t.to_local().shape)
    if tuple(shape) != local:
        raise ConfigError(f"Checkpointer: {name}: the DTensor's local piece has shape {list(local)}, its placements "
                          f"{placements} say {list(shape)}; is it a strided or custom sharding flowcheck cannot place?")
    return [int(o) for o in offsets], local


def _local(t: Any) -> torch.Tensor:
    return t.to_local()


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


def cut(tensors: dict[str, Any]) -> tuple[list[dict], list[tuple], list[tuple]]:
    """(specs of every tensor, whole plain tensors DP replicas share, this rank's own DTensor pieces) — each piece
    as ``(name, global offsets, local key, view)``, as the Checkpointer's plan takes them."""
    specs, shared, own = [], [], []
    for name, t in sorted(tensors.items()):
        specs.append({"name": name, "dtype": dtypes.from_torch(t.dtype).name, "shape": list(t.shape),
                      "role": "replicated"})
        if not is_dtensor(t):
            shared.append((name, [0] * t.dim(), name, _whole))
            continue
        box = local_box(name, t)
        if box is not None and 0 not in box[1]:  # an empty piece (uneven sharding) adds nothing
            own.append((name, box[0], name, _local))
    return specs, shared, own
