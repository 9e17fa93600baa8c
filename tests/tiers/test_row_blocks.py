"""Row-block chunks (tiers.local.row_block_bytes): a large tensor stored as boxes of whole rows, so an incremental
step of an embedding whose step changes 1% of its rows stores only the changed blocks; every reader (restore,
export, plain zarr, promotion, DCP) still gets the whole tensor bit for bit."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from flowcheck.audit import audit
from flowcheck.config import LocalConfig
from flowcheck.errors import ConfigError
from flowcheck.manifest import INCREMENTAL_VERSION
from flowcheck.state import Pin, Scalars, Shard, Snapshot, StateLayout, TensorSpec
from flowcheck.store import Store
from flowcheck.tiers import row_blocks
from flowcheck.tiers.local import LocalTier
from tests.test_branches_store import make_store

EMB = "embedding.word_embeddings.weight"
ROWS, COLS = 8192, 64  # fp32: 2 MiB, 256 bytes a row
BLOCK = 4096  # 16 rows a block, 512 blocks
ROWS_PER_BLOCK = BLOCK // (COLS * 4)
LAYOUT = StateLayout((TensorSpec(EMB, "float32", (ROWS, COLS), "vocab"),
                      TensorSpec("optimizer.step_count", "int64", ())))
# the changed blocks fill one float32 pack (rounded up to whole 64 KiB chunks, + CRC32C and index), the counter
# an int64 pack; zarr metadata adds a few KiB, and the step's tensor table (group zarr.json, for plain readers)
# about 300 bytes per box: every block, changed or not, is listed
OVERHEAD = 2 * ((64 << 10) + 4 + 16 + 4) + (16 << 10)
TABLE_PER_BOX = 320


def embedding_history(steps: int, frac: float = 0.01) -> tuple[list[np.ndarray], list[set[int]]]:
    """The table after each step, and the rows each step changed (1% of them, anywhere)."""
    rng = np.random.default_rng(7)
    table = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    out, changed = [table.copy()], [set(range(ROWS))]
    for _ in range(steps - 1):
        rows = rng.choice(ROWS, int(ROWS * frac), replace=False)
        table[rows] += np.float32(0.5)
        out.append(table.copy())
        changed.append({int(r) for r in rows})
    return out, changed


def snap(step: int, table: np.ndarray, run: str = "r1") -> Snapshot:
    data = {Shard(EMB, (0, 0), (ROWS, COLS)): table,
            Shard("optimizer.step_count", (), ()): np.array(step, np.int64)}
    return Snapshot(run, step, LAYOUT, data, Scalars(optimizer_step=step))


def tier(tmp_path, block: int = BLOCK) -> LocalTier:
    return LocalTier(LocalConfig(root=str(tmp_path / "local"), row_block_bytes=block), "r1")


def blocked_store(root: str) -> Store:
    cfg = make_store(root).config
    local = dataclasses.replace(cfg.tiers.local, row_block_bytes=BLOCK)
    return Store(dataclasses.replace(cfg, tiers=dataclasses.replace(cfg.tiers, local=local)))


def write_history(t: LocalTier, tables) -> list:
    parent, out = None, []
    for step, table in enumerate(tables, 1):
        m = t.write(snap(step, table), parent)
        parent = m.parent_ref()
        out.append(m)
    return out


def test_embedding_with_one_percent_of_rows_changing_stores_about_the_changed_blocks(tmp_path):
    tables, changed = embedding_history(6)
    t = tier(tmp_path)
    ms = write_history(t, tables)
    assert len(ms[0].tensors[EMB].shards) == ROWS // ROWS_PER_BLOCK
    for step in range(2, 7):
        m = ms[step - 1]
        blocks = {r // ROWS_PER_BLOCK for r in changed[step - 1]}
        want = len(blocks) * BLOCK + 8
        assert m.format_version == INCREMENTAL_VERSION
        assert want <= m.nbytes <= want + OVERHEAD + TABLE_PER_BOX * (ROWS // ROWS_PER_BLOCK), (step, m.nbytes, want)
        assert m.nbytes < ROWS * COLS * 4 / 3  # well under the whole table, which a step without blocks writes
        written = {e.offsets[0] // ROWS_PER_BLOCK for e in m.tensors[EMB].shards if e.location[0].ref is None}
        assert written == blocks
    whole = tier(tmp_path / "whole", block=0)
    full = write_history(whole, tables)
    assert all(m.nbytes >= ROWS * COLS * 4 for m in full[1:])  # without blocks the table is rewritten every step
    assert len(full[1].tensors[EMB].shards) == 1


def test_every_blocked_step_restores_bit_exact_and_audits_clean(tmp_path):
    tables, _ = embedding_history(5)
    store = blocked_store(str(tmp_path))
    for step, table in enumerate(tables, 1):
        store.push(snap(step, table))
        store.snapshot()
    local = store.tier("local")
    assert local.manifest(5).format_version == INCREMENTAL_VERSION
    for step, table in enumerate(tables, 1):
        assert local.read(step, EMB, (slice(0, ROWS), slice(0, COLS))).tobytes() == table.tobytes()
        # a region across block edges
        got = local.read(step, EMB, (slice(ROWS_PER_BLOCK - 3, 5 * ROWS_PER_BLOCK + 2), slice(7, 40)))
        assert got.tobytes() == table[ROWS_PER_BLOCK - 3:5 * ROWS_PER_BLOCK + 2, 7:40].tobytes()
    rep = audit(store)
    assert rep.ok, [str(p) for p in rep.problems]
    assert audit(store, data=False).ok
    # the same RAM state snapshotted again is the state already stored (its blocks), not a new branch
    again = store.snapshot()
    assert again.digest() == local.manifest(5).digest() and store.history().records == {}


def test_blocked_steps_export_promote_and_open_in_a_plain_zarr_reader(tmp_path):
    from safetensors.numpy import load_file

    from flowcheck.restore.export import export_file

    tables, _ = embedding_history(3)
    store = blocked_store(str(tmp_path))
    for step, table in enumerate(tables, 1):
        store.push(snap(step, table))
        store.snapshot()
    local = store.tier("local")
    out = str(tmp_path / "step3.safetensors")
    export_file(local, local.manifest(3), out)
    assert load_file(out)[EMB].tobytes() == tables[2].tobytes()
    store.promote(2)
    promoted = store.promote(3)  # its parent's object copy holds the unchanged blocks: only the changed upload
    assert promoted.digest() == local.manifest(3).digest()
    assert promoted.refs and promoted.nbytes < ROWS * COLS * 4 / 3
    assert store.object.read(3, EMB, (slice(0, ROWS), slice(0, COLS))).tobytes() == tables[2].tobytes()

    zarr = pytest.importorskip("zarr")
    folder = os.path.join(local.root, "step-000000003")
    table = zarr.open_group(folder, mode="r").attrs["flowcheck"]["tensors"][EMB]
    got = np.empty((ROWS, COLS), np.float32)
    for e in table:  # every box: in this step's group, or in the group its "in" names
        holder = zarr.open_group(os.path.normpath(os.path.join(folder, e.get("in", "."))), mode="r")
        n = int(np.prod(e["shape"]))
        r0, rows = e["offsets"][0], e["shape"][0]
        got[r0:r0 + rows] = np.asarray(holder[e["array"]][e["start"]:e["start"] + n]).view(np.float32).reshape(e["shape"])
    assert got.tobytes() == tables[2].tobytes()


def test_dcp_save_and_load_through_a_blocked_local_tier(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    import flowcheck.dcp

    cfg = str(tmp_path / "flowcheck.yaml")
    with open(cfg, "w") as f:
        f.write(f"run: gpt\ntiers:\n  local:\n    root: {tmp_path}/local\n    row_block_bytes: 1024\n"
                f"  object:\n    url: file://{tmp_path}/object\n")
    g = torch.Generator().manual_seed(0)
    state = {"emb": torch.randn(300, 16, generator=g), "b": torch.randn(5, generator=g)}
    dcp.save(state, storage_writer=flowcheck.dcp.Writer(cfg, step=1), no_dist=True)
    back = {"emb": torch.zeros(300, 16), "b": torch.zeros(5)}
    dcp.load(back, storage_reader=flowcheck.dcp.Reader(cfg, step=1), no_dist=True)
    assert torch.equal(back["emb"], state["emb"]) and torch.equal(back["b"], state["b"])
    from flowcheck.store import open_store

    m = open_store(cfg).local.manifest(1)
    assert len(m.tensors["emb"].shards) > 1  # stored as row blocks (16 rows of 64 bytes)


def test_split_releases_each_whole_shard_once_after_its_last_block():
    table = np.zeros((ROWS, COLS), np.float32)
    released = []
    s = dataclasses.replace(snap(1, table), pin=Pin(7, {}, {}, released.append))
    out = row_blocks.split(s, BLOCK)
    assert out.pin.id == 7  # MemoryTier.release still finds the pin
    blocks = [b for b in out.data if b.tensor == EMB]
    assert len(blocks) == ROWS // ROWS_PER_BLOCK
    assert sum(b.shape[0] for b in blocks) == ROWS and all(np.shares_memory(out.data[b], table) for b in blocks)
    for b in blocks[:-1]:
        out.pin.on_shard_written(b)
    assert released == []
    out.pin.on_shard_written(blocks[-1])
    out.pin.on_shard_written(Shard("optimizer.step_count", (), ()))
    assert released == [Shard(EMB, (0, 0), (ROWS, COLS)), Shard("optimizer.step_count", (), ())]


def test_small_shards_loaders_and_stored_snapshots_stay_whole():
    assert row_blocks.blocks(Shard(EMB, (0, 0), (4, COLS)), 4, BLOCK) == [Shard(EMB, (0, 0), (4, COLS))]
    assert row_blocks.blocks(Shard("v", (0,), (100000,)), 4, BLOCK) == [Shard("v", (0,), (100000,))]
    # an uneven last block, offsets in the global index space of a shard that starts at row 100
    cut = row_blocks.blocks(Shard(EMB, (100, 8), (40, 64)), 4, BLOCK)
    assert [(b.offsets, b.shape) for b in cut] == [((100, 8), (16, 64)), ((116, 8), (16, 64)), ((132, 8), (8, 64))]
    lazy = Snapshot("r1", 1, LAYOUT, {Shard(EMB, (0, 0), (ROWS, COLS)): lambda: np.zeros((ROWS, COLS), np.float32)})
    assert row_blocks.split(lazy, BLOCK) is lazy


@pytest.mark.parametrize("bad", [-1, 1.5, "4096", True])
def test_row_block_bytes_must_be_a_non_negative_integer(bad):
    with pytest.raises(ConfigError, match=r"tiers.local.row_block_bytes: expected an integer >= 0.*found"):
        LocalConfig(row_block_bytes=bad)


def test_flowcheck_import_of_a_dcp_directory_into_blocked_steps_loads_and_exports_whole(tmp_path):
    torch = pytest.importorskip("torch")
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp
    from safetensors.numpy import load_file

    import flowcheck.dcp
    from flowcheck.store import open_store

    g = torch.Generator().manual_seed(1)
    state = {"emb": torch.randn(300, 16, generator=g), "b": torch.randn(5, generator=g)}
    src = tmp_path / "dcp"
    dcp.save(state, checkpoint_id=str(src), no_dist=True)
    cfg = str(tmp_path / "flowcheck.yaml")
    with open(cfg, "w") as f:
        f.write(f"run: gpt\ntiers:\n  local:\n    root: {tmp_path}/local\n    row_block_bytes: 1024\n"
                f"  object:\n    url: file://{tmp_path}/object\n")
    cli = [sys.executable, "-m", "flowcheck", "--config", cfg]
    done = subprocess.run([*cli, "import", "--step", "2", str(src)], check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert len(open_store(cfg).local.manifest(2).tensors["emb"].shards) > 1
    back = {"emb": torch.zeros(300, 16), "b": torch.zeros(5)}
    dcp.load(back, storage_reader=flowcheck.dcp.Reader(cfg, step=2), no_dist=True)
    assert torch.equal(back["emb"], state["emb"]) and torch.equal(back["b"], state["b"])
    out = str(tmp_path / "out.safetensors")
    done = subprocess.run([*cli, "export", "--step", "2", "--out", out], check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert load_file(out)["emb"].tobytes() == state["emb"].numpy().tobytes()
