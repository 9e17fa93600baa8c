"""Batched range reads: nearby ranges merged, every want served from the right bytes."""
from __future__ import annotations

import fsspec
import pytest

from flowcheck.errors import IntegrityError
from flowcheck.tiers.range_reads import Want, fetch, merge


def test_nearby_ranges_of_one_file_merge_and_far_ones_do_not():
    wants = [Want("a", 0, 10), Want("a", 12, 20), Want("b", 0, 5), Want("a", 100, 110), Want("a", 5, 5)]
    groups = merge(wants, max_gap=4, max_bytes=1000)
    assert [(g.path, g.start, g.end, sorted(g.members)) for g in groups] == [("a", 0, 20, [0, 1]), ("a", 100, 110, [3]), ("b", 0, 5, [2])]
    assert len(merge(wants, max_gap=4, max_bytes=15)) == 4  # the size cap splits the first pair


def test_fetch_returns_each_wants_bytes_and_names_a_truncated_file(tmp_path):
    data = bytes(range(256)) * 4
    (tmp_path / "f").write_bytes(data)
    fs = fsspec.filesystem("file")
    path = str(tmp_path / "f")
    wants = [Want(path, 10, 20), Want(path, 0, 4), Want(path, 900, 1024), Want(path, 7, 7)]
    got = [bytes(b) for b in fetch(fs, wants, max_gap=64)]
    assert got == [data[10:20], data[0:4], data[900:1024], b""]
    with pytest.raises(IntegrityError, match="truncated"):
        fetch(fs, [Want(path, 1000, 2000)])
