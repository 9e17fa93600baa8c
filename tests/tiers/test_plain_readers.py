"""Every layout the local tier's write paths produce opens without flowcheck: zarr for local steps, safetensors
for object files.  The readers here are plain zarr (``zarr.open_group`` / ``zarr.open_array``) and plain
safetensors; flowcheck only wrote the files."""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
import zarr
from safetensors import safe_open

from flowcheck.config import LocalConfig, ObjectConfig
from flowcheck.state import Scalars, Shard, Snapshot, StateLayout, TensorSpec
from flowcheck.tiers import zarr_pack
from flowcheck.tiers.local import LocalTier
from flowcheck.tiers.object import ObjectTier
from tests.helpers import make_snapshot

BYTES = "decoder.layers.0.mask"  # bool: zarr writes one-byte dtypes' bytes codec without endianness


def every_case_snapshot(step: int = 10) -> Snapshot:
    """float32 (a multi-shard tensor, one spanning many 64 KiB chunks), bf16, a 0-d int64, a zero-size
    dimension, one-byte dtypes (bool, int8) and float16."""
    base = make_snapshot(step=step)
    rng = np.random.default_rng(step)
    extra = {
        Shard("decoder.layers.1.big", (0, 0), (300, 257)): rng.standard_normal((300, 257)).astype(np.float32),
        Shard(BYTES, (0,), (1000,)): rng.integers(0, 2, 1000).astype(bool),
        Shard("decoder.layers.0.codes", (0, 0), (7, 3)): rng.integers(-128, 127, (7, 3)).astype(np.int8),
        Shard("decoder.layers.0.half", (0,), (33,)): rng.standard_normal(33).astype(np.float16),
    }
    specs = base.layout.tensors + (
        TensorSpec("decoder.layers.1.big", "float32", (300, 257)),
        TensorSpec(BYTES, "bool", (1000,)),
        TensorSpec("decoder.layers.0.codes", "int8", (7, 3)),
        TensorSpec("decoder.layers.0.half", "float16", (33,)),
    )
    return Snapshot(base.run, step, StateLayout(specs), {**base.data, **extra}, Scalars(optimizer_step=step))


def expected(snapshot: Snapshot) -> dict[tuple[str, tuple[int, ...]], np.ndarray]:
    return {(s.tensor, s.offsets): snapshot.array(s) for s in snapshot.shards()}


def packed_shards(step_path: str) -> dict[tuple[str, tuple[int, ...]], np.ndarray]:
    """Every shard of a packed step, found the way docs/format.md tells a zarr user: the group's tensor table."""
    group = zarr.open_group(step_path, mode="r")
    table = group.attrs["flowcheck"]
    assert table["layout"] == "packed"
    out = {}
    for name, entries in table["tensors"].items():
        for e in entries:
            n = math.prod(e["shape"])
            flat = np.asarray(group[e["array"]][e["start"]:e["start"] + n])
            also = np.asarray(zarr.open_array(os.path.join(step_path, e["array"]), mode="r")[e["start"]:e["start"] + n])
            assert flat.tobytes() == also.tobytes()
            out[(name, tuple(e["offsets"]))] = flat.reshape(e["shape"])
    return out


@pytest.mark.parametrize("pack_max", [zarr_pack.PACK_MAX, 4096])  # one pack per dtype, and many small packs
def test_a_packed_step_opens_with_plain_zarr_and_every_shard_is_bit_exact(tmp_path, monkeypatch, pack_max):
    monkeypatch.setattr(zarr_pack, "PACK_MIN", min(zarr_pack.PACK_MIN, pack_max))
    monkeypatch.setattr(zarr_pack, "PACK_MAX", pack_max)
    snap = every_case_snapshot()
    m = LocalTier(LocalConfig(root=str(tmp_path)), "r1").write(snap)
    assert m.format_version == 3
    step_path = str(tmp_path / "r1" / "step-000000010")
    got = packed_shards(step_path)
    want = expected(snap)
    assert got.keys() == want.keys()
    for key, arr in want.items():
        assert got[key].tobytes() == arr.tobytes() and got[key].shape == arr.shape, key
    packs = list(zarr.open_group(step_path, mode="r")["packs"].array_keys())
    assert len(packs) >= (6 if pack_max == 4096 else 5)  # five storage dtypes at least


