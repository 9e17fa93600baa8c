"""Batched range reads: nearby ranges merged, every want served from the right bytes."""
from __future__ import annotations

import fsspec
import numpy as np
import pytest

from flowcheck.errors import IntegrityError
from flowcheck.tiers.range_reads import Want, fetch, merge, read_stream, streams


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


def test_streams_join_following_ranges_cut_long_ones_and_read_each_want_whole(tmp_path):
    data = bytes(range(256)) * 4
    (tmp_path / "f").write_bytes(data)
    path = str(tmp_path / "f")
    wants = [Want(path, 100, 300), Want(path, 0, 40), Want(path, 40, 100), Want(path, 500, 500), Want(path, 900, 1024)]
    dests = [np.zeros(w.end - w.start, np.uint8) for w in wants]
    jobs = streams(wants, dests, 128)
    # 0-40 and 40-100 join (and 100-228 fills that stream to 128 bytes); the rest of 100-300 goes on in the next
    assert [[(i, at, v.nbytes) for i, at, v in pieces] for _, pieces in jobs] == [
        [(1, 0, 40), (2, 40, 60), (0, 100, 28)], [(0, 128, 128)], [(0, 256, 44)], [(3, 500, 0)], [(4, 900, 124)]]
    seen = []
    for p, pieces in jobs:
        read_stream(p, pieces, seen.append, block=16)
    assert sorted(seen) == [0, 0, 0, 1, 2, 3, 4]  # once per piece
    assert [bytes(d) for d in dests] == [data[w.start:w.end] for w in wants]
    with pytest.raises(IntegrityError, match="truncated"):
        read_stream(path, streams([Want(path, 1000, 2000)], [np.zeros(1000, np.uint8)], 1 << 20)[0][1], seen.append)
