"""PyTorch state dicts <-> snapshots: exact round trip through the tiers, training continues bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flowcheck.config import LocalConfig
from flowcheck.errors import FlowcheckError
from flowcheck.tiers.local import LocalTier
from flowcheck.torch import restore_rng, snapshot_from_torch, torch_state_from_snapshot


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train(model, opt, sched, steps, seed):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        loss = model(x).pow(2).mean() + torch.rand(1).item() * 0  # torch.rand: the global RNG is part of the state
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_resume_from_stored_step_continues_bit_for_bit(tmp_path, opt_cls):
    kwargs = {"lr": 1e-2, "momentum": 0.9} if opt_cls is torch.optim.SGD else {"lr": 1e-2, "weight_decay": 0.1}
    model = _model()
    opt = opt_cls(model.parameters(), **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    _train(model, opt, sched, 5, seed=1)
    tier = LocalTier(LocalConfig(root=str(tmp_path)), "r")
    tier.write(snapshot_from_torch("r", 5, model, opt, lr_scheduler=sched))
    expected = _train(model, opt, sched, 5, seed=2)

    snap = tier.load(5)
    model_sd, opt_sd = torch_state_from_snapshot(snap)
    model2 = _model()
    model2.load_state_dict(model_sd)
    opt2 = opt_cls(model2.parameters(), **kwargs)
    opt2.load_state_dict(opt_sd)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=3, gamma=0.5)
    sched2.load_state_dict(snap.scalars.lr_scheduler)
    restore_rng(snap.scalars.rng)
    assert _train(model2, opt2, sched2, 5, seed=2) == expected
    for (n, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), n


def test_snapshot_names_optimizer_slots_canonically():
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    snap = snapshot_from_torch("r", 1, model, opt)
    names = {t.name for t in snap.layout.tensors}
    assert {"0.weight", "optimizer.exp_avg.0.weight", "optimizer.exp_avg_sq.3.bias", "optimizer.step.0.weight"} <= names
    assert snap.scalars.optimizer_step == 1
    assert snap.scalars.optimizer["param_groups"][0]["params"][0] == "0.weight"


def test_bf16_tensors_round_trip_exactly(tmp_path):
    state = {"w": torch.randn(5, 3).to(torch.bfloat16), "b": torch.arange(4, dtype=torch.int64)}
    tier = LocalTier(LocalConfig(root=str(tmp_path)), "r")
    m = tier.write(snapshot_from_torch("r", 1, state, rng=False))
    assert m.tensors["w"].dtype == "bfloat16"
    back, opt = torch_state_from_snapshot(tier.load(1))
    assert opt is None and back["w"].dtype == torch.bfloat16
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])


def test_optimizer_without_parameter_names_is_refused_clearly():
    model = _model()
    opt = torch.optim.SGD(list(model.parameters())[:2], lr=0.1)
    with pytest.raises(FlowcheckError, match="param_names"):
        snapshot_from_torch("r", 1, model.state_dict(), opt.state_dict())


def test_snapshot_data_are_zero_copy_views():
    model = _model()
    snap = snapshot_from_torch("r", 0, model, rng=False)
    arr = next(iter(snap.data.values()))
    assert np.shares_memory(arr, model[0].weight.detach().numpy())
