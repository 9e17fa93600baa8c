"""The packed layout's pieces: the native checksum, digest, writer and reader, the zarr.json templates, the plan."""
from __future__ import annotations

import dataclasses
import json
import os

import google_crc32c
import numpy as np
import pytest
import xxhash
import zarr
from zarr.codecs import Crc32cCodec

from flowcheck import _native, dtypes
from flowcheck.config import LocalConfig
from flowcheck.errors import IntegrityError
from flowcheck.state import Scalars, Shard, Snapshot, StateLayout, TensorSpec
from flowcheck.tiers import zarr_pack
from flowcheck.tiers.local import LocalTier
from flowcheck.tiers.zarr_shard import array_json, group_json
from tests.helpers import make_snapshot
from tests.tiers.test_plain_readers import every_case_snapshot

RNG = np.random.default_rng(18)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 255, 256, 257, 8191, 8192, 24576, 24577, 100_003, 3 * 8192 * 5 + 13])
def test_native_crc32c_and_xxh3_match_the_reference_libraries(n):
    data = RNG.integers(0, 256, n + 3, dtype=np.uint8)
    for off in (0, 1, 3):
        view = data[off:off + n]
        assert _native.crc32c(view) == google_crc32c.value(view.tobytes())
        assert _native.crc32c(view, 12345) == google_crc32c.extend(12345, view.tobytes())
        assert _native.xxh3_128(view) == xxhash.xxh3_128(view.tobytes()).hexdigest()


def _write(path: str, pieces: list[np.ndarray], chunk: int, flush_every: int = 1 << 20, bound_dirty: bool = False
           ) -> tuple[list[str], int, str]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        w = _native.ChunkWriter(fd, chunk, flush_every, bound_dirty)
        digests = [w.write(p) for p in pieces]
        size, digest = w.finish()
    finally:
        os.close(fd)
    return digests, size, digest


