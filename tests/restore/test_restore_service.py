"""Restore and import through the service and the CLI, checked bit for bit against the canonical state."""
from __future__ import annotations

import itertools
import os
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from flowcheck.cli import main
from flowcheck.errors import FlowcheckError, IntegrityError, StepExistsError, StepNotFoundError
from flowcheck.restore.arch import LayoutError
from flowcheck.restore.importer import import_into
from flowcheck.restore.megatron_common import Target
from flowcheck.restore.service import restore
from flowcheck.state import ParallelLayout, Scalars, Shard, Snapshot, StateLayout, TensorSpec

from tests.conftest import OBJECT_SERVERS, bucket_on
from tests.helpers import flip_shard_byte
from .conftest import SMALL, canonical_state, gqa, make_store, same_or_padded, store_config, write_reference

LAYOUTS = [(1, 1, 1), (2, 2, 1), (4, 1, 1), (2, 2, 2)]


def _same(store, step, state):
    """Every tensor back bit for bit; a step stored without padding rows comes back with the padding rows restore
    wrote (Megatron trains them from there on): copies of the last row."""
    bad = [n for n in state if not same_or_padded(store.read(step, n), state[n].numpy())]
    assert not bad, f"differ after the round trip: {bad[:5]}"


@pytest.mark.parametrize("fmt", ["megatron-dist", "megatron"])
@pytest.mark.parametrize("tp,pp,vpp", LAYOUTS)
def test_restore_then_import_gives_back_every_tensor_bit_for_bit(tmp_path, gqa_store, fmt, tp, pp, vpp):
    store, state, _ = gqa_store
    rep = restore(store, 10, Target(tp, pp, vpp, fmt), str(tmp_path / "out"))
    assert os.path.isfile(tmp_path / "out" / "latest_checkpointed_iteration.txt")
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "10"
    back = make_store(tmp_path, "back")
    m = import_into(back, rep.out, 10)
    assert m.source_layout == ParallelLayout(tp=tp, pp=pp, vpp=vpp)
    assert m.scalars["optimizer_step"] == 7
    _same(back, 10, state)


def _model_files(root):
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f == "model_optim_rng.pt":
                obj = torch.load(os.path.join(dirpath, f), weights_only=False)
                out[os.path.relpath(dirpath, root)] = {k: v for k, v in obj.items() if k.startswith("model") or k == "optimizer"}
    return out


def test_round_trip_between_layouts_is_bit_identical(tmp_path, gqa_store):
    """capture at A -> restore at B -> capture at B -> restore at A gives what restore at A gave."""
    store, _, _ = gqa_store
    a, b = Target(4, 1, 1, "megatron"), Target(2, 2, 2, "megatron")
    first = restore(store, 10, a, str(tmp_path / "a1")).out
    at_a = make_store(tmp_path, "at_a")
    import_into(at_a, first, 10)
    mid = restore(at_a, 10, b, str(tmp_path / "b")).out
    at_b = make_store(tmp_path, "at_b")
    import_into(at_b, mid, 10)
    again = restore(at_b, 10, a, str(tmp_path / "a2")).out
    one, two = _model_files(first), _model_files(again)
    assert one.keys() == two.keys() and len(one) == 4
    for rank in one:
        for chunk, tensors in one[rank].items():
            if chunk.startswith("model"):
                for key, t in tensors.items():
                    assert torch.equal(t, two[rank][chunk][key]), (rank, key)


