"""flowcheck for PyTorch trainers: state dicts <-> snapshots, and the push Checkpointer."""
from flowcheck.torch.state import (
    capture_rng,
    restore_rng,
    snapshot_from_torch,
    to_numpy,
    torch_state_from_snapshot,
)

__all__ = ["capture_rng", "restore_rng", "snapshot_from_torch", "to_numpy", "torch_state_from_snapshot"]


def __getattr__(name: str):
    if name in ("Checkpointer", "Coordinates", "PushConfig"):  # lazy: importing flowcheck.torch stays cheap
        from flowcheck.torch import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(name)
