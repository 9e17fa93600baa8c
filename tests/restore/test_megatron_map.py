"""The TP/PP split rules, checked against the rules of specs/megatron.md written out directly with torch."""
from __future__ import annotations

import pytest
import torch

from flowcheck.restore.arch import LayoutError, ModelArch
from flowcheck.restore.megatron_common import cut
from flowcheck.restore.megatron_map import model_params, rank_tensors, stage_of_layer, tp_parts

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
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=100)
    base.update(kwargs)
    with pytest.raises(LayoutError, match=reason):
        ModelArch(**base).check_layout(*layout)


def test_groups_fewer_than_tp_share_kv_heads():
    arch = ModelArch(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, vocab_size=100)
    arch.check_layout(4, 1, 1)  # 4 TP ranks share 2 KV groups: a plain chunk of the grouped rows