def test_shards_cut_any_way_by_several_nodes_restore_the_same(tmp_path, gqa_store):
    """Stored shards of uneven row ranges (DP groups on several nodes, mixed sources) reassemble exactly."""
    store, state, _arch = gqa_store
    ref = store.manifest(10)
    data = {}
    for name, t in state.items():
        arr = t.numpy()
        cuts = [0, arr.shape[0] // 3, arr.shape[0]] if arr.shape[0] > 2 else [0, arr.shape[0]]
        for lo, hi in itertools.pairwise(cuts):
            data[Shard(name, (lo,) + (0,) * (arr.ndim - 1), (hi - lo,) + arr.shape[1:])] = arr[lo:hi].copy()
    layout = StateLayout(tuple(TensorSpec(n, "float32", tuple(t.shape), ref.tensors[n].role) for n, t in state.items()),
                         ParallelLayout(dp=3))
    other = make_store(tmp_path, "nodes")
    other.write(Snapshot("nodes", 10, layout, data, Scalars.from_json(ref.scalars), source="mirror"))
    one = restore(store, 10, Target(2, 2, 1, "megatron"), str(tmp_path / "one")).out
    two = restore(other, 10, Target(2, 2, 1, "megatron"), str(tmp_path / "two")).out
    a, b = _model_files(one), _model_files(two)
    for rank in a:
        for key, t in a[rank]["model"].items():
            assert torch.equal(t, b[rank]["model"][key])


def test_bf16_restore_casts_weights_and_keeps_fp32_moments(tmp_path, gqa_store):
    store, state, _ = gqa_store
    out = restore(store, 10, Target(2, 1, 1, "megatron", dtype="bf16"), str(tmp_path / "bf16")).out
    obj = torch.load(os.path.join(out, "iter_0000010", "mp_rank_00", "model_optim_rng.pt"), weights_only=False)
    w = obj["model"]["decoder.layers.0.mlp.linear_fc2.weight"]
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, torch.chunk(state["decoder.layers.0.mlp.linear_fc2.weight"], 2, 1)[0].bfloat16())
    assert obj["args"].bf16 and obj["args"].tensor_model_parallel_size == 2
    masters = obj["optimizer"]["fp32_from_fp16_params"]
    assert all(t.dtype == torch.float32 for g in masters for t in g)


@pytest.fixture(params=["file", *OBJECT_SERVERS])
def object_url(request) -> str | None:
    """The object tier of the store: its ``file://`` folder, or a fresh bucket on each S3 server."""
    return None if request.param == "file" else bucket_on(request, request.param)


@pytest.mark.parametrize("fmt", ["megatron-dist", "megatron"])  # legacy: cut on the consuming thread, not the reader
def test_restore_reads_the_object_tier_when_asked(tmp_path, fmt, object_url):
    store, state, _ = gqa(tmp_path, object_url)
    store.promote(10)
    rep = restore(store, 10, Target(2, 1, 1, fmt), str(tmp_path / "o"), prefer="object")
    assert rep.tier == "object"
    back = make_store(tmp_path, "back")
    import_into(back, rep.out, 10)
    _same(back, 10, state)


# ---- bad input: a clear error before anything is written ---------------------------------
def test_unknown_step_writes_nothing(tmp_path, gqa_store):
    store, _, _ = gqa_store
    with pytest.raises(StepNotFoundError):
        restore(store, 99, Target(), str(tmp_path / "x"))
    assert not any(p.name.startswith("x") for p in tmp_path.iterdir())


