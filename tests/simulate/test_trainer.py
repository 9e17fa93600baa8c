"""The simulator's trainer behaves like DDP, and its truth files are what training without a wire produces."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_torch

from flowcheck.capture.mirror.job import load_job
from flowcheck.simulate import SimOptions, simulate
from flowcheck.simulate.allreduce import ring_allreduce
from flowcheck.simulate.model import GPT, MODELS
from flowcheck.simulate.run import ring_params
from flowcheck.simulate.trainer import TrainConfig, Trainer, bucket_plan


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        assert v.dtype == b[k].dtype and v.shape == b[k].shape, k
        assert v.tobytes() == b[k].tobytes(), f"{k} differs"


def test_model_sizes_and_no_buffers():
    tiny, small = GPT(MODELS["tiny"], 0), GPT(MODELS["small"], 0)
    assert 20_000 <= sum(p.numel() for p in tiny.parameters()) <= 50_000
    assert 500_000 <= sum(p.numel() for p in small.parameters()) <= 2_000_000
    assert set(tiny.state_dict()) == {n for n, _ in tiny.named_parameters()}
    assert all(p.dtype == torch.float32 for p in tiny.parameters())


def test_buckets_follow_ddp_reverse_order_never_split_and_iteration_one_is_whole():
    t = Trainer(TrainConfig(model="tiny", dp=2))
    assert t.first_plan == (tuple(reversed(t.names)),)
    assert len(t.steady_plan) >= 3
    flat = [n for b in t.steady_plan for n in b]
    assert flat == list(reversed(t.names))
    cap = 32 * 1024
    for b in t.steady_plan[:-1]:  # a bucket closes with the parameter that reaches the capacity
        sizes = [t.params[n].numel() * 4 for n in b]
        assert sum(sizes) >= cap and sum(sizes) - sizes[-1] < cap
    assert bucket_plan([("a", 10), ("b", 10), ("c", 10)], 200) == (("c", "b", "a"),)
    assert bucket_plan([("a", 10), ("b", 10), ("c", 10)], 40) == (("c",), ("b",), ("a",))


def test_job_describes_the_run(sim_dir):
    job = load_job(sim_dir.job_path)
    assert job.trains and job.nranks == 3 and job.channels == 2 and job.reduction == "avg" and job.dtype == "float32"
    t = Trainer(TrainConfig(model="tiny", dp=3, seed=7))
    assert [p.name for p in job.parameters] == t.names
    assert [b.params for b in job.first_buckets] == list(t.first_plan)
    assert [b.params for b in job.buckets] == list(t.steady_plan)
    assert job.optimizer == t.spec and job.clip_grad_norm == 1.0 and job.start_step == 0
    assert os.path.isfile(job.init) and os.path.isdir(job.resync)
    assert job.ring[1].macs == ("02:fc:5e:00:00:02",) and job.ring[1].ips == ("fe80::fc:5eff:fe00:2",)


def test_allreduce_truth_lists_every_bucket_in_wire_order(sim_dir):
    job = load_job(sim_dir.job_path)
    with open(os.path.join(sim_dir.out, "truth", "allreduces.json")) as f:
        records = json.load(f)
    plan = [(it, b, bucket) for it in range(1, 7) for b, bucket in enumerate(job.plan(it))]
    assert len(records) == len(plan) == len(sim_dir.finals)
    for k, (rec, (it, b, bucket), final) in enumerate(zip(records, plan, sim_dir.finals), start=1):
        assert (rec["index"], rec["iteration"], rec["bucket"], rec["elements"]) == (k, it, b, bucket.elements)
        assert rec["sha256"] == hashlib.sha256(final.astype("<f4").tobytes()).hexdigest()
        assert rec["channels"] == 2
    with open(os.path.join(sim_dir.out, "truth", "losses.json")) as f:
        losses = json.load(f)
    assert [len(x["losses"]) for x in losses] == [3] * 6


@pytest.mark.parametrize("optimizer,clip,proto", [("adam", 1.0, "ll"), ("sgd", None, "simple"), ("adamw", 0.05, "ll")])
def test_truth_equals_the_same_trainer_without_a_wire(tmp_path, optimizer, clip, proto):
    opts = SimOptions(out=str(tmp_path), dp=3, iters=3, optimizer=optimizer, clip=clip, proto=proto, channels=2, seed=11)
    simulate(opts)
    plain = Trainer(opts.train)
    rp = ring_params(opts)
    _same(load_file(str(tmp_path / "truth" / "step-0.safetensors")), plain.state())
    for it in range(1, 4):
        plain.iterate(it, lambda b, inputs: ring_allreduce(inputs, rp).final)
        _same(load_file(str(tmp_path / "truth" / f"step-{it}.safetensors")), plain.state())
    truth = load_file(str(tmp_path / "truth" / "step-3.safetensors"))
    if optimizer != "sgd":
        assert truth["optimizer.step.h.0.attn.qkv.weight"].item() == 3.0
        assert "optimizer.exp_avg_sq.wte.weight" in truth
    else:
        assert "optimizer.momentum_buffer.head.weight" in truth


def test_step_zero_is_the_initial_model(sim_dir):
    truth = load_file(os.path.join(sim_dir.out, "truth", "step-0.safetensors"))
    init = {n: p.detach().numpy() for n, p in GPT(MODELS["tiny"], 7).named_parameters()}
    _same(truth, init)


def test_a_replica_following_the_job_reproduces_the_truth_bit_for_bit(sim_dir):
    """What a checkpoint node does with perfectly captured allreduces (flowcheck.capture.mirror.replica)."""
    from flowcheck.capture.mirror.replica import Replica

    job = load_job(sim_dir.job_path)
    replica = Replica(job, load_torch(job.init), step=0)
    finals = iter(sim_dir.finals)
    for it in range(1, 7):
        for bucket in job.plan(it):
            replica.apply_bucket(bucket, next(finals))
        replica.finish_iteration()
        truth = load_file(os.path.join(sim_dir.out, "truth", f"step-{it}.safetensors"))
        _same(truth, {k: v.detach().numpy() for k, v in replica.state().items()})
