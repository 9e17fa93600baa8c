"""flowcheck._native: the byte-moving helpers behave like their Python equivalents."""
from __future__ import annotations

import os

import numpy as np
import pytest

from flowcheck import _native


def test_pwrite_all_writes_every_byte_at_offset(tmp_path):
    data = np.random.default_rng(0).integers(0, 255, 5_000_000, dtype=np.uint8)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        assert _native.pwrite_all(fd, b"head", 0) == 4
        assert _native.pwrite_all(fd, data, 4, flush_every=1 << 20) == data.nbytes
    finally:
        os.close(fd)
    raw = path.read_bytes()
    assert raw[:4] == b"head" and raw[4:] == data.tobytes()


def test_pwrite_all_reports_errors_as_oserror(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError):
            _native.pwrite_all(fd, b"x", 0)
    finally:
        os.close(fd)


def test_pwrite_all_refuses_strided_buffers(tmp_path):
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(ValueError, match="contiguous"):
            _native.pwrite_all(fd, np.zeros((4, 4), np.float32)[:, ::2], 0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("n", [0, 1, 1000, 40 << 20])
def test_copy_into_copies_exactly(n):
    src = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)
    dst = np.empty_like(src)
    _native.copy_into(dst, src, threads=4)
    assert np.array_equal(dst, src)


def test_copy_into_checks_sizes():
    with pytest.raises(ValueError, match="bytes"):
        _native.copy_into(np.empty(3, np.uint8), np.empty(4, np.uint8))


@pytest.mark.parametrize("n", [0, 15, 64, 65535, 65536, 65536 + 77, (1 << 20) + 13, 40 << 20])
@pytest.mark.parametrize("shift", [0, 1, 8, 15])
def test_streaming_copy_is_exact_at_any_size_and_alignment(n, shift):
    """stream=True: non-temporal stores from the first 16-aligned destination byte, plain copies at both ends."""
    rng = np.random.default_rng(n + shift)
    src = rng.integers(0, 255, n + 3, dtype=np.uint8)[3:]
    guard = rng.integers(0, 255, n + 64, dtype=np.uint8)
    dst = guard.copy()
    _native.copy_into(dst[shift:shift + n], src, threads=2, stream=True)
    assert np.array_equal(dst[shift:shift + n], src)
    assert np.array_equal(dst[:shift], guard[:shift]) and np.array_equal(dst[shift + n:], guard[shift + n:])


def test_copy_into_refuses_a_strided_destination_or_source():
    with pytest.raises(ValueError, match="contiguous"):
        _native.copy_into(np.empty(200, np.uint8)[::2], np.empty(100, np.uint8), stream=True)
    with pytest.raises(ValueError, match="contiguous"):
        _native.copy_into(np.empty(100, np.uint8), np.empty(200, np.uint8)[::2])
