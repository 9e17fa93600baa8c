"""`flowcheck import` runs no code from a checkpoint: every pickled file of a Megatron directory is an attack surface.

Each test plants a payload whose unpickling would create a marker file (``open(marker, 'w')`` or
``os.system('touch marker')``) in one file of an otherwise honest checkpoint, then imports it: the import must
fail with one line naming the file and the refused global, create no marker and commit nothing.  With
``--trust-pickle`` the payload really runs, which shows each one is live.
"""
from __future__ import annotations

import os
import pickle

import pytest
import torch
from click.testing import CliRunner

from flowcheck.cli import main
from flowcheck.errors import FormatError, StepNotFoundError
from flowcheck.restore.importer import RESTORE_RECORD, import_into
from flowcheck.restore.megatron_common import Target
from flowcheck.restore.service import restore

from .conftest import make_store, same_or_padded, store_config

IT = "iter_0000010"


class _OpenForWriting:
    """Unpickles as ``open(path, 'w')``: the file appears."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class _Shell:
    """Unpickles as ``os.system('touch path')``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _foreign(store, tmp_path, fmt: str, tp: int = 2) -> str:
    """A checkpoint directory as a foreign trainer would hand it over (no restore record)."""
    out = restore(store, 10, Target(tp, 1, 1, fmt), str(tmp_path / f"ck-{fmt}")).out
    os.remove(os.path.join(out, RESTORE_RECORD))
    return out


def _rewrite_metadata(it_dir: str, edit) -> None:
    path = os.path.join(it_dir, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)  # our own honest file: the test may read it freely
    edit(md)
    with open(path, "wb") as f:
        pickle.dump(md, f)


def _import_cli(tmp_path, src: str, *extra: str):
    cfg = store_config(tmp_path)
    return CliRunner().invoke(main, ["--no-progress", "import", "--config", cfg, "--run", "foreign", "--step", "1",
                                     *extra, src])


def _refused(res, file: str, global_name: str, marker) -> None:
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1, res.output
    assert file in lines[0] and global_name in lines[0] and "--trust-pickle" in lines[0], lines[0]
    assert not marker.exists(), "a pickled payload ran"


def _nothing_committed(tmp_path) -> None:
    with pytest.raises(StepNotFoundError):
        make_store(tmp_path, "foreign").manifest(1)


@pytest.mark.parametrize("payload", [_OpenForWriting, _Shell])
def test_a_dcp_metadata_that_would_run_code_is_refused(tmp_path, gqa_store, payload):
    """The attack of the issue: DCP's reader pickle.loads .metadata, and the import would even succeed."""
    store, _, _ = gqa_store
    marker = tmp_path / "exploded"
    out = _foreign(store, tmp_path, "megatron-dist")
    _rewrite_metadata(os.path.join(out, IT), lambda md: setattr(md, "planner_data", {"x": payload(str(marker))}))
    res = _import_cli(tmp_path, out)
    _refused(res, f"{IT}/.metadata", "io.open" if payload is _OpenForWriting else "posix.system", marker)
    _nothing_committed(tmp_path)
    # the payload is live: trusted, it runs (and the honest rest of the checkpoint imports)
    res = _import_cli(tmp_path, out, "--trust-pickle")
    assert res.exit_code == 0, res.output
    assert marker.exists()


def test_a_common_pt_that_would_run_code_is_refused(tmp_path, gqa_store):
    store, _, _ = gqa_store
    marker = tmp_path / "exploded"
    out = _foreign(store, tmp_path, "megatron-dist")
    common = os.path.join(out, IT, "common.pt")
    obj = torch.load(common, weights_only=False)
    obj["rng_state"] = [_OpenForWriting(str(marker))]
    torch.save(obj, common)
    _refused(_import_cli(tmp_path, out), f"{IT}/common.pt", "io.open", marker)
    _nothing_committed(tmp_path)
    res = _import_cli(tmp_path, out, "--trust-pickle")
    assert res.exit_code == 0 and marker.exists(), res.output


def test_a_legacy_rank_file_that_would_run_code_is_refused(tmp_path, gqa_store):
    store, _, _ = gqa_store
    marker = tmp_path / "exploded"
    out = _foreign(store, tmp_path, "megatron")
    rank = os.path.join(out, IT, "mp_rank_01", "model_optim_rng.pt")
    obj = torch.load(rank, weights_only=False)
    obj["rng_state"] = _Shell(str(marker))
    torch.save(obj, rank)
    _refused(_import_cli(tmp_path, out), "mp_rank_01/model_optim_rng.pt", "posix.system", marker)
    _nothing_committed(tmp_path)
    res = _import_cli(tmp_path, out, "--trust-pickle")
    assert res.exit_code == 0 and marker.exists(), res.output


def _repoint(it_dir: str, fqn: str, file: str, data: bytes) -> None:
    """Store ``data`` as the first chunk of ``fqn``: in a file of its own, the metadata pointing there."""
    with open(os.path.join(it_dir, file), "wb") as f:
        f.write(data)

    def edit(md):
        key = next(k for k in md.storage_data if k.fqn == fqn)
        info = md.storage_data[key]
        info.relative_path, info.offset, info.length = file, 0, len(data)

    _rewrite_metadata(it_dir, edit)


