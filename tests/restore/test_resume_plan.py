"""What restore writes for Megatron to resume from, without megatron: complete param groups and the LR schedule
(stored, derived from the job's args, or a placeholder with the flag that makes it safe), the counters, the
weights-only warning and flags, the refused legacy + distributed-optimizer combination, and forged values."""
from __future__ import annotations

import json
import logging
import os
import re
from types import SimpleNamespace

import pytest
import torch

from flowcheck.errors import ConfigError, FormatError, ManifestError
from flowcheck.restore.importer import import_into
from flowcheck.restore.megatron_common import Target
from flowcheck.restore.megatron_optim import decayed
from flowcheck.restore.megatron_sched import scheduler_plan
from flowcheck.restore.service import restore
from flowcheck.torch.state import snapshot_from_torch

from .conftest import ITERATION, SAMPLES, SCHEDULE, SMALL, make_store, scheduled_lr, stored_step

ARCH = SMALL["mha_tied"]  # LayerNorm and biases: both of megatron-core's groups are non-trivial
# what megatron-core 0.16.1 matches groups on, what its scheduler reads, what every Adam steps with
GROUP_KEYS = {"wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr", "default_config", "max_lr", "min_lr",
              "lr", "weight_decay", "betas", "eps", "step"}
TORCH_KEYS = {"decoupled_weight_decay", "amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused"}


def _rank_file(out: str, rank: str = "mp_rank_00") -> dict:
    return torch.load(os.path.join(out, "iter_0000010", rank, "model_optim_rng.pt"), weights_only=False)


def _common(out: str) -> dict:
    return torch.load(os.path.join(out, "iter_0000010", "common.pt"), weights_only=False)


@pytest.mark.parametrize("fmt", ["megatron", "megatron-dist"])
def test_a_pushed_step_gives_every_group_megatron_core_needs_and_its_schedule(tmp_path, fmt):
    store = make_store(tmp_path, "push")
    stored_step(store, ARCH, "push")
    rep = restore(store, ITERATION, Target(2, 1, 1, fmt), str(tmp_path / "out"))
    plan = rep.resume
    assert plan.optimizer and plan.optimizer_step == ITERATION and plan.scheduler == SCHEDULE
    assert plan.adam == "torch" and plan.sources["adam"] == "torch AdamW's keys in scalars.optimizer.param_groups"
    assert [g["wd_mult"] for g in plan.groups] == [1.0, 0.0]
    assert all(GROUP_KEYS | TORCH_KEYS | {"bias_correction"} <= set(g) for g in plan.groups)
    assert all(g["decoupled_weight_decay"] is True for g in plan.groups)  # else torch AdamW runs as L2 Adam
    assert [g["weight_decay"] for g in plan.groups] == [0.1, 0.0]
    assert plan.flags == (("--no-load-rng",) if fmt == "megatron" else ()) and not plan.warnings
    if fmt == "megatron":
        obj = _rank_file(rep.out)
        groups = obj["optimizer"]["param_groups"]
        model = obj["model"]
        order = [k for k in model if decayed(k, model[k].shape)] + [k for k in model if not decayed(k, model[k].shape)]
        assert groups[0]["params"] + groups[1]["params"] == list(range(len(order)))  # torch numbers group by group
        assert len(groups[0]["params"]) == sum(decayed(k, t.shape) for k, t in model.items())
        state = obj["optimizer"]["state"]
        assert all(state[i]["exp_avg"].shape == model[k].shape for i, k in enumerate(order))
        assert all(s["step"].item() == ITERATION for s in state.values())
        assert obj["opt_param_scheduler"] == SCHEDULE and obj["args"].consumed_train_samples == SAMPLES
        assert obj["args"].no_save_optim is False
    else:
        common = _common(rep.out)
        opt = common["optimizer"]
        assert opt["param_state_sharding_type"] == "fully_reshardable"
        assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
        for groups in (opt["param_groups"], opt["optimizer"]["param_groups"]):
            assert [g["step"] for g in groups] == [ITERATION] * 2 and not any("params" in g for g in groups)
        assert opt["state"]["common_step"].item() == opt["optimizer"]["state"]["common_step"].item() == ITERATION
        assert common["opt_param_scheduler"] == SCHEDULE and common["args"].no_save_rng is True


