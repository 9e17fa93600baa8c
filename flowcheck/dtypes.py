"""The dtypes flowcheck stores, and how each maps to numpy, safetensors and torch.

numpy has no bfloat16, so bf16 data travels as its raw 16-bit pattern in a
uint16 array; the dtype name in the manifest (``bfloat16``) says what it is.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flowcheck.errors import FormatError


@dataclass(frozen=True)
class DType:
    name: str  # manifest name
    storage: str  # numpy dtype used to hold the bytes
    safetensors: str  # safetensors header code
    torch: str  # attribute of the torch module

    @property
    def itemsize(self) -> int:
        return np.dtype(self.storage).itemsize


_DTYPES = [
    DType("float64", "float64", "F64", "float64"),
    DType("float32", "float32", "F32", "float32"),
    DType("float16", "float16", "F16", "float16"),
    DType("bfloat16", "uint16", "BF16", "bfloat16"),
    DType("int64", "int64", "I64", "int64"),
    DType("int32", "int32", "I32", "int32"),
    DType("int16", "int16", "I16", "int16"),
    DType("int8", "int8", "I8", "int8"),
    DType("uint16", "uint16", "U16", "uint16"),
    DType("uint8", "uint8", "U8", "uint8"),
    DType("bool", "bool", "BOOL", "bool"),
]
BY_NAME = {d.name: d for d in _DTYPES}
BY_SAFETENSORS = {d.safetensors: d for d in _DTYPES}
BY_TORCH = {d.torch: d for d in _DTYPES}


def dtype(name: str) -> DType:
    """Look up a dtype by manifest name (``float32``, ``bfloat16``, ...)."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise FormatError(f"unknown dtype {name!r}; expected one of {sorted(BY_NAME)}") from None


def from_safetensors(code: str) -> DType:
    try:
        return BY_SAFETENSORS[code]
    except KeyError:
        raise FormatError(
            f"unsupported safetensors dtype {code!r}; expected one of {sorted(BY_SAFETENSORS)}"
        ) from None


def from_torch(torch_dtype) -> DType:
    """Map a ``torch.dtype`` (e.g. ``torch.bfloat16``) to its DType."""
    key = str(torch_dtype).removeprefix("torch.")
    try:
        return BY_TORCH[key]
    except KeyError:
        raise FormatError(f"unsupported torch dtype {key!r}; expected one of {sorted(BY_TORCH)}") from None


def from_numpy(np_dtype) -> DType:
    """Map a numpy dtype to its DType (uint16 maps to bfloat16 only via manifests)."""
    key = np.dtype(np_dtype).name
    for d in _DTYPES:
        if d.storage == key and d.name == key:
            return d
    raise FormatError(f"unsupported numpy dtype {key!r}")
