"""Test data builders shared by the suites: snapshots with every awkward case a tier must store."""
from __future__ import annotations

import base64
import os

import numpy as np

from flowcheck.state import Scalars, Shard, Snapshot, StateLayout, TensorSpec

W = "decoder.layers.0.mlp.linear_fc1.weight"  # float32 [8, 6], two shards split along dim 0
NORM = "decoder.final_layernorm.weight"  # bfloat16 [16] (uint16 bit patterns, NaN payloads included)
COUNT = "optimizer.step_count"  # int64, 0-d
EMPTY = "embedding.padding"  # float32 [0, 4]: a zero-size dimension

LAYOUT = StateLayout(
    (
        TensorSpec(W, "float32", (8, 6), "column"),
        TensorSpec(NORM, "bfloat16", (16,)),
        TensorSpec(COUNT, "int64", ()),
        TensorSpec(EMPTY, "float32", (0, 4)),
    )
)


def make_arrays(step: int = 10, seed: int = 0) -> dict[Shard, np.ndarray]:
    """The shard data of ``make_snapshot``, keyed by shard."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((8, 6)).astype(np.float32)
    return {
        Shard(W, (0, 0), (4, 6)): w[:4].copy(),
        Shard(W, (4, 0), (4, 6)): w[4:].copy(),
        Shard(NORM, (0,), (16,)): rng.integers(0, 1 << 16, 16, dtype=np.uint16),
        Shard(COUNT, (), ()): np.array(step * 1000 + seed + 1, dtype=np.int64),
        Shard(EMPTY, (0, 0), (0, 4)): np.zeros((0, 4), np.float32),
    }


def make_scalars(step: int = 10, seed: int = 0) -> Scalars:
    rng_state = base64.b64encode(np.random.default_rng(seed).bytes(32)).decode()
    return Scalars(
        optimizer_step=step,
        rng={"torch": rng_state},
        lr_scheduler={"last_lr": [0.0003], "last_epoch": step, "warmup_steps": 100},
    )


def make_snapshot(run: str = "r1", step: int = 10, seed: int = 0) -> Snapshot:
    """A snapshot mixing shards, bf16, a 0-d tensor and a zero-size dimension."""
    return Snapshot(run, step, LAYOUT, make_arrays(step, seed), make_scalars(step, seed))


def make_custom_snapshot(
    specs: list[TensorSpec], arrays: dict[Shard, np.ndarray], run: str = "r1", step: int = 10
) -> Snapshot:
    return Snapshot(run, step, StateLayout(tuple(specs)), arrays, make_scalars(step))


def global_array(snapshot: Snapshot, name: str) -> np.ndarray:
    """Assemble a tensor's global array from a snapshot's shards (in storage dtype)."""
    spec = snapshot.layout.spec(name)
    out = None
    for shard in snapshot.shards():
        if shard.tensor != name:
            continue
        arr = snapshot.array(shard)
        if out is None:
            out = np.zeros(spec.shape, arr.dtype)
        out[tuple(slice(o, o + s) for o, s in zip(shard.offsets, shard.shape))] = arr
    return out


BIG = "decoder.layers.1.self_attention.linear_qkv.weight"


def big_snapshot(step: int = 10) -> Snapshot:
    """A 2.5 MiB float32 shard (cut into 1 MiB files by object tiers) plus a small tensor."""
    rng = np.random.default_rng(7)
    big = rng.standard_normal((640, 1024)).astype(np.float32)
    small = rng.standard_normal((3,)).astype(np.float32)
    specs = [TensorSpec(BIG, "float32", big.shape, "qkv"), TensorSpec("small", "float32", (3,))]
    data = {Shard(BIG, (0, 0), big.shape): big, Shard("small", (0,), (3,)): small}
    return make_custom_snapshot(specs, data, step=step)


def failing_snapshot(step: int) -> Snapshot:
    """A snapshot whose last shard cannot be produced: the write fails after data went out."""
    good = big_snapshot(step)
    bad_spec = TensorSpec("late", "float32", (4,))

    def explode() -> np.ndarray:
        raise RuntimeError("source went away mid-write")

    data = dict(good.data)
    data[Shard("late", (0,), (4,))] = explode
    return make_custom_snapshot([*good.layout.tensors, bad_spec], data, step=step)


def assert_step_intact(tier, snapshot: Snapshot) -> None:
    """Every shard of the stored step passes its digest check and equals the snapshot bit for bit."""
    m = tier.manifest(snapshot.step)
    for name, t in m.tensors.items():
        for entry in t.shards:
            got = tier.read_shard(m, name, entry)
            want = snapshot.array(Shard(name, entry.offsets, entry.shape))
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes(), f"{name} {entry.offsets}"


# ---- raw access to a tier's stored files, for corrupting them on purpose -------------
def stored_path(tier, rel: str) -> str:
    """Where a tier-relative path (as in manifest ``files``) lives, for the tier's own filesystem."""
    return f"{tier.root}/{rel}"


def read_raw(tier, rel: str) -> bytes:
    fs = getattr(tier, "fs", None)
    if fs is not None:
        return fs.cat_file(stored_path(tier, rel))
    with open(os.path.join(tier.root, rel), "rb") as f:
        return f.read()


def write_raw(tier, rel: str, data: bytes) -> None:
    fs = getattr(tier, "fs", None)
    if fs is not None:
        fs.pipe_file(stored_path(tier, rel), data)
        fs.invalidate_cache()
        return
    with open(os.path.join(tier.root, rel), "wb") as f:
        f.write(data)


def flip_shard_byte(tier, step: int, tensor: str) -> str:
    """Flip one byte inside the stored data of ``tensor``'s first shard in a local step (per-shard arrays or a
    pack: the byte is within that shard's elements); returns the file changed."""
    import math

    from flowcheck import dtypes
    from flowcheck.tiers.zarr_pack import CHUNK_BYTES

    m = tier.manifest(step)
    entry = m.tensors[tensor].shards[0]
    piece = entry.location[0]
    folder = os.path.join(tier.root, piece.path)
    if piece.start is None:  # one zarr array per shard: the middle of its first chunk file
        path = sorted(os.path.join(d, f) for d, _, files in os.walk(folder) for f in files if f != "zarr.json")[0]
        at = os.path.getsize(path) // 2
    else:  # a pack: the shard's middle element; inner chunks of CHUNK_BYTES, each followed by its 4-byte CRC32C
        path = os.path.join(folder, "c", "0")
        off = (piece.start + math.prod(entry.shape) // 2) * dtypes.dtype(m.tensors[tensor].dtype).itemsize
        at = off // CHUNK_BYTES * (CHUNK_BYTES + 4) + off % CHUNK_BYTES
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    return path


def trainer_state(model, opt) -> dict:
    """A torch trainer's state as the node stores it (canonical names: the state dict, then ``optimizer.<slot>.<p>``),
    copied to numpy."""
    from flowcheck.torch.state import _flatten_optimizer, param_names_of

    out = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}
    tensors, _, _ = _flatten_optimizer(opt.state_dict(), param_names_of(model))
    out.update({k: v.detach().clone().numpy() for k, v in tensors.items()})
    return out


def state_digest(state: dict[str, np.ndarray]) -> str:
    """One digest of a whole state (names and bytes, in name order): a trainer's and a node's must agree."""
    import xxhash

    h = xxhash.xxh3_128()
    for name in sorted(state):
        h.update(name.encode())
        h.update(np.ascontiguousarray(state[name]).view(np.uint8))
    return h.hexdigest()
