"""The TP/PP split rules, checked against the rules of specs/megatron.md written out directly with torch."""
from __future__ import annotations

import pytest
import torch

from flowcheck.errors import ConfigError
from flowcheck.restore.arch import LayoutError, ModelArch
from flowcheck.restore.megatron_common import cut
from flowcheck.restore.megatron_map import VocabRows, model_params, rank_tensors, stage_of_layer, tp_parts

from .conftest import SMALL, canonical_state


def _local(arch, state, tp, rank, name):
    p = next(p for p in model_params(arch) if p.name == name)
    shape, parts = tp_parts(arch, p, tp, rank)
    from flowcheck.restore.megatron_map import RankTensor

    return cut(state[name], RankTensor(p, 0, name, shape, parts))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_is_padded_per_tp_and_chunked(tp):
    arch = SMALL["gqa_swiglu"]
    state = canonical_state(arch, optim=False)
    w = state["embedding.word_embeddings.weight"]
    v_pad = arch.padded_vocab(tp)
    assert v_pad % (128 * tp) == 0 and v_pad >= arch.vocab_size
    full = torch.cat([w, w[-1:].expand(v_pad - w.shape[0], -1)])  # Megatron's converters repeat the last row
    for r in range(tp):
        assert torch.equal(_local(arch, state, tp, r, "embedding.word_embeddings.weight"), torch.chunk(full, tp, 0)[r])


@pytest.mark.parametrize("tp", [2, 4])
def test_swiglu_fc1_takes_matching_gate_and_up_halves(tp):
    arch = SMALL["gqa_swiglu"]
    state = canonical_state(arch, optim=False)
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    gate, up = torch.chunk(state[name], 2, 0)
    for r in range(tp):
        want = torch.cat([torch.chunk(gate, tp, 0)[r], torch.chunk(up, tp, 0)[r]])
        assert torch.equal(_local(arch, state, tp, r, name), want)


@pytest.mark.parametrize("tp", [2, 4])
def test_row_column_qkv_and_replicated_rules(tp):
    arch = SMALL["mha_tied"]
    state = canonical_state(arch, optim=False)
    for r in range(tp):
        for name, dim in (("decoder.layers.0.self_attention.linear_qkv.weight", 0),
                          ("decoder.layers.0.self_attention.linear_qkv.bias", 0),
                          ("decoder.layers.2.mlp.linear_fc1.weight", 0),
                          ("decoder.layers.2.mlp.linear_fc1.bias", 0),
                          ("decoder.layers.3.self_attention.linear_proj.weight", 1),
                          ("decoder.layers.3.mlp.linear_fc2.weight", 1)):
            assert torch.equal(_local(arch, state, tp, r, name), torch.chunk(state[name], tp, dim)[r]), name
        for name in ("decoder.layers.3.mlp.linear_fc2.bias", "decoder.layers.0.input_layernorm.bias",
                     "embedding.position_embeddings.weight"):
            assert torch.equal(_local(arch, state, tp, r, name), state[name]), name


def test_pipeline_and_virtual_stages_number_layers_like_megatron():
    arch = ModelArch(num_layers=8, hidden_size=16, num_attention_heads=2, vocab_size=100)
    # chunk v on stage p starts at global layer (v*PP + p) * L/(PP*VP)
    assert [stage_of_layer(arch, 2, 2, i) for i in range(8)] == [
        (0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1), (0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1)]
    first = {rt.key: rt.chunk for rt in rank_tensors(arch, 1, 2, 2, 0, 0)}
    last = {rt.key: rt.chunk for rt in rank_tensors(arch, 1, 2, 2, 0, 1)}
    assert first["embedding.word_embeddings.weight"] == 0 and "embedding.word_embeddings.weight" not in last
    assert last["decoder.final_layernorm.weight"] == 1
    # tied embeddings at PP>1: the last stage stores its own output_layer copy
    assert last["output_layer.weight"] == 1 and "output_layer.weight" not in first


def test_tied_single_stage_has_no_output_layer_and_te_names_fuse_norms():
    arch = SMALL["mha_tied"]
    keys = {rt.key for rt in rank_tensors(arch, 1, 1, 1, 0, 0, "te")}
    assert "output_layer.weight" not in keys
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_bias" in keys
    assert not any("input_layernorm" in k for k in keys)


