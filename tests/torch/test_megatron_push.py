"""What a Megatron rank pushes (flowcheck/torch/megatron.py): flat distributed-optimizer ranges become boxes of the
canonical tensors that tile them exactly, and virtual-pipeline model chunks push and restore like any layout."""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from flowcheck.restore.arch import ModelArch
from flowcheck.restore.megatron_common import Target, cut
from flowcheck.restore.megatron_map import model_params, rank_tensors
from flowcheck.restore.service import restore

from flowcheck.errors import ConfigError
from flowcheck.store import open_store
from flowcheck.torch.checkpointer import Checkpointer, Coordinates
from flowcheck.torch.megatron import flat_boxes, place_range
from tests.capture.conftest import node, node_token  # noqa: F401 - fixtures
from tests.restore.conftest import make_store

# every TP rule: vocab with padding rows (300 -> 512 at TP2), qkv with groups, gated fc1, row-parallel, replicated
ARCH = ModelArch(num_layers=4, hidden_size=24, num_attention_heads=4, num_query_groups=2, vocab_size=300,
                 ffn_hidden_size=40, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                 untie_embeddings_and_output_weights=True, add_bias_linear=False, max_position_embeddings=16)


@pytest.mark.parametrize("seed", range(40))
def test_flat_boxes_are_contiguous_runs_that_tile_the_range_in_order(seed):
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 3)))
    n = math.prod(shape)
    start = rng.randint(0, n - 1)
    end = rng.randint(start + 1, n)
    flat = np.arange(n).reshape(shape)
    got = []
    for offsets, sizes in flat_boxes(shape, start, end):
        box = flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
        assert list(box) == list(range(box[0], box[0] + box.size))  # one run of the flattened tensor
        got.extend(box)
    assert got == list(range(start, end))
    assert flat_boxes(shape, start, start) == []


@pytest.mark.parametrize("tp", [1, 2])
def test_dp_ranges_of_every_tp_rank_tile_each_canonical_tensor_exactly_once(tp):
    """Cut each rank's local tensor at random points (the DP ranks' bucket ranges): the pieces place_range makes
    rebuild the canonical tensor, each element once, and padding rows of the vocabulary are never sent."""
    g = torch.Generator().manual_seed(tp)
    rng = random.Random(tp)
    canonical = {p.name: torch.randn(p.shape, generator=g) for p in model_params(ARCH)}
    rebuilt = {n: torch.zeros_like(t) for n, t in canonical.items()}
    count = {n: torch.zeros_like(t, dtype=torch.int64) for n, t in canonical.items()}
    for t in range(tp):
        for rt in rank_tensors(ARCH, tp, 1, 1, t, 0):
            if rt.param.role == "replicated" and t != 0:
                continue  # TP replicas are sent by TP rank 0 (MegatronRank._sends)
            flat = cut(canonical[rt.param.name], rt).reshape(-1)
            cuts = sorted({0, flat.numel(), *(rng.randrange(flat.numel()) for _ in range(3))})
            for start, end in itertools.pairwise(cuts):
                for name, offsets, _, view in place_range(rt.param.name, "local", rt, start, end):
                    piece = view(flat[start:end])
                    box = tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))
                    rebuilt[name][box] = piece
                    count[name][box] += 1
    for name, want in canonical.items():
        assert (count[name] == 1).all(), name
        assert torch.equal(rebuilt[name], want), name


class RankState:
    """What one Megatron model chunk's state_dict() gives: local keys, local (TP-cut, padded) shapes."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        return dict(self.tensors)


def test_virtual_pipeline_chunks_push_and_restore_at_another_layout(node, tmp_path):  # noqa: F811 - fixture
    """Every row the ranks hold is pushed, the vocabulary's 212 padding rows (each its own values) included; TP1 pads
    to 384 rows, so restore there keeps the first 384."""
    g = torch.Generator().manual_seed(0)
    tp, pp, vpp = 2, 2, 2
    trained = replace(ARCH, padded_vocab_size=ARCH.padded_vocab(tp))  # the rows a TP2 trainer has
    canonical = {p.name: torch.randn(p.shape, generator=g) for p in model_params(trained)}
    ckpts = []
    for p in range(pp):
        for t in range(tp):
            chunks = [{} for _ in range(vpp)]
            for rt in rank_tensors(trained, tp, pp, vpp, t, p):
                chunks[rt.chunk][rt.key] = cut(canonical[rt.param.name], rt)
            coords = Coordinates(tp_rank=t, tp=tp, pp_rank=p, pp=pp, vpp=vpp)
            ckpts.append(Checkpointer([RankState(c) for c in chunks], None, node=node.url, run="gpt", arch=ARCH,
                                      coords=coords))
    for ck in ckpts:
        ck.save(1)
    for ck in ckpts:
        assert ck.flush(20), ck.stats.last_error
        ck.close()
    node.wait_step(1)
    assert node.post("/snapshot")[0] == 200
    store = open_store(node.config)
    assert store.local.manifest(1).source_layout.vpp == vpp
    for name, t in canonical.items():
        assert np.array_equal(store.read(1, name), t.numpy()), name
    out = restore(store, 1, Target(1, 1, 1, "megatron"), str(tmp_path / "tp1")).out
    back = make_store(tmp_path, "back")
    from flowcheck.restore.importer import import_into

    import_into(back, out, 1)
    for p in model_params(trained):
        rows = ARCH.padded_vocab(1) if p.role == "vocab" else None
        assert np.array_equal(back.read(1, p.name), canonical[p.name][:rows].numpy()), p.name


def test_a_model_whose_chunks_do_not_match_the_virtual_pipeline_is_refused_at_construction():
    with pytest.raises(ConfigError, match="1 chunk.*virtual pipeline size is 2"):
        Checkpointer(RankState({}), None, node="tcp://127.0.0.1:1", run="gpt", arch=ARCH,
                     coords=Coordinates(pp=2, vpp=2))