def test_the_job_args_alone_rebuild_the_schedule_as_megatron_lm_does(tmp_path):
    store = make_store(tmp_path, "args")
    stored_step(store, ARCH, "args")
    plan = restore(store, ITERATION, Target(1, 1, 1, "megatron"), str(tmp_path / "out")).resume
    assert plan.scheduler == SCHEDULE  # Megatron-LM asserts its own schedule equals the checkpoint's
    assert [(g["max_lr"], g["min_lr"], g["betas"], g["eps"], g["weight_decay"]) for g in plan.groups] == [
        (3e-3, 3e-4, (0.9, 0.95), 1e-8, 0.1), (3e-3, 3e-4, (0.9, 0.95), 1e-8, 0.0)]
    assert plan.sources["optimizer_step"] == "scalars.optimizer_step"


def test_a_step_without_hyperparameters_gets_a_placeholder_schedule_and_the_override_flag(gqa_store, tmp_path, caplog):
    """A safetensors import with moments only: nothing says the LR, so none is written (Megatron's scheduler sets
    it from the trainer's arguments with --override-opt_param-scheduler); betas and eps are Megatron's defaults."""
    store, _, _ = gqa_store
    with caplog.at_level(logging.WARNING, logger="flowcheck.restore"):
        plan = restore(store, 10, Target(1, 1, 1, "megatron"), str(tmp_path / "out")).resume
    assert plan.flags == ("--no-load-rng", "--override-opt_param-scheduler")
    assert plan.scheduler["max_lr"] is None and plan.scheduler["num_steps"] == 0
    assert all(g["lr"] is None and "max_lr" not in g and g["betas"] == (0.9, 0.999) for g in plan.groups)
    assert "Megatron-LM defaults: weight_decay, eps, betas" in plan.sources["param_groups"]
    assert plan.sources["consumed_train_samples"] == "unknown (0)"
    said = [r.getMessage() for r in caplog.records]
    assert any("--override-opt_param-scheduler" in m for m in said)
    assert any("starts again from the first sample" in m for m in said)
    again = make_store(tmp_path, "again")  # imported back, the placeholder still asks for the flag
    import_into(again, str(tmp_path / "out"), 10)
    assert "--override-opt_param-scheduler" in restore(again, 10, Target(), str(tmp_path / "o2")).resume.flags


@pytest.mark.parametrize("fmt", ["megatron", "megatron-dist"])
def test_the_step_goes_where_the_trainers_adam_keeps_it(gqa_store, tmp_path, fmt):
    """FusedAdam (TE / Apex: megatron-core's choice on GPU machines, and the default when nothing tells) keeps the
    step in its groups and refuses it in a parameter's state; torch AdamW needs it there. Import finds out which
    a checkpoint was written for, so a restored step restores again the same way."""
    store, _, _ = gqa_store  # a safetensors import: nothing says which Adam
    fused = restore(store, 10, Target(fmt=fmt), str(tmp_path / "fused"))
    torch_ = restore(store, 10, Target(fmt=fmt, adam="torch"), str(tmp_path / "torch"))
    assert (fused.resume.adam, torch_.resume.adam, torch_.resume.sources["adam"]) == ("fused", "torch", "asked (--adam)")
    assert fused.resume.sources["adam"].startswith("unknown: FusedAdam")
    assert all(g["bias_correction"] is True and TORCH_KEYS <= set(g) for g in fused.resume.groups)  # both Adams' keys
    for rep, adam in ((fused, "fused"), (torch_, "torch")):
        if fmt == "megatron":
            steps = ["step" in s for s in _rank_file(rep.out)["optimizer"]["state"].values()]
            assert steps and all(steps) == (adam == "torch") and any(steps) == (adam == "torch")
        else:
            opt = _common(rep.out)["optimizer"]
            assert ("common_step" in opt["state"]) == ("common_step" in opt["optimizer"]["state"]) == (adam == "torch")
            assert [g["step"] for g in opt["optimizer"]["param_groups"]] == [7, 7]  # the distributed optimizer's
        back = make_store(tmp_path, f"back_{adam}")
        import_into(back, rep.out, 10)
        again = restore(back, 10, Target(fmt=fmt), str(tmp_path / f"again-{adam}")).resume
        assert (again.adam, again.sources["adam"]) == (adam, "scalars.extra.megatron.adam")


