"""Compare a stored step with a reference safetensors file, tensor by tensor, bit for bit."""
from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass

import numpy as np

from flowcheck.errors import FormatError
from flowcheck.manifest import Manifest
from flowcheck.restore.assemble import assemble_tensor
from flowcheck.tiers.base import Tier

_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


@dataclass(frozen=True)
class TensorDiff:
    name: str
    status: str  # equal | different | only-stored | only-reference | shape | dtype
    elements: int = 0
    differing: int = 0
    max_abs_diff: float | None = None
    detail: str = ""


def diff_step(tier: Tier, manifest: Manifest, reference: str) -> list[TensorDiff]:
    """Every tensor of the step and of the reference file: bit-exact or not, and by how much."""
    from safetensors import safe_open

    check_header(reference)
    out = []
    with safe_open(reference, framework="pt") as f:
        ref_names = set(f.keys())
        for name in sorted(set(manifest.tensors) | ref_names):
            if name not in ref_names:
                out.append(TensorDiff(name, "only-stored"))
            elif name not in manifest.tensors:
                out.append(TensorDiff(name, "only-reference"))
            else:
                out.append(_compare(name, assemble_tensor(tier, manifest, name), manifest.tensors[name].dtype, f.get_tensor(name)))
    return out


def _compare(name: str, stored: np.ndarray, dtype: str, ref) -> TensorDiff:
    import torch

    from flowcheck.torch.state import from_numpy

    mine = from_numpy(stored if stored.flags.c_contiguous else stored.copy(), dtype)  # ascontiguousarray makes 0-d 1-d
    if tuple(mine.shape) != tuple(ref.shape):
        return TensorDiff(name, "shape", mine.numel(), detail=f"stored {tuple(mine.shape)}, reference {tuple(ref.shape)}")
    if mine.dtype != ref.dtype:
        return TensorDiff(name, "dtype", mine.numel(), detail=f"stored {mine.dtype}, reference {ref.dtype}")
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[mine.element_size()]
    a, b = mine.reshape(-1).view(bits), ref.reshape(-1).view(bits)
    differing = int((a != b).sum())
    if not differing:
        return TensorDiff(name, "equal", mine.numel(), 0, 0.0)
    gap = (mine.to(torch.float64) - ref.to(torch.float64)).abs()
    return TensorDiff(name, "different", mine.numel(), differing, float(gap.nan_to_num(float("inf")).max()))


def check_header(path: str) -> None:
    """Refuse a file that is not safetensors before a library allocates what its header claims."""
    import os

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FormatError(f"{path}: expected a safetensors file (8-byte header length), found {size} bytes")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise FormatError(f"{path}: safetensors header claims {n} bytes but the file has {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise FormatError(f"{path}: safetensors header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise FormatError(f"{path}: safetensors header is not a JSON object")
    for name, entry in header.items():
        if name != "__metadata__" and (not isinstance(entry, dict) or entry.get("dtype") not in _ST_DTYPES):
            raise FormatError(f"{path}: tensor {name!r}: unsupported or missing dtype in the header")


def report(diffs: list[TensorDiff]) -> dict:
    counts: dict[str, int] = {}
    for d in diffs:
        counts[d.status] = counts.get(d.status, 0) + 1
    return {"bit_exact": all(d.status == "equal" for d in diffs), "counts": counts, "tensors": [asdict(d) for d in diffs]}