@pytest.mark.parametrize("trust", [False, True])
def test_a_tensor_item_that_would_run_code_is_refused_even_when_trusted(tmp_path, gqa_store, trust):
    """A .distcp tensor item is a torch.save stream; like DCP's own reader, flowcheck reads it weights_only always."""
    store, _, _ = gqa_store
    marker = tmp_path / "exploded"
    out = _foreign(store, tmp_path, "megatron-dist")
    it_dir = os.path.join(out, IT)
    with open(os.path.join(tmp_path, "item"), "wb") as f:
        torch.save(_OpenForWriting(str(marker)), f)
    _repoint(it_dir, "embedding.word_embeddings.weight", "__9_0.distcp", (tmp_path / "item").read_bytes())
    res = _import_cli(tmp_path, out, *(["--trust-pickle"] if trust else []))
    _refused(res, f"{IT}/__9_0.distcp at byte 0 (embedding.word_embeddings.weight", "io.open", marker)
    _nothing_committed(tmp_path)


def test_non_tensor_entries_are_never_loaded(tmp_path, gqa_store):
    """DCP byte entries (Megatron's _extra_state objects) are pickles flowcheck does not need: they are not read."""
    store, state, _ = gqa_store
    marker = tmp_path / "exploded"
    out = _foreign(store, tmp_path, "megatron-dist")
    it_dir = os.path.join(out, IT)
    fqn = "decoder.layers.self_attention.linear_proj._extra_state/shard_0_4"
    _repoint(it_dir, fqn, "__9_1.distcp", pickle.dumps(_Shell(str(marker))))
    m = import_into(make_store(tmp_path, "foreign"), out, 1)
    assert not marker.exists()
    back = make_store(tmp_path, "foreign")
    assert all(same_or_padded(back.read(1, n), state[n].numpy()) for n in state), "the import is not bit-exact"
    assert m.producer.source == "import"


@pytest.mark.parametrize("rel", ["../outside.distcp", "/etc/hostname", "sub/../../x", ""])
def test_a_storage_path_out_of_the_checkpoint_is_refused(tmp_path, gqa_store, rel):
    store, _, _ = gqa_store
    out = _foreign(store, tmp_path, "megatron-dist")

    def edit(md):
        key = next(k for k in md.storage_data if k.fqn == "embedding.word_embeddings.weight")
        md.storage_data[key].relative_path = rel

    _rewrite_metadata(os.path.join(out, IT), edit)
    with pytest.raises(FormatError, match="not a file name inside the checkpoint directory"):
        import_into(make_store(tmp_path, "foreign"), out, 1)
    _nothing_committed(tmp_path)


def test_chunks_that_leave_a_hole_are_refused(tmp_path, gqa_store):
    """torch's reader filled uncovered regions from torch.empty; flowcheck checks the chunks tile each tensor."""
    store, _, _ = gqa_store
    out = _foreign(store, tmp_path, "megatron-dist")

    def edit(md):
        md.state_dict_metadata["output_layer.weight"].chunks[0].sizes = torch.Size([1, 1])

    _rewrite_metadata(os.path.join(out, IT), edit)
    with pytest.raises(FormatError, match="output_layer.weight: chunks cover"):
        import_into(make_store(tmp_path, "foreign"), out, 1)


@pytest.mark.parametrize("fmt", ["megatron-dist", "megatron"])
def test_an_honest_checkpoint_imports_bit_exact_without_trust(tmp_path, gqa_store, fmt):
    store, state, _ = gqa_store
    out = _foreign(store, tmp_path, fmt)
    res = _import_cli(tmp_path, out)
    assert res.exit_code == 0, res.output
    back = make_store(tmp_path, "foreign")
    assert all(same_or_padded(back.read(1, n), state[n].numpy()) for n in state)


@pytest.mark.parametrize("damage", ["metadata_garbage", "metadata_not_metadata", "distcp_truncated"])
def test_a_damaged_dcp_directory_is_one_format_error(tmp_path, gqa_store, damage):
    store, _, _ = gqa_store
    it_dir = os.path.join(_foreign(store, tmp_path, "megatron-dist"), IT)
    if damage == "metadata_garbage":
        (tmp_path / "x").write_bytes(b"\x80\x04garbage")
        os.replace(tmp_path / "x", os.path.join(it_dir, ".metadata"))
        match = "not a readable DCP metadata file"
    elif damage == "metadata_not_metadata":
        with open(os.path.join(it_dir, ".metadata"), "wb") as f:
            pickle.dump({"state_dict_metadata": {}}, f)
        match = "expected a DCP Metadata"
    else:
        for name in os.listdir(it_dir):
            if name.endswith(".distcp"):
                os.truncate(os.path.join(it_dir, name), 100)
        match = "truncated"
    with pytest.raises(FormatError, match=match):
        import_into(make_store(tmp_path, "foreign"), os.path.dirname(it_dir), 1)
    _nothing_committed(tmp_path)
