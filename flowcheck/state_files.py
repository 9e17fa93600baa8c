"""Read a trainer's saved state file (safetensors, or torch with weights_only) into a Snapshot."""
from __future__ import annotations

from flowcheck.errors import FormatError
from flowcheck.state import Snapshot


def load_state_file(path: str, run: str, step: int) -> Snapshot:
    """A snapshot of a state file; torch files are read with ``weights_only=True`` (never unpickled freely)."""
    from flowcheck.torch import snapshot_from_torch

    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        try:
            return snapshot_from_torch(run, step, load_file(path), rng=False, source="import")
        except Exception as e:  # safetensors raises its own error type for a damaged file
            raise FormatError(f"{path}: not a readable safetensors file ({e})") from e
    from flowcheck.restore.unpickle import load_pt

    # one loader for every torch file flowcheck reads: an unsafe global is named on one line, never run
    obj = load_pt(path, path, hint="save the state as tensors only (or as .safetensors) and snapshot that")
    if not isinstance(obj, dict):
        raise FormatError(f"{path}: expected a state_dict (a dict of tensors) or {{'model', 'optimizer'}}, found {type(obj).__name__}")
    if "model" in obj and isinstance(obj["model"], dict):
        return snapshot_from_torch(run, step, obj["model"], obj.get("optimizer"), rng=False, source="import")
    return snapshot_from_torch(run, step, obj, rng=False, source="import")