@pytest.mark.parametrize("fmt,flags", [("megatron", ("--no-load-optim", "--no-load-rng")),
                                       ("megatron-dist", ("--no-load-optim",))])
def test_a_weights_only_step_warns_names_the_flags_and_writes_no_optimizer(tmp_path, caplog, fmt, flags):
    store = make_store(tmp_path, "w")
    stored_step(store, ARCH, "weights")
    with caplog.at_level(logging.WARNING, logger="flowcheck.restore"):
        rep = restore(store, ITERATION, Target(1, 1, 1, fmt), str(tmp_path / "out"))
    assert not rep.resume.optimizer and rep.resume.flags == flags
    warning = next(r.getMessage() for r in caplog.records if "weights only" in r.getMessage())
    assert "the step carries no optimizer state" in warning and " ".join(flags) in warning
    obj = _rank_file(rep.out) if fmt == "megatron" else _common(rep.out)
    assert "optimizer" not in obj and "opt_param_scheduler" not in obj
    assert obj["args"].no_save_optim is True and obj["args"].consumed_train_samples == SAMPLES
    with open(os.path.join(rep.out, "flowcheck_restore.json")) as f:
        record = json.load(f)["resume"]
    assert record["optimizer"] is False and record["megatron_flags"] == list(flags)


def test_no_optim_says_it_was_asked_for(tmp_path, caplog):
    store = make_store(tmp_path, "p")
    stored_step(store, ARCH, "push")
    with caplog.at_level(logging.WARNING, logger="flowcheck.restore"):
        rep = restore(store, ITERATION, Target(optim=False), str(tmp_path / "out"))
    assert not rep.resume.optimizer and "--no-load-optim" in rep.resume.flags
    assert any("--no-optim asked for weights only" in r.getMessage() for r in caplog.records)


def test_legacy_format_refuses_optimizer_state_for_the_distributed_optimizer(tmp_path):
    store = make_store(tmp_path, "p")
    stored_step(store, ARCH, "push")
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="use --format megatron-dist, or --no-optim") as err:
        restore(store, ITERATION, Target(2, 1, 1, "megatron", dist_optim=True), str(out))
    assert "\n" not in str(err.value) and not out.exists() and not list(tmp_path.glob("out.tmp-*"))
    assert not restore(store, ITERATION, Target(fmt="megatron", optim=False, dist_optim=True), str(out)).resume.optimizer
    assert restore(store, ITERATION, Target(fmt="megatron-dist", dist_optim=True), str(tmp_path / "d")).resume.optimizer


def _forged_step(tmp_path, *, groups=None, scheduler=None, megatron=None):
    """A pushed step whose scalars carry the given (possibly wrong) values."""
    store = make_store(tmp_path, "f")
    state = stored_step(make_store(tmp_path, "src"), ARCH, "push")
    model = {k: v for k, v in state.items() if not k.startswith("optimizer.")}
    every = list(range(len(model)))  # one group holding every parameter
    opt = {"state": {i: {"exp_avg": state[f"optimizer.exp_avg.{n}"], "exp_avg_sq": state[f"optimizer.exp_avg_sq.{n}"]}
                     for i, n in enumerate(model)},
           "param_groups": [dict(g, params=every) for g in groups or [{}]]}
    extra = {"model": ARCH.to_json(), "megatron": dict(megatron or {})}
    sched = None if scheduler is None else type("S", (), {"state_dict": lambda self: scheduler})()
    store.write(snapshot_from_torch("f", ITERATION, model, opt, param_names=list(model), lr_scheduler=sched, rng=False,
                                    extra=extra), "local", root=True)
    return store