@pytest.mark.parametrize(
    "kwargs, layout, reason",
    [
        ({}, (3, 1, 1), "num_attention_heads"),
        ({}, (1, 3, 1), "num_layers"),
        ({}, (1, 2, 4), "num_layers"),
        ({"num_query_groups": 2, "num_attention_heads": 6, "hidden_size": 48}, (4, 1, 1), "num_attention_heads"),
        ({}, (1, 1, 2), "--vpp"),
    ],
)
def test_layouts_the_model_cannot_take_are_refused_with_the_reason(kwargs, layout, reason):
    base = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 100}
    base.update(kwargs)
    with pytest.raises(LayoutError, match=reason):
        ModelArch(**base).check_layout(*layout)


def test_groups_fewer_than_tp_share_kv_heads():
    arch = ModelArch(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, vocab_size=100)
    arch.check_layout(4, 1, 1)  # 4 TP ranks share 2 KV groups: a plain chunk of the grouped rows


# ---- padded vocabularies -------------------------------------------------------------------------
def _vocab_arch(**kw) -> ModelArch:
    return ModelArch(num_layers=2, hidden_size=8, num_attention_heads=2, vocab_size=701, **kw)


def test_a_stored_padded_vocabulary_is_cut_as_stored_and_padded_to_more_rows_with_the_last_stored_one():
    arch = _vocab_arch(padded_vocab_size=768)  # stored at TP2 (or TP1): 768 rows
    emb = model_params(arch)[0]
    assert emb.shape == (768, 8)
    full = torch.randn(768, 8)
    for tp, rows in ((1, 768), (2, 768), (4, 1024), (8, 1024)):
        got = torch.cat([cut(full, next(rt for rt in rank_tensors(arch, tp, 1, 1, r, 0) if rt.key == emb.name))
                         for r in range(tp)])
        assert torch.equal(got[:768], full) and (got[768:] == full[-1]).all() and got.shape[0] == rows, tp
    wide = _vocab_arch(padded_vocab_size=1024, make_vocab_size_divisible_by=256)  # rows a TP4 job stored ...
    got = cut(torch.arange(1024.0)[:, None].expand(1024, 8), next(iter(rank_tensors(wide, 1, 1, 1, 0, 0))))
    assert got.shape[0] == 768 and torch.equal(got[:, 0], torch.arange(768.0))  # ... at TP1: padding rows dropped


def test_what_restore_does_with_the_vocabulary_rows_is_said_in_one_line():
    same = VocabRows.of(_vocab_arch(padded_vocab_size=768), 2)
    assert same.exact and same.note() == "768 rows (vocab_size 701 + 67 padding): every row as stored"
    more = VocabRows.of(_vocab_arch(padded_vocab_size=768), 4)
    assert not more.exact and "the step stores 768 rows, kept as stored; new rows 768..1023 are copies of row 767, " \
        "the last stored one" in more.note()
    assert more.note().endswith("so the resumed losses differ from a run at 768 rows")
    old = VocabRows.of(_vocab_arch(), 2)  # a step stored before padding rows were kept
    assert "only the true vocabulary (stored before" in old.note() and "copies of row 700" in old.note()
    unpadded = VocabRows.of(_vocab_arch(padded_vocab_size=701, make_vocab_size_divisible_by=1), 2)  # trained at TP1
    assert "the step stores 701 rows, kept" in unpadded.note()
    fewer = VocabRows.of(_vocab_arch(padded_vocab_size=1024), 1)
    assert "padding rows 768..1023 are dropped; Megatron's softmax" in fewer.note()
    assert same.to_json() == {"vocab_size": 701, "stored_rows": 768, "restored_rows": 768, "rows": same.note()}


def test_the_description_records_the_padded_size_only_when_known_and_refuses_one_that_cannot_be():
    assert "padded_vocab_size" not in _vocab_arch().to_json()  # older steps are described as before
    assert ModelArch.from_mapping(_vocab_arch(padded_vocab_size=768).to_json()).padded_vocab_size == 768
    with pytest.raises(ConfigError, match="padded_vocab_size: expected at least vocab_size 701, found 700"):
        _vocab_arch(padded_vocab_size=700)
    with pytest.raises(LayoutError, match="vocabulary rows: expected 768, found 1024"):
        _vocab_arch(padded_vocab_size=768).with_stored_rows(1024, "Checkpointer arch=")
