"""Fixtures of the restore suites: small model descriptions, canonical states, stores on tmp dirs."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from flowcheck import config as config_mod
from flowcheck.restore.arch import ModelArch
from flowcheck.restore.megatron_map import model_params
from flowcheck.store import open_store

SMALL = {
    # GQA + SwiGLU + RMSNorm, untied, rope
    "gqa_swiglu": ModelArch(num_layers=4, hidden_size=32, num_attention_heads=8, num_query_groups=2, vocab_size=300,
                            ffn_hidden_size=64, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                            untie_embeddings_and_output_weights=True, add_bias_linear=False, max_position_embeddings=16),
    # MHA + GELU + LayerNorm with biases, tied, learned positions
    "mha_tied": ModelArch(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=250, ffn_hidden_size=64,
                          max_position_embeddings=16),
}


def canonical_state(arch: ModelArch, seed: int = 0, optim: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for p in model_params(arch):
        state[p.name] = torch.randn(p.shape, generator=g)
        if optim:
            state[f"optimizer.exp_avg.{p.name}"] = torch.randn(p.shape, generator=g)
            state[f"optimizer.exp_avg_sq.{p.name}"] = torch.rand(p.shape, generator=g)
    return state


def write_reference(path: str, arch: ModelArch, state: dict[str, torch.Tensor], step: int | None = 7) -> str:
    meta = {k: json.dumps(v) for k, v in arch.to_json().items()}
    if step is not None:
        meta["optimizer_step"] = str(step)
    save_file(state, path, metadata=meta)
    return path


def store_config(tmp_path, run: str = "r1") -> str:
    """A config file for a store under tmp_path (local + file:// object tier)."""
    path = tmp_path / "flowcheck.yaml"
    if not path.exists():
        path.write_text(
            f"run: {run}\ntiers:\n  local:\n    root: {tmp_path}/local\n  object:\n    url: file://{tmp_path}/object\n"
        )
    return str(path)


def make_store(tmp_path, run: str = "r1"):
    cfg = config_mod.load(store_config(tmp_path))
    from dataclasses import replace

    return open_store(replace(cfg, run=run))


@pytest.fixture
def gqa_store(tmp_path):
    """A store holding step 10 of a GQA+SwiGLU model imported from a safetensors file, and its state."""
    from flowcheck.restore.importer import import_into

    arch = SMALL["gqa_swiglu"]
    state = canonical_state(arch)
    ref = write_reference(str(tmp_path / "ref.safetensors"), arch, state)
    store = make_store(tmp_path)
    import_into(store, ref, 10)
    return store, state, arch
