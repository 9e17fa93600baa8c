"""Regions of a tensor (tuples of contiguous slices) and buffers sized by what a manifest describes."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from flowcheck import dtypes
from flowcheck.errors import RegionError, TooLargeError


def full_region(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def normalize_region(region: Any, shape: tuple[int, ...], name: str) -> tuple[slice, ...]:
    """Turn None / a tuple of slices (steps of 1) into bounded slices within ``shape``."""
    if region is None:
        return full_region(shape)
    if not isinstance(region, tuple):
        region = (region,)
    if len(region) > len(shape):
        raise RegionError(f"{name}: expected a region of at most {len(shape)} dimensions (the tensor's shape is "
                          f"{list(shape)}), found {len(region)}")
    out = []
    for sl, n in zip(region + (slice(None),) * (len(shape) - len(region)), shape):
        if not isinstance(sl, slice) or sl.step not in (None, 1):
            raise RegionError(f"{name}: expected a region of contiguous slices (step 1), found {sl!r}")
        start, stop, _ = sl.indices(n)
        out.append(slice(start, max(start, stop)))
    return tuple(out)


def allocate(shape: tuple[int, ...], dtype: str, what: str, *, zeroed: bool = False) -> np.ndarray:
    """``np.empty`` (``np.zeros``) for a tensor a manifest describes: a size this machine cannot hold (a genuine
    giant, or a forged manifest) is a TooLargeError naming it, never a bare MemoryError."""
    try:
        return (np.zeros if zeroed else np.empty)(shape, dtype=dtypes.dtype(dtype).storage)
    except MemoryError as e:
        raise too_large(what, shape, dtype) from e


def too_large(what: str, shape: tuple[int, ...], dtype: str) -> TooLargeError:
    nbytes = math.prod(shape) * dtypes.dtype(dtype).itemsize
    return TooLargeError(
        f"{what}: cannot allocate {nbytes:,} bytes for {dtype}{list(shape)}: expected a tensor that fits in this "
        "machine's memory, found one that does not; if the step is genuine read it on a larger machine (or by "
        "regions), else its manifest was forged — `flowcheck audit` checks it"
    )
