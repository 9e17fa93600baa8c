"""A TP=2 x PP=2 trainer's pushed shards land in the canonical index space: restore reassembles any layout."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from flowcheck.restore.arch import ModelArch
from flowcheck.restore.importer import import_into
from flowcheck.restore.megatron_common import Target, cut
from flowcheck.restore.megatron_map import model_params, rank_tensors
from flowcheck.restore.service import restore
from flowcheck.store import open_store
from flowcheck.torch.checkpointer import Checkpointer, Coordinates

from ..restore.conftest import make_store

ARCH = ModelArch(num_layers=4, hidden_size=32, num_attention_heads=8, num_query_groups=2, vocab_size=300,
                 ffn_hidden_size=64, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                 untie_embeddings_and_output_weights=False, add_bias_linear=False, max_position_embeddings=16)


class RankState:
    """What a Megatron rank's model.state_dict() gives: local keys, local (TP-cut, padded) shapes."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        return dict(self.tensors)


def test_tp_pp_ranks_push_shards_that_restore_at_other_layouts(node, tmp_path):
    """Every row the ranks hold, the vocabulary's padding rows included (300 pads to 512 at TP2 and at TP4)."""
    g = torch.Generator().manual_seed(0)
    tp, pp = 2, 2
    trained = replace(ARCH, padded_vocab_size=ARCH.padded_vocab(tp))  # the rows a TP2 trainer has
    canonical = {p.name: torch.randn(p.shape, generator=g) for p in model_params(trained)}
    ckpts = []
    for p in range(pp):
        for t in range(tp):
            local = {rt.key: cut(canonical[rt.param.name], rt) for rt in rank_tensors(trained, tp, pp, 1, t, p)}
            assert ("output_layer.weight" in local) == (p == pp - 1)  # tied at PP>1: the last stage's copy
            ck = Checkpointer(RankState(local), None, node=node.url, run="gpt", arch=ARCH,
                              coords=Coordinates(dp_rank=0, dp=1, tp_rank=t, tp=tp, pp_rank=p, pp=pp))
            ckpts.append(ck)
    for ck in ckpts:
        ck.save(1)
    for ck in ckpts:
        assert ck.flush(20), ck.stats.last_error
        ck.close()
    node.wait_step(1)
    assert node.post("/snapshot")[0] == 200
    store = open_store(node.config)
    m = store.local.manifest(1)
    assert (m.source_layout.tp, m.source_layout.pp) == (tp, pp)
    assert m.tensors["embedding.word_embeddings.weight"].global_shape == (512, 32)
    for name, t in canonical.items():  # every canonical tensor reassembles exactly (padding rows included)
        assert np.array_equal(store.read(1, name), t.numpy()), name
    # and restores at another layout
    out = restore(store, 1, Target(4, 1, 1, "megatron"), str(tmp_path / "tp4")).out
    back = make_store(tmp_path, "back")
    import_into(back, out, 1)
    for name, t in canonical.items():
        assert np.array_equal(back.read(1, name), t.numpy()), name
