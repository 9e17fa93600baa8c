"""tiers.safetensors_io: files any safetensors reader opens; headers parsed defensively."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

from flowcheck import dtypes
from flowcheck.digest import file_digest
from flowcheck.errors import FormatError
from flowcheck.tiers import safetensors_io as sio

Failed = pytest.fail.Exception  # what a 'DID NOT RAISE' raises
META = {"run": "r1", "step": "10", "manifest_id": "sha256:" + "0" * 64, "format": "flowcheck-v1"}


def sample_arrays() -> dict[str, tuple[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    return {
        "w#0": ("float32", rng.standard_normal((5, 7)).astype(np.float32)),
        "norm#0": ("bfloat16", rng.integers(0, 1 << 16, 9, dtype=np.uint16)),  # NaN payloads included
        "count#0": ("int64", np.array(123456789012, dtype=np.int64)),
        "empty#0": ("float32", np.zeros((0, 3), np.float32)),
        "half#0": ("float16", rng.standard_normal(4).astype(np.float16)),
        "f64#0": ("float64", rng.standard_normal((2, 2))),
        "i8#0": ("int8", np.arange(-3, 3, dtype=np.int8)),
        "mask#0": ("bool", np.array([True, False, True])),
    }


@pytest.fixture
def written(tmp_path):
    arrays = sample_arrays()
    path = str(tmp_path / "shard-00000-of-00001.safetensors")
    entries = [sio.Entry(k, dt, a.shape, lambda a=a: a) for k, (dt, a) in arrays.items()]
    size, digest = sio.write(path, entries, META)
    return path, arrays, size, digest


def torch_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_write_reports_the_file_size_and_digest(written):
    path, _arrays, size, digest = written
    assert (size, digest) == file_digest(path)
    assert size == os.path.getsize(path)


def test_files_load_with_safetensors_torch_bit_exactly(written):
    path, arrays, _size, _digest = written
    loaded = load_file(path)
    assert set(loaded) == set(arrays)
    for key, (dt, arr) in arrays.items():
        t = loaded[key]
        assert t.dtype == getattr(torch, dtypes.dtype(dt).torch), key
        assert tuple(t.shape) == arr.shape
        assert torch_bytes(t) == arr.tobytes(), key


def test_files_open_with_safe_open_metadata_and_slices(written):
    path, arrays, _size, _digest = written
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == META
        assert set(f.keys()) == set(arrays)
        for key, (_dt, arr) in arrays.items():
            assert torch_bytes(f.get_tensor(key)) == arr.tobytes()
        assert torch_bytes(f.get_slice("w#0")[1:4]) == arrays["w#0"][1][1:4].tobytes()


def test_parse_header_reads_back_what_write_wrote(written):
    path, arrays, size, _digest = written
    raw = open(path, "rb").read()
    header = sio.parse_header(lambda a, b: raw[a:b], size, path)
    assert header.metadata == META
    assert header.data_start % 8 == 0  # the header is padded to 8 bytes
    for key, (dt, arr) in arrays.items():
        info = header.tensors[key]
        assert (info.dtype, info.shape) == (dt, arr.shape)
        assert raw[header.data_start + info.begin: header.data_start + info.end] == arr.tobytes()


def test_write_refuses_data_of_the_wrong_size(tmp_path):
    entry = sio.Entry("x", "float32", (4,), lambda: np.zeros(3, np.float32))
    with pytest.raises(FormatError, match="x"):
        sio.write(str(tmp_path / "f.safetensors"), [entry], {})


# ---- parse_header on bad input ---------------------------------------------------------
def file_with(header, data: bytes = b"", declared: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if declared is None else declared) + raw + data


def parse(buf: bytes, size: int | None = None):
    return sio.parse_header(lambda a, b: buf[a:b], len(buf) if size is None else size, "f.safetensors")


def tensor(dtype="F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


BAD_FILES = {
    "shorter-than-8-bytes": b"\x01\x00",
    "huge-header-length": file_with({}, declared=1 << 63),
    "header-length-beyond-file": file_with({"x": tensor()}, b"\0" * 8, declared=500),
    "not-json": file_with(b"{not json}"),
    "not-utf8": file_with(b'{"\xff": 1}'),
    "json-array": file_with([1, 2]),
    "json-number": file_with(b"1234"),
    "overlapping-offsets": file_with({"a": tensor(offsets=(0, 8)), "b": tensor(offsets=(4, 12))}, b"\0" * 12),
    "contained-offsets": file_with({"a": tensor("U8", (8,), (0, 8)), "b": tensor("U8", (2,), (2, 4))}, b"\0" * 8),
    "offsets-beyond-file": file_with({"a": tensor(offsets=(8, 16))}, b"\0" * 8),
    "size-shape-mismatch": file_with({"a": tensor(shape=(3,))}, b"\0" * 8),
    "unknown-dtype": file_with({"a": tensor(dtype="C64")}, b"\0" * 8),
    "fp8-dtype": file_with({"a": tensor(dtype="F8_E4M3", shape=(8,))}, b"\0" * 8),
    "reversed-offsets": file_with({"a": tensor(offsets=(8, 0))}, b"\0" * 8),
    "negative-offset": file_with({"a": tensor(offsets=(-8, 0))}, b"\0" * 8),
    "float-offsets": file_with({"a": tensor(offsets=(0.0, 8.0))}, b"\0" * 8),
    "negative-dim": file_with({"a": tensor(shape=(-2,))}, b"\0" * 8),
    "shape-not-a-list": file_with({"a": {**tensor(), "shape": 2}}, b"\0" * 8),
    "tensor-not-an-object": file_with({"a": [1, 2]}),
    "metadata-not-strings": file_with({"__metadata__": {"step": 10}}),
    "metadata-not-an-object": file_with({"__metadata__": "run=r1"}),
}


@pytest.mark.parametrize("buf", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_parse_header_rejects_bad_files_with_format_error(buf):
    with pytest.raises(FormatError, match="f.safetensors|dtype"):
        parse(buf)


def test_parse_header_rejects_a_header_over_the_size_limit_before_reading_it():
    def read(a, b):
        assert b - a <= 8, "read the header body before checking its length"
        return struct.pack("<Q", sio.MAX_HEADER + 1)

    with pytest.raises(FormatError, match="100 MiB"):
        sio.parse_header(read, 1 << 40, "f.safetensors")


def test_an_unknown_dtype_error_names_the_file_and_tensor():
    with pytest.raises(FormatError, match=r"f\.safetensors.*'a'"):
        parse(file_with({"a": tensor(dtype="C64")}, b"\0" * 8))


def test_parse_header_rejects_a_deeply_nested_header():
    with pytest.raises(FormatError):
        parse(file_with(b"[" * 100_000))


@pytest.mark.parametrize(
    "header",
    [
        {"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}},
        {"a": {"dtype": "U8", "shape": [1], "data_offsets": [False, 1]}},
        {"__metadata__": []},
        {"__metadata__": False},
    ],
    ids=["bool-shape", "bool-offset", "metadata-list", "metadata-false"],
)
def test_parse_header_rejects_loosely_typed_fields(header):
    with pytest.raises(FormatError):
        parse(file_with(header, b"\0"))


# ---- fuzzing -------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
tensor_like = st.fixed_dictionaries(
    {"dtype": st.sampled_from(["F32", "BF16", "I64", "U8", "BOOL", "F8_E5M2", "x"]) | json_values,
     "shape": st.lists(st.integers(-2, 6), max_size=3) | json_values,
     "data_offsets": st.lists(st.integers(-4, 80), min_size=2, max_size=2) | json_values},
)
headers = st.dictionaries(st.text(max_size=6), tensor_like | json_values, max_size=4) | json_values


def only_format_errors(buf: bytes, size: int | None = None) -> None:
    try:
        parse(buf, size)
    except FormatError:
        pass


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_random_bytes_raise_only_format_error(buf):
    only_format_errors(buf)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200), st.binary(max_size=64), st.integers(-8, 8))
def test_random_header_bodies_raise_only_format_error(body, data, skew):
    buf = file_with(body, data, declared=max(0, len(body) + skew))
    only_format_errors(buf)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers, st.binary(max_size=64))
def test_random_json_headers_raise_only_format_error(header, data):
    only_format_errors(file_with(json.dumps(header, allow_nan=True).encode(), data))