def test_layout_the_model_cannot_take_writes_nothing(tmp_path, gqa_store):
    store, _, _ = gqa_store
    with pytest.raises(LayoutError, match="num_attention_heads"):
        restore(store, 10, Target(tp=3), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_damaged_shard_fails_the_restore_and_leaves_no_partial_directory(tmp_path, gqa_store):
    store, _, _ = gqa_store
    flip_shard_byte(store.local, 10, next(n for n in store.local.manifest(10).tensors if "linear_fc2" in n))
    with pytest.raises(IntegrityError):
        restore(store, 10, Target(2, 2, 1, "megatron"), str(tmp_path / "x"))
    assert not any(p.name.startswith("x") for p in tmp_path.iterdir())


def test_existing_output_is_refused_unless_forced(tmp_path, gqa_store):
    store, _, _ = gqa_store
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(StepExistsError):
        restore(store, 10, Target(), str(out))
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(StepExistsError, match="expected a directory holding a Megatron checkpoint"):
        restore(store, 10, Target(), str(out), force=True)  # --force never deletes what is not a checkpoint
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    restore(store, 10, Target(), str(out), force=True)  # an empty directory
    (out / "keep.txt").write_text("left in a previous restore")
    restore(store, 10, Target(), str(out), force=True)
    assert not (out / "keep.txt").exists() and (out / "latest_checkpointed_iteration.txt").exists()


def test_import_refuses_a_checkpoint_with_missing_ranks(tmp_path, gqa_store):
    store, _, _ = gqa_store
    out = restore(store, 10, Target(2, 2, 1, "megatron"), str(tmp_path / "ck")).out
    os.remove(os.path.join(out, "iter_0000010", "mp_rank_01_001", "model_optim_rng.pt"))
    with pytest.raises(FlowcheckError, match="rank"):
        import_into(make_store(tmp_path, "x"), out, 10)


def test_step_without_model_description_asks_for_arch(tmp_path):
    from flowcheck.restore.arch import load_arch

    arch = SMALL["mha_tied"]
    state = canonical_state(arch, optim=False)
    specs = tuple(TensorSpec(n, "float32", tuple(t.shape)) for n, t in state.items())
    store = make_store(tmp_path)
    store.write(Snapshot("r1", 5, StateLayout(specs), {Shard.whole(s): state[s.name].numpy() for s in specs}))
    with pytest.raises(FlowcheckError, match="--arch"):
        restore(store, 5, Target(), str(tmp_path / "x"))
    arch_file = tmp_path / "arch.yaml"
    arch_file.write_text("\n".join(f"{k}: {v if v is not None else 'null'}" for k, v in arch.to_json().items()))
    restore(store, 5, Target(2, 2, 1, "megatron"), str(tmp_path / "x"), arch=load_arch(str(arch_file)))


# ---- CLI ---------------------------------------------------------------------------------
def test_cli_import_restore_export(tmp_path):
    arch = SMALL["mha_tied"]
    state = canonical_state(arch)
    ref = write_reference(str(tmp_path / "ref.safetensors"), arch, state)
    cfg = store_config(tmp_path)
    run = CliRunner().invoke
    r = run(main, ["import", "--config", cfg, "--run", "gpt", "--step", "100", ref])
    assert r.exit_code == 0, r.output
    assert "committed step 100 of run gpt" in r.output
    out = str(tmp_path / "ck")
    # --run left out: the store holds one run
    r = run(main, ["restore", "--config", cfg, "--step", "latest", "--tp", "2", "--pp", "2",
                   "--format", "megatron", "--out", out])
    assert r.exit_code == 0, r.output
    assert "mp_rank_01_001/model_optim_rng.pt" in r.output
    # the file holds the 250 real rows only (no padding): TP2 pads to 256 with copies of row 249
    assert "vocabulary: 256 rows (vocab_size 250 + 6 padding): the step stores 250 rows, kept as stored; new rows " \
        "250..255 are copies of row 249" in r.output
    r = run(main, ["restore", "--config", cfg, "--run", "gpt", "--step", "100", "--tp", "2", "--out", out])
    assert r.exit_code == 2 and "already exists" in r.output
    r = run(main, ["restore", "--config", cfg, "--run", "gpt", "--step", "100", "--tp", "3", "--out", str(tmp_path / "z")])
    assert r.exit_code == 2 and "TP=3" in r.output and not (tmp_path / "z").exists()
    for fmt in ("safetensors", "torch"):
        r = run(main, ["export", "--config", cfg, "--run", "gpt", "--step", "100", "--format", fmt, "--no-optim",
                       "--out", str(tmp_path / f"model.{fmt}")])
        assert r.exit_code == 0, r.output
    exported = torch.load(tmp_path / "model.torch", weights_only=True)
    assert set(exported) == {n for n in state if not n.startswith("optimizer.")}
    # the exported safetensors carries the model description: it imports as is
    r = run(main, ["import", "--config", cfg, "--run", "again", "--step", "1", str(tmp_path / "model.safetensors")])
    assert r.exit_code == 0, r.output


def test_a_restored_directory_imports_as_a_branch_of_its_step(tmp_path, gqa_store):
    store, _, _ = gqa_store
    out = restore(store, 10, Target(2, 1, 1, "megatron-dist"), str(tmp_path / "ck")).out
    m = import_into(make_store(tmp_path, "resumed"), out, 11)
    assert m.producer.source == "restore"
    assert m.parent.step == 10 and m.parent.manifest_digest == store.manifest(10).digest()


@pytest.mark.parametrize("fmt", ["megatron", "megatron-dist"])
def test_transformer_engine_key_names_round_trip(tmp_path, gqa_store, fmt):
    store, state, _ = gqa_store
    out = restore(store, 10, Target(2, 2, 1, fmt, layer_spec="te"), str(tmp_path / "te")).out
    if fmt == "megatron":
        obj = torch.load(os.path.join(out, "iter_0000010", "mp_rank_00_000", "model_optim_rng.pt"), weights_only=False)
        assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in obj["model"]
        assert not any("input_layernorm" in k for k in obj["model"])
    back = make_store(tmp_path, "back")
    import_into(back, out, 10)
    _same(back, 10, state)


# ---- padded vocabularies ------------------------------------------------------------------------
def test_padding_rows_a_step_stores_restore_bit_for_bit_and_the_record_says_what_was_done(tmp_path):
    """A safetensors file with Megatron's 512 rows (300 real, padded at TP2) and a description naming the true
    vocabulary: the import keeps every row, a TP4 restore (512 rows too) writes them as stored, a TP1 restore
    (384 rows) drops the last 128 padding rows and says what that means."""
    import json

    arch = SMALL["gqa_swiglu"]
    state = canonical_state(replace(arch, padded_vocab_size=512))
    store = make_store(tmp_path)
    m = import_into(store, write_reference(str(tmp_path / "ref.safetensors"), arch, state), 10)
    assert m.scalars["extra"]["model"]["padded_vocab_size"] == 512
    _same(store, 10, state)
    rep = restore(store, 10, Target(4, 1, 1, "megatron"), str(tmp_path / "tp4"))
    assert rep.vocab.exact
    back = make_store(tmp_path, "back")
    import_into(back, rep.out, 10)
    _same(back, 10, state)
    rep = restore(store, 10, Target(1, 1, 1, "megatron-dist"), str(tmp_path / "tp1"))
    with open(os.path.join(rep.out, "flowcheck_restore.json")) as f:
        vocab = json.load(f)["vocabulary"]
    assert (vocab["stored_rows"], vocab["restored_rows"]) == (512, 384)
    assert "padding rows 384..511 are dropped; Megatron's softmax runs over every padded row, so the resumed losses " \
        "differ" in vocab["rows"] == rep.vocab.note()


def test_a_description_whose_padded_size_is_not_the_stored_rows_is_one_line_naming_both(tmp_path):
    arch = SMALL["gqa_swiglu"]
    store = make_store(tmp_path)
    ref = write_reference(str(tmp_path / "ref.safetensors"), arch, canonical_state(replace(arch, padded_vocab_size=512)))
    with pytest.raises(FlowcheckError, match=r"ref.safetensors: embedding.word_embeddings.weight: vocabulary rows: "
                                             r"expected 384, found 512; is the model description"):
        import_into(store, ref, 10, arch=replace(arch, padded_vocab_size=384))
    import_into(store, ref, 10)
    with pytest.raises(FlowcheckError, match=r"expected shape \[384, 32\], found \[512, 32\]"):
        restore(store, 10, Target(), str(tmp_path / "x"), arch=replace(arch, padded_vocab_size=384))


def test_a_plain_trainers_push_of_a_padded_embedding_restores_every_row(tmp_path):
    """A data-parallel trainer (no arch=) pushes its embedding whole, 512 rows, with a description naming only the
    true vocabulary: restore takes the rows from the step and writes them at TP2 as they are."""
    from flowcheck.torch.state import snapshot_from_torch

    arch = SMALL["gqa_swiglu"]
    state = canonical_state(replace(arch, padded_vocab_size=512), optim=False)
    store = make_store(tmp_path)
    store.write(snapshot_from_torch("r1", 3, state, rng=False, extra={"model": arch.to_json()}), "local", root=True)
    rep = restore(store, 3, Target(2, 1, 1, "megatron"), str(tmp_path / "tp2"), prefer="local")
    assert (rep.vocab.stored, rep.vocab.target) == (512, 512)
    back = make_store(tmp_path, "back")
    import_into(back, rep.out, 3)
    _same(back, 3, state)