@pytest.mark.parametrize("length, chunk_elems", [(1000, 100), (1001, 100), (5, 64), (70_000, 16_384)])
def test_the_chunk_writer_streams_the_shard_file_zarr_writes(tmp_path, length, chunk_elems):
    arr = (RNG.random(length) * 1000 + 1).astype(np.float32)  # no all-zero chunk (zarr would leave it out)
    z = zarr.open_group(str(tmp_path / "ref"), mode="w").create_array(
        "a", shape=(length,), dtype="float32", chunks=(chunk_elems,), shards=(-(-length // chunk_elems) * chunk_elems,),
        compressors=[Crc32cCodec()], fill_value=0)
    z[...] = arr
    reference = (tmp_path / "ref" / "a" / "c" / "0").read_bytes()
    flat = arr.view(np.uint8)
    cuts = sorted({0, flat.nbytes, *RNG.integers(0, flat.nbytes, 4).tolist()})  # pieces across chunk boundaries
    pieces = [flat[a:b] for a, b in zip(cuts, cuts[1:])]
    digests, size, digest = _write(str(tmp_path / "mine"), pieces, chunk_elems * 4)
    mine = (tmp_path / "mine").read_bytes()
    assert mine == reference and size == len(mine) and digest == xxhash.xxh3_128(mine).hexdigest()
    assert digests == [xxhash.xxh3_128(p.tobytes()).hexdigest() for p in pieces]


def test_streaming_with_bounded_dirty_pages_writes_the_same_file(tmp_path):
    """A step larger than the kernel's dirty limit is written waiting for each window's write-back: same bytes."""
    flat = RNG.integers(0, 256, (3 << 20) + 12345, dtype=np.uint8)
    pieces = [flat[:1000], flat[1000:(2 << 20) + 7], flat[(2 << 20) + 7:]]
    free = _write(str(tmp_path / "free"), pieces, 1 << 16, flush_every=1 << 16)
    bounded = _write(str(tmp_path / "bounded"), pieces, 1 << 16, flush_every=1 << 16, bound_dirty=True)
    assert free == bounded and (tmp_path / "free").read_bytes() == (tmp_path / "bounded").read_bytes()


def test_a_step_past_twice_the_dirty_limit_is_streamed_and_reads_back(tmp_path, monkeypatch):
    from flowcheck.tiers import durable

    seen = []
    real = _native.ChunkWriter
    monkeypatch.setattr(durable, "dirty_limit", lambda: 1 << 16)
    monkeypatch.setattr(zarr_pack._native, "ChunkWriter", lambda fd, c, f, bound: seen.append(bound) or real(fd, c, f, bound))
    specs = tuple(TensorSpec(f"t{i}", "float32", (256, 64)) for i in range(4))
    data = {Shard.whole(s): RNG.random(s.shape).astype(np.float32) for s in specs}
    snap = Snapshot("r", 1, StateLayout(specs), data, Scalars(optimizer_step=1))
    tier = LocalTier(LocalConfig(root=str(tmp_path)), run="r")
    tier.write(snap)
    assert seen and all(seen)
    for s, arr in data.items():
        assert np.array_equal(tier.read(1, s.tensor), arr)


def test_read_chunks_reads_any_range_on_any_number_of_threads(tmp_path):
    flat = RNG.integers(0, 256, 40 << 20, dtype=np.uint8)
    _write(str(tmp_path / "f"), [flat], 1 << 16)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        for begin, end in [(0, flat.nbytes), (5, 17), ((1 << 16) - 3, (1 << 16) + 5), (123_457, flat.nbytes - 99)]:
            for threads in (1, 3, 8):
                out = np.empty(end - begin, np.uint8)
                got = _native.read_chunks(fd, out, begin, 1 << 16, threads)
                assert np.array_equal(out, flat[begin:end])
                assert got == xxhash.xxh3_128(flat[begin:end].tobytes()).hexdigest()
    finally:
        os.close(fd)


@pytest.mark.parametrize("threads", [1, 4])
def test_read_chunks_names_a_flipped_bit_and_a_truncated_file(tmp_path, threads):
    flat = RNG.integers(0, 256, 33 << 20, dtype=np.uint8)
    _write(str(tmp_path / "f"), [flat], 1 << 16)
    data = bytearray((tmp_path / "f").read_bytes())
    chunk = 300
    data[chunk * ((1 << 16) + 4) + 1234] ^= 0x10
    (tmp_path / "bad").write_bytes(bytes(data))
    (tmp_path / "short").write_bytes(bytes(data[:len(data) // 2]))
    for name, match in (("bad", f"chunk {chunk} fails its CRC32C"), ("short", "truncated")):
        fd = os.open(tmp_path / name, os.O_RDONLY)
        try:
            with pytest.raises(ValueError, match=match):
                _native.read_chunks(fd, np.empty(flat.nbytes, np.uint8), 0, 1 << 16, threads)
        finally:
            os.close(fd)


@pytest.mark.parametrize("dtype", ["float32", "uint16", "bool", "int8", "float64", "int64", "float16", "uint8", "int32"])
@pytest.mark.parametrize("shape, chunks, shards", [((1000,), (100,), (1000,)), ((7,), (3,), (9,)), ((0,), (1,), (1,)),
                                                   ((10, 7), (3, 7), (12, 7))])
def test_zarr_json_from_the_template_is_byte_identical_to_zarrs(tmp_path, dtype, shape, chunks, shards):
    attrs = {"flowcheck": {"layout": "packed", "é": [1, 2.5]}}
    zarr.open_group(str(tmp_path), mode="w").create_array(
        "a", shape=shape, dtype=dtype, chunks=chunks, shards=shards, compressors=[Crc32cCodec()], fill_value=0,
        attributes=attrs)
    assert array_json(shape, dtype, chunks, shards, attrs) == (tmp_path / "a" / "zarr.json").read_bytes()


def test_group_zarr_json_is_byte_identical_to_zarrs(tmp_path):
    attrs = {"flowcheck": {"run": "r", "step": 3, "tensors": {"a": [{"start": 0, "shape": [2]}]}}}
    zarr.create_group(str(tmp_path / "g"), attributes=attrs)
    assert group_json(attrs) == (tmp_path / "g" / "zarr.json").read_bytes()


def test_the_plan_packs_by_dtype_in_snapshot_order_and_gives_a_large_shard_its_own_pack(monkeypatch):
    monkeypatch.setattr(zarr_pack, "PACK_MIN", 40_000)
    monkeypatch.setattr(zarr_pack, "PACK_MAX", 40_000)
    snap = every_case_snapshot()
    packs = zarr_pack.plan(snap, workers=4)
    for p in packs:
        assert {dtypes.dtype(snap.layout.spec(m.shard.tensor).dtype).storage for m in p.members} == {p.storage}
        starts = [m.start for m in p.members]
        assert starts == sorted(starts) and starts[0] == 0
        assert p.length * np.dtype(p.storage).itemsize <= 40_000 or len(p.members) == 1
    big = [p for p in packs if any(m.shard.tensor == "decoder.layers.1.big" for m in p.members)]
    assert len(big) == 1 and len(big[0].members) == 1
    position = {s: i for i, s in enumerate(snap.data)}
    for storage in {p.storage for p in packs}:  # each dtype's shards, pack after pack, keep the snapshot's order
        shards = [m.shard for p in packs if p.storage == storage for m in p.members]
        assert shards == sorted(shards, key=position.__getitem__)
    order = [m.shard for p in packs for m in p.members]
    assert sorted(order, key=position.__getitem__) == list(snap.data)


def _step(tmp_path):
    tier = LocalTier(LocalConfig(root=str(tmp_path)), "r1")
    m = tier.write(make_snapshot())
    return tier, m, tmp_path / "r1" / "step-000000010"


def test_a_pack_whose_index_was_rewritten_is_an_integrity_error(tmp_path):
    tier, m, step = _step(tmp_path)
    path = step / "packs" / "0" / "c" / "0"
    data = bytearray(path.read_bytes())
    data[-12] ^= 1  # the index (its CRC32C no longer matches)
    path.write_bytes(bytes(data))
    fresh = LocalTier(LocalConfig(root=str(tmp_path)), "r1")
    name = next(n for n, t in m.tensors.items() if t.shards and t.shards[0].location[0].path.endswith("packs/0"))
    with pytest.raises(IntegrityError, match="shard index"):
        fresh.read(10, name)


def test_a_pack_of_another_dtype_than_the_manifest_says_is_an_integrity_error(tmp_path):
    tier, m, step = _step(tmp_path)
    meta = step / "packs" / "0" / "zarr.json"
    meta.write_bytes(meta.read_bytes().replace(b'"float32"', b'"int32"'))
    fresh = LocalTier(LocalConfig(root=str(tmp_path)), "r1")
    name = next(n for n, t in m.tensors.items() if t.dtype == "float32" and t.shards[0].shape[0])
    with pytest.raises(IntegrityError, match="int32"):
        fresh.read(10, name)


def test_a_shard_placed_past_its_pack_is_an_integrity_error(tmp_path):
    tier, m, _ = _step(tmp_path)
    name = next(n for n, t in m.tensors.items() if t.dtype == "float32" and t.shards[0].shape[0])
    entry = m.tensors[name].shards[0]
    moved = dataclasses.replace(entry, location=(dataclasses.replace(entry.location[0], start=10**6),))
    with pytest.raises(IntegrityError, match="past the pack"):
        tier.read_shard(m, name, moved, verify=False)


def test_load_hands_out_shards_in_the_order_they_lie_on_disk(tmp_path):
    """The manifest is ordered by name; a packed step's load() walks the packs front to back (read-ahead)."""
    tier = LocalTier(LocalConfig(root=str(tmp_path)), "r1")
    snap = every_case_snapshot()
    tier.write(snap)
    m = tier.manifest(10)
    back = LocalTier(LocalConfig(root=str(tmp_path)), "r1").load(10)
    places = []
    for s in back.data:
        (entry,) = [e for e in m.tensors[s.tensor].shards if e.offsets == s.offsets]
        piece = entry.location[0]
        places.append((int(piece.path.rsplit("/", 1)[1]), piece.start))
    assert places == sorted(places) and len(places) == len(snap.data)
    assert {(s.tensor, s.offsets): back.array(s).tobytes() for s in back.data} == {
        (s.tensor, s.offsets): a.tobytes() for s, a in snap.data.items()}


def test_a_pack_claiming_huge_chunks_over_a_sparse_file_is_refused_before_any_chunk_is_read(tmp_path):
    """The attack: zarr.json says 256 MiB chunks and a sparse shard file of the matching size carries a valid dense
    index, so every reader would allocate and read a whole chunk before its CRC failed; refused from the metadata."""
    tier, m, step = _step(tmp_path)
    pack = step / "packs" / "0"
    meta = json.loads((pack / "zarr.json").read_text())
    length, dtype = meta["shape"][0], meta["data_type"]
    chunk = (256 << 20) // np.dtype(dtype).itemsize
    (pack / "zarr.json").write_bytes(array_json((length,), dtype, (chunk,), (chunk,), {"flowcheck": {"layout": zarr_pack.LAYOUT}}))
    chunk_bytes = chunk * np.dtype(dtype).itemsize
    index = np.array([[0, chunk_bytes + 4]], dtype="<u8").tobytes()
    with open(pack / "c" / "0", "wb") as f:
        f.truncate(chunk_bytes + 4)  # sparse: no bytes on disk
        f.seek(chunk_bytes + 4)
        f.write(index + google_crc32c.value(index).to_bytes(4, "little"))
    fresh = LocalTier(LocalConfig(root=str(tmp_path)), "r1")
    name = next(n for n, t in m.tensors.items() if t.shards and t.shards[0].location[0].path.endswith("packs/0"))
    with pytest.raises(IntegrityError, match=f"chunks of {chunk_bytes} bytes, expected the 65536"):
        fresh.read(10, name)