def test_a_packed_step_lists_its_arrays_with_plain_zarr(tmp_path):
    LocalTier(LocalConfig(root=str(tmp_path)), "r1").write(every_case_snapshot())
    group = zarr.open_group(str(tmp_path / "r1" / "step-000000010"), mode="r")
    members = dict(group["packs"].arrays())
    dtypes = {str(a.dtype) for a in members.values()}
    assert {"float32", "uint16", "int64", "bool", "int8", "float16"} <= dtypes
    for a in members.values():
        assert a.ndim == 1 and a.metadata.attributes["flowcheck"]["layout"] == "packed"
        np.asarray(a[...])  # zarr checks every chunk's CRC32C reading the whole array


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_a_compressed_step_keeps_one_array_per_shard_that_plain_zarr_opens(tmp_path, codec):
    snap = every_case_snapshot()
    m = LocalTier(LocalConfig(root=str(tmp_path), codec=codec, chunk_mib=1), "r1").write(snap)
    assert m.format_version == 1
    for key, arr in expected(snap).items():
        (entry,) = [e for e in m.tensors[key[0]].shards if e.offsets == key[1]]
        z = zarr.open_array(str(tmp_path / "r1" / entry.location[0].path), mode="r")
        assert np.asarray(z[...]).tobytes() == arr.tobytes() and z.attrs["tensor"] == key[0]


def test_an_uncompressed_per_shard_step_still_opens_with_plain_zarr(tmp_path, monkeypatch):
    """The per-shard layout written uncompressed (every step before format 3, and v2 states) by the native
    shard writer: zarr reads it like its own."""
    monkeypatch.setattr(LocalTier, "_packable", lambda self, snapshot: False)
    snap = every_case_snapshot()
    m = LocalTier(LocalConfig(root=str(tmp_path), chunk_mib=1), "r1").write(snap)
    assert m.format_version == 1
    for key, arr in expected(snap).items():
        (entry,) = [e for e in m.tensors[key[0]].shards if e.offsets == key[1]]
        z = zarr.open_array(str(tmp_path / "r1" / entry.location[0].path), mode="r")
        assert np.asarray(z[...]).tobytes() == arr.tobytes()
    fresh = LocalTier(LocalConfig(root=str(tmp_path)), "r1")  # and flowcheck still reads the old layout
    snap_back = fresh.load(10)
    assert {(s.tensor, s.offsets): snap_back.array(s).tobytes() for s in snap_back.shards()} == {
        k: a.tobytes() for k, a in expected(snap).items()}


def test_object_files_promoted_from_a_packed_step_open_with_plain_safetensors(tmp_path):
    local = LocalTier(LocalConfig(root=str(tmp_path / "local")), "r1")
    snap = every_case_snapshot()
    local.write(snap)
    obj = ObjectTier(ObjectConfig(url=f"file://{tmp_path / 'object'}", max_file_mib=1), "r1",
                     staging_dir=str(tmp_path / "staging"))
    m = obj.write(local.load(10))
    assert m.format_version == 1 and m.digest() == local.manifest(10).digest()
    want = expected(snap)
    found = {}
    for f in m.files:
        if not f.path.endswith(".safetensors"):
            continue
        with safe_open(str(tmp_path / "object" / "r1" / f.path), framework="pt") as st:  # numpy has no bf16
            for key in st.keys():
                t = st.get_tensor(key)
                found[key] = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    for name, t in m.tensors.items():
        for e in t.shards:
            parts = [found[p.key] for p in e.location]
            arr = np.concatenate(parts) if len(parts) > 1 else parts[0]
            assert arr.tobytes() == want[(name, e.offsets)].tobytes(), name


def test_the_tensor_table_of_a_packed_step_is_plain_json(tmp_path):
    LocalTier(LocalConfig(root=str(tmp_path)), "r1").write(every_case_snapshot())
    with open(tmp_path / "r1" / "step-000000010" / "zarr.json") as f:
        attrs = json.load(f)["attributes"]["flowcheck"]
    entry = attrs["tensors"]["decoder.final_layernorm.weight"][0]
    assert set(entry) == {"array", "start", "shape", "offsets", "dtype"} and entry["dtype"] == "bfloat16"
