"""The object tier on S3 (a moto server) reads a stored file it wants (nearly) all of with one GET, its header
parsed from the front of that body: no stat and no separate header read (moto reads a whole object for every
ranged GET).  A forged header is refused with the same error as when the header is read on its own."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from flowcheck.errors import FormatError
from tests.conftest import bucket_on
from tests.dcp.test_dcp_fsdp import config
from tests.dcp.test_dcp_object_reads import _buffers, _stored
from tests.dcp.test_dcp_single import save, state

pytestmark = pytest.mark.s3


@pytest.fixture
def cfg(request, tmp_path):
    return config(str(tmp_path), bucket_on(request, "moto"))


def _record_gets(tier) -> list[tuple[str, str | None]]:
    """(key, range) of every GetObject the tier's boto3 client sends from now on."""
    seen: list[tuple[str, str | None]] = []
    tier.boto3_client().meta.events.register(
        "provide-client-params.s3.GetObject", lambda params, **kw: seen.append((params["Key"], params.get("Range"))))
    return seen


def test_a_read_of_whole_files_gets_each_file_once_with_its_header(cfg, monkeypatch):
    save(cfg, state(3), 3, tier="object")
    tier, m, items = _stored(cfg, 3)
    gets = _record_gets(tier)
    other = []  # reads through s3fs: a stat or a header read
    for name in ("cat_file", "size", "info"):
        real = getattr(tier.fs, name)
        monkeypatch.setattr(tier.fs, name,
                            lambda *a, _real=real, _name=name, **kw: other.append(_name) or _real(*a, **kw))
    into = _buffers(m, items)
    tier.read_shards_into(m, items, into)
    assert other == []
    assert sorted(gets) == sorted((tier.piece_path(m, p).split("/", 1)[1], f"bytes=0-{f.bytes - 1}")
                                  for f in m.files for p in [_piece_in(items, f.path)])
    fresh, _, _ = _stored(cfg, 3)  # read the usual way: header on its own, then ranges
    for (name, entry), got in zip(items, into):
        want = np.ascontiguousarray(fresh.read_shard(m, name, entry)).reshape(-1).view(np.uint8)
        assert np.array_equal(got, want)


def _piece_in(items, path: str):
    return next(p for _, e in items for p in e.location if p.path == path)


def _forge_shape(raw: bytes, key: str) -> bytes:
    """The file with tensor ``key``'s shape reversed in its header (same byte count: it still parses)."""
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header[key]["shape"] = header[key]["shape"][::-1]
    forged = json.dumps(header, separators=(",", ":")).encode()
    assert len(forged) <= n
    return raw[:8] + forged.ljust(n) + raw[8 + n:]


def _forge_length(raw: bytes, key: str) -> bytes:
    return struct.pack("<Q", 200 << 20) + raw[8:]


@pytest.mark.parametrize("forge", [_forge_shape, _forge_length])
def test_a_forged_header_is_refused_as_when_the_header_is_read_on_its_own(cfg, forge):
    save(cfg, state(3), 3, tier="object")
    tier, m, items = _stored(cfg, 3)
    name, entry = next((n, e) for n, e in items if tuple(e.shape) == (6, 4))
    piece = entry.location[0]
    path = tier.piece_path(m, piece)
    tier.fs.pipe_file(path, forge(tier.fs.cat_file(path), piece.key))
    gets = _record_gets(tier)
    with pytest.raises(FormatError) as whole:
        tier.read_shards_into(m, items, _buffers(m, items))
    assert (path.split("/", 1)[1], f"bytes=0-{_size(m, piece.path) - 1}") in gets  # read by one GET
    alone, _, _ = _stored(cfg, 3)  # a fresh tier: the header read by itself (stat, then a ranged read)
    with pytest.raises(FormatError) as ranged:
        alone.read_shard(m, name, entry)
    assert str(whole.value) == str(ranged.value)
    assert "expected" in str(whole.value) or "exceeds" in str(whole.value)


def _size(m, rel: str) -> int:
    return next(f.bytes for f in m.files if f.path == rel)
