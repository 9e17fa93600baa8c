"""Fixtures of the restore suites: small model descriptions, canonical states, stores on tmp dirs."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from flowcheck import config as config_mod
from flowcheck.restore.arch import ModelArch
from flowcheck.restore.megatron_map import model_params
from flowcheck.restore.megatron_optim import decayed
from flowcheck.state import ParallelLayout
from flowcheck.store import open_store
from flowcheck.torch.state import snapshot_from_torch

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


def same_or_padded(got: np.ndarray, want: np.ndarray) -> bool:
    """``got`` is ``want`` bit for bit, or — a vocabulary tensor stored without Megatron's padding rows, restored
    (padded for the layout) and imported back with them — ``want`` followed by copies of its last row."""
    if got.shape != want.shape and got.shape[1:] == want.shape[1:] and got.shape[0] > want.shape[0]:
        rows = want.shape[0]
        return bool(np.array_equal(got[:rows], want) and (got[rows:] == want[-1]).all())
    return bool(np.array_equal(got, want))


def store_config(tmp_path, run: str = "r1") -> str:
    """A config file for a store under tmp_path (local + file:// object tier)."""
    path = tmp_path / "flowcheck.yaml"
    if not path.exists():
        path.write_text(
            f"run: {run}\ntiers:\n  local:\n    root: {tmp_path}/local\n  object:\n    url: file://{tmp_path}/object\n"
        )
    return str(path)


def make_store(tmp_path, run: str = "r1", object_url: str | None = None):
    """The store of ``store_config(tmp_path)``; ``object_url`` replaces its ``file://`` object tier."""
    cfg = config_mod.load(store_config(tmp_path))
    from dataclasses import replace

    if object_url is not None:
        cfg = replace(cfg, tiers=replace(cfg.tiers, object=replace(cfg.tiers.object, url=object_url)))
    return open_store(replace(cfg, run=run))


def gqa(tmp_path, object_url: str | None = None):
    """(store, state, arch): a store holding step 10 of a GQA+SwiGLU model imported from a safetensors file."""
    from flowcheck.restore.importer import import_into

    arch = SMALL["gqa_swiglu"]
    state = canonical_state(arch)
    ref = write_reference(str(tmp_path / "ref.safetensors"), arch, state)
    store = make_store(tmp_path, object_url=object_url)
    import_into(store, ref, 10)
    return store, state, arch


@pytest.fixture
def gqa_store(tmp_path):
    """A store holding step 10 of a GQA+SwiGLU model imported from a safetensors file, and its state."""
    return gqa(tmp_path)


# ---- a step a Megatron job pushed (tests of what restore writes for resuming) -------------------------
# the trainer's Megatron-LM arguments; the stored step is iteration 10 of this job (global batch 4: 40 samples)
TRAIN = {"lr": 3e-3, "min_lr": 3e-4, "lr_decay_style": "cosine", "lr_warmup_iters": 2, "train_iters": 20,
         "global_batch_size": 4, "weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8}
ITERATION, SAMPLES = 10, 40
SCHEDULE = {"max_lr": 3e-3, "lr_warmup_steps": 8, "num_steps": SAMPLES, "lr_decay_style": "cosine",
            "lr_decay_steps": 80, "min_lr": 3e-4, "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant",
            "wd_incr_steps": 80}


def scheduled_lr() -> float:
    """OptimizerParamScheduler.get_lr for SCHEDULE: cosine decay after warmup, in samples."""
    ratio = (SAMPLES - 8) / (80 - 8)
    return 3e-4 + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (3e-3 - 3e-4)


def stored_step(store, arch: ModelArch, kind: str, seed: int = 3) -> dict[str, torch.Tensor]:
    """Commit step ITERATION as a pushing Megatron trainer would ("push": its param groups, scheduler and args),
    as a job that left only its args ("args"), or without optimizer state ("weights")."""
    state = canonical_state(arch, seed, optim=kind != "weights")
    params = model_params(arch)
    # torch numbers parameters group after group: the decayed ones first, as megatron-core's groups
    names = [p.name for p in params if decayed(p.name, p.shape)] + [p.name for p in params if not decayed(p.name, p.shape)]
    model = {n: state[n] for n in names}
    optimizer = None
    if kind != "weights":
        step = torch.tensor(float(ITERATION))
        slots = {i: {"exp_avg": state[f"optimizer.exp_avg.{n}"], "exp_avg_sq": state[f"optimizer.exp_avg_sq.{n}"],
                     "step": step} for i, n in enumerate(names)}
        decays = sum(decayed(p.name, p.shape) for p in params)
        optimizer = {"state": slots, "param_groups": _push_groups(decays, len(names)) if kind == "push" else [
            {"params": list(range(len(names)))}]}
    extra = {"model": arch.to_json(), "megatron": {"args": dict(TRAIN, consumed_train_samples=SAMPLES)}}
    sched = SimpleNamespace(state_dict=lambda: dict(SCHEDULE)) if kind == "push" else None
    snap = snapshot_from_torch(store.config.run, ITERATION, model, optimizer, param_names=names, lr_scheduler=sched,
                               rng=False, extra=extra, source_layout=ParallelLayout(tp=1, pp=1, dp=4))
    store.write(snap, "local", root=True)
    return state


def _push_groups(decays: int, count: int) -> list[dict]:
    groups = []
    for wd_mult, members in ((1.0, list(range(decays))), (0.0, list(range(decays, count)))):
        groups.append({"params": members, "lr": scheduled_lr(), "betas": (0.9, 0.95), "eps": 1e-8,
                       "weight_decay": 0.1 * wd_mult, "wd_mult": wd_mult, "lr_mult": 1.0, "is_expert_parallel": False,
                       "is_decoupled_lr": False, "default_config": True, "max_lr": 3e-3, "min_lr": 3e-4,
                       "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                       "differentiable": False, "fused": None, "decoupled_weight_decay": True})
    return groups