@pytest.mark.parametrize("forged,field_", [
    ({"groups": [{"betas": "fast", "wd_mult": 1.0}]}, "'scalars.optimizer.param_groups[].betas'"),
    ({"megatron": {"args": {"lr": "high"}}}, "'scalars.extra.megatron.args.lr'"),
    ({"megatron": {"consumed_train_samples": -4}}, "'scalars.extra.megatron.consumed_train_samples'"),
    ({"scheduler": dict(SCHEDULE, num_steps="many")}, "'scalars.lr_scheduler.num_steps'"),
])
def test_a_stored_value_restore_cannot_use_is_a_manifest_error_naming_its_field(tmp_path, forged, field_):
    store = _forged_step(tmp_path, **forged)
    with pytest.raises(ManifestError, match=re.escape(f"manifest field {field_}: expected")):
        restore(store, ITERATION, Target(), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_decoupled_lr_group_is_refused_with_what_to_do(tmp_path):
    groups = [{"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": True}]
    store = _forged_step(tmp_path, groups=groups)
    with pytest.raises(FormatError, match="restore with --no-optim and load with --no-load-optim"):
        restore(store, ITERATION, Target(), str(tmp_path / "out"))


def test_the_step_lr_and_counters_come_from_what_a_megatron_push_stores(tmp_path):
    """A Megatron push keeps consumed_train_samples and the groups (with their step) in scalars.extra.megatron."""
    groups = [dict(g, step=ITERATION) for g in _push_like_groups()]
    store = _forged_step(tmp_path, megatron={"param_groups": groups, "opt_param_scheduler": SCHEDULE,
                                             "consumed_train_samples": SAMPLES, "iteration": ITERATION})
    plan = restore(store, ITERATION, Target(), str(tmp_path / "out")).resume
    assert plan.consumed_train_samples == SAMPLES
    assert plan.sources["consumed_train_samples"] == "scalars.extra.megatron.consumed_train_samples"
    assert plan.scheduler == SCHEDULE and plan.groups[0]["lr"] == scheduled_lr()


def _push_like_groups() -> list[dict]:
    return [{"lr": scheduled_lr(), "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1 * wd, "wd_mult": wd,
             "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False, "max_lr": 3e-3, "min_lr": 3e-4}
            for wd in (1.0, 0.0)]



@pytest.mark.parametrize("args,want", [
    # iteration-based: steps are samples (iterations x global batch); a warmup fraction of the decay steps
    ({"lr": 1e-3, "train_iters": 100, "global_batch_size": 8, "lr_decay_iters": 50, "lr_warmup_fraction": 0.1},
     {"lr_warmup_steps": 40.0, "lr_decay_steps": 400, "wd_incr_steps": 800, "min_lr": 0.0, "lr_decay_style": "linear"}),
    # sample-based
    ({"lr": 1e-3, "train_samples": 1000, "lr_warmup_samples": 30, "min_lr": 1e-5, "lr_decay_style": "WSD",
      "start_weight_decay": 0.0, "end_weight_decay": 0.1, "weight_decay_incr_style": "linear"},
     {"lr_warmup_steps": 30, "lr_decay_steps": 1000, "wd_incr_steps": 1000, "min_lr": 1e-5, "start_wd": 0.0,
      "end_wd": 0.1, "wd_incr_style": "linear"}),
])
def test_a_schedule_is_rebuilt_from_args_as_megatron_lm_builds_it(args, want):
    plan = scheduler_plan((None, ""), SimpleNamespace(step=5, run="r"), args, 123)
    assert not plan.override and plan.state["num_steps"] == 123 and plan.state["max_lr"] == 1e-3
    assert {k: plan.state[k] for k in want} == want


def test_args_that_cannot_rebuild_a_schedule_leave_a_placeholder():
    plan = scheduler_plan((None, ""), SimpleNamespace(step=5, run="r"), {"lr": 2e-4, "train_iters": 10}, 40)
    assert plan.override and plan.state["max_lr"] == 2e-4 and plan.state["num_steps"] == 40  # no global batch size


@pytest.mark.parametrize("step,adam", [(3.0, "torch"), (3, "fused")])
def test_the_distributed_optimizers_group_step_says_which_adam_saved_it(step, adam):
    """Groups carrying both Adams' keys (a restore's, loaded and saved again by Megatron) cannot tell; the step
    megatron-core 0.16.1's distributed optimizer saves can: torch AdamW's step tensor ``.item()``, FusedAdam's int."""
    from flowcheck.restore.megatron_optim import saved_groups

    group = {"params": [], "lr": 1e-3, "wd_mult": 1.0, "step": step, "foreach": None, "bias_correction": True}
    common = {"optimizer": {"param_groups": [group, dict(group, wd_mult=0.0)]},
              "param_state_sharding_type": "fully_reshardable"}
    assert saved_groups(common)[1:] == (3, adam)
