"""Updater: a replica fed allreduced buckets equals the trainer's torch optimizer bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flowcheck.capture.mirror.job import job_from_dict
from flowcheck.errors import JobError
from flowcheck.capture.mirror.replica import Replica

OPTIMIZERS = {
    "sgd": {"kind": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
    "adam": {"kind": "adam", "lr": 1e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01},
    "adamw": {"kind": "adamw", "lr": 1e-3, "weight_decay": 0.1},
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))


def _job(model, opt: dict, clip):
    names = [n for n, _ in model.named_parameters()]
    params = [{"name": n, "shape": list(p.shape)} for n, p in model.named_parameters()]
    rev = names[::-1]
    return job_from_dict({
        "ring": [{"mac": "02:00:00:00:00:01"}, {"mac": "02:00:00:00:00:02"}], "parameters": params,
        "buckets": {"first": [rev], "steady": [rev[:2], rev[2:]]}, "optimizer": opt, "clip_grad_norm": clip,
    })


IMPL_KW = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _torch_optimizer(model, spec: dict):
    kw = {k: v for k, v in spec.items() if k not in ("kind", "impl")}
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[spec["kind"]]
    return cls(model.parameters(), **IMPL_KW[spec.get("impl", "single")], **kw)


@pytest.mark.parametrize("impl", ["single", "foreach", "fused"])
@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_replica_matches_trainer_bit_for_bit(kind, clip, impl):
    model = _model()
    spec = {**OPTIMIZERS[kind], "impl": impl}
    job = _job(model, spec, clip)
    replica = Replica(job, {n: p.detach().clone() for n, p in model.named_parameters()}, step=0)
    opt = _torch_optimizer(model, spec)
    params = dict(model.named_parameters())
    rng = np.random.default_rng(3)
    for it in range(1, 6):
        for bucket in job.plan(it):
            flat = rng.standard_normal(bucket.elements).astype(np.float32)
            off = 0
            for name in bucket.params:  # the trainer's DDP copies the allreduced bucket into .grad
                p = params[name]
                p.grad = torch.from_numpy(flat[off:off + p.numel()].copy()).view_as(p)
                off += p.numel()
            replica.apply_bucket(bucket, flat)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        replica.finish_iteration()
    assert replica.step == 5
    state = replica.state()
    for name, p in params.items():
        assert torch.equal(state[name].view(torch.int32), p.detach().view(torch.int32)), name
        for slot, v in opt.state[p].items():
            assert torch.equal(state[f"optimizer.{slot}.{name}"], v), (slot, name)


def test_replica_resumes_from_a_state_with_optimizer_tensors():
    model = _model()
    job = _job(model, OPTIMIZERS["adamw"], None)
    opt = _torch_optimizer(model, OPTIMIZERS["adamw"])
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    replica = Replica(job, {n: p.detach() for n, p in model.named_parameters()}, step=0)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = {p: n for n, p in model.named_parameters()}
    for p, slots in opt.state.items():
        for slot, v in slots.items():
            state[f"optimizer.{slot}.{names[p]}"] = v.clone()
    replica = Replica(job, state, step=1)
    assert int(replica.state()[f"optimizer.step.{names[next(iter(opt.state))]}"]) == 1


def test_replica_refuses_a_job_that_cannot_train_and_a_wrong_initial_state():
    model = _model()
    job = _job(model, OPTIMIZERS["sgd"], None)
    with pytest.raises(JobError, match="missing"):
        Replica(job, {}, 0)
    bad = {n: torch.zeros(3) for n, _ in model.named_parameters()}
    with pytest.raises(JobError, match="shape"):
        Replica(job, bad, 0)
    decode_only = job_from_dict({"ring": [{"mac": "02:00:00:00:00:01"}, {"mac": "02:00:00:00:00:02"}],
                                 "buckets": {"steady": [10]}})
    with pytest.raises(JobError, match="lacks"):
        Replica(decode_only, {}, 0)
