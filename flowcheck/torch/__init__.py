"""flowcheck for PyTorch trainers: state dicts <-> snapshots (the push checkpointer builds on this)."""
from flowcheck.torch.state import (
    capture_rng,
    restore_rng,
    snapshot_from_torch,
    to_numpy,
    torch_state_from_snapshot,
)

__all__ = ["capture_rng", "restore_rng", "snapshot_from_torch", "to_numpy", "torch_state_from_snapshot"]
