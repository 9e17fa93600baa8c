"""The local tier's direct shard writer produces exactly the bytes zarr itself writes."""
from __future__ import annotations

import numpy as np
import pytest
import zarr
from zarr.codecs import Crc32cCodec

from flowcheck.tiers.zarr_shard import write_shard


@pytest.mark.parametrize(
    "shape, rows, dtype",
    [((10, 7), 3, "float32"), ((12, 5), 4, "float32"), ((5,), 5, "uint16"), ((3, 2, 4), 2, "int64"), ((1, 1), 1, "float64")],
)
def test_direct_shard_file_is_byte_identical_to_zarrs(tmp_path, shape, rows, dtype):
    arr = (np.random.default_rng(0).random(shape) * 1000).astype(dtype) + 1  # no all-zero chunk
    group = zarr.open_group(str(tmp_path / "ref"), mode="w")
    chunks = (rows, *shape[1:])
    shards = (-(-shape[0] // rows) * rows, *shape[1:])
    z = group.create_array("a", shape=shape, dtype=dtype, chunks=chunks, shards=shards, compressors=[Crc32cCodec()], fill_value=0)
    z[...] = arr
    key = z.metadata.encode_chunk_key((0,) * arr.ndim)
    reference = (tmp_path / "ref" / "a" / key).read_bytes()
    size, digest = write_shard(str(tmp_path / "mine"), arr, rows)
    assert (tmp_path / "mine").read_bytes() == reference and size == len(reference)
    assert digest.startswith("xxh3-128:")


def test_direct_shard_refuses_what_it_cannot_encode(tmp_path):
    for bad in (np.zeros(()), np.zeros((0, 3)), np.zeros((4, 4))[:, ::2], np.zeros(3, ">f4")):
        with pytest.raises(ValueError):
            write_shard(str(tmp_path / "x"), bad, 1)
