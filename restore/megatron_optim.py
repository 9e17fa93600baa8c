"""What Megatron resumes from besides tensors: complete param groups, the LR scheduler's state, the step and data
counters — each taken from the stored step when it carries it, else derived, and said where from.

megatron-core 0.16.1 loads optimizer state by replacing each live param group with the saved one
(``torch.optim.Optimizer.load_state_dict``) after matching groups on ``param_group_identifier_keys``
(wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr): a key left out of a saved group is a key the optimizer
loses (``KeyError: 'betas'`` at the next step, torch AdamW falling back to L2 weight decay).  What a stored step
may carry, each read in this order (push and import write them; see ``resume_plan``):

- param groups: ``scalars.optimizer.param_groups`` or ``scalars.extra.megatron.param_groups``, whichever has
  Megatron's keys (wd_mult ...): the trainer's live groups without ``params``; missing values come from the args,
  then Megatron-LM's defaults;
- schedule: ``scalars.lr_scheduler`` when it is Megatron's ``OptimizerParamScheduler.state_dict()``, else
  ``scalars.extra.megatron.opt_param_scheduler``, else rebuilt from the args (megatron_sched.py);
- ``scalars.extra.megatron.args``: the job's Megatron-LM arguments (lr, min_lr, adam_beta1/2, adam_eps,
  weight_decay, lr_decay_style, lr_warmup_*, lr_decay_*, train_iters / train_samples, global_batch_size, ...);
- data position: ``scalars.extra.megatron.consumed_train_samples`` (and ``consumed_valid_samples``), else the
  same in the args;
- Adam's step: ``scalars.optimizer_step``, else the groups' ``step``, else the iteration (the step number);
- which Adam (``adam_of``): the non-distributed optimizers hand their state to it whole, and the two disagree on
  the step: torch AdamW needs it in every parameter's state, Transformer Engine's FusedAdam refuses it there
  (its ``load_state_dict`` knows only exp_avg, exp_avg_sq, master_param) and keeps it in the groups.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from flowcheck.errors import FormatError
from flowcheck.manifest import Manifest
from flowcheck.restore.megatron_sched import DEFAULTS, FROM_ARGS, SchedulerPlan, arg_number, counters, scheduler_plan
from flowcheck.restore.source import MEGATRON_KEY, bad_field, megatron_extra

# megatron-core's optimizer.param_group_identifier_keys: how a saved group finds its live group
IDENTITY = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
WD_MULTS = (1.0, 0.0)  # the groups _get_param_groups builds for a GPT model, in its order: decayed, then not
# what every group of megatron-core 0.16.1 carries besides its hyper-parameters, with both Adams' own keys (each
# ignores the other's): the saved group replaces the live one whole, and torch AdamW without
# decoupled_weight_decay runs as L2-decay Adam, FusedAdam without bias_correction stops with a KeyError
_FIXED = {"lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False, "default_config": True,
          "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
          "fused": None, "decoupled_weight_decay": True, "bias_correction": True}
# Megatron-LM's argument defaults for a group's hyper-parameters (arguments.py)
_ARG_DEFAULTS = {"adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8, "weight_decay": 0.01}
_HYPER = ("lr", "max_lr", "min_lr", "weight_decay", "betas", "eps")


def decayed(key: str, shape: tuple[int, ...]) -> bool:
    """megatron-core's standard override: biases and 1-D parameters (norms) get no weight decay (wd_mult 0)."""
    return len(shape) > 1 and not key.endswith(".bias")


@dataclass(frozen=True)
class ResumePlan:
    """The non-tensor state a restored checkpoint resumes from, where each part came from, and how to load it."""

    consumed_train_samples: int
    consumed_valid_samples: int
    optimizer_step: int | None  # None: no optimizer state is written (weights only)
    adam: str  # fused: the step only in the groups; torch: also in every parameter's state
    groups: tuple[dict[str, Any], ...]  # complete param groups in WD_MULTS order, without 'params'
    scheduler: dict[str, Any] | None  # OptimizerParamScheduler.state_dict()
    sources: dict[str, str]  # part -> where it came from
    flags: tuple[str, ...]  # Megatron-LM arguments the trainer must add to load the checkpoint
    warnings: tuple[str, ...]

    @property
    def optimizer(self) -> bool:
        return self.optimizer_step is not None


def resume_plan(m: Manifest, fmt: str, optimizer: bool, why_not: str = "", adam: str | None = None) -> ResumePlan:
    """The plan for step ``m`` written in ``fmt`` (megatron | megatron-dist), with optimizer state or not
    (``why_not`` says why not: the step has none, or the user asked for weights only), for the Adam ``adam``
    (None: as the stored step's optimizer was)."""
    extra = megatron_extra(m)
    args = extra.get("args") or {}
    stored_sched = _stored_scheduler(m, extra)
    count = counters(m, extra, stored_sched[0])
    sources, warnings = dict(count.sources), list(count.warnings)
    flags = ["--no-load-rng"] if fmt == "megatron" else []  # torch_dist: args.no_save_rng tells Megatron itself
    if not optimizer:
        flags.insert(0, "--no-load-optim")
        warnings.append(f"step {m.step}: {why_not or 'no optimizer state'}: the checkpoint holds model weights only; "
                        f"start Megatron with {' '.join(flags)} (it then loads neither optimizer state nor the "
                        "learning-rate schedule's position)")
        return ResumePlan(count.train, count.valid, None, "", (), None, sources, tuple(flags), tuple(warnings))
    sched = scheduler_plan(stored_sched, m, args, count.train)
    sources["lr_scheduler"] = sched.source
    if sched.override:
        flags.append("--override-opt_param-scheduler")
        warnings.append(f"step {m.step}: {sched.source}; start Megatron with --override-opt_param-scheduler so it "
                        "uses its own schedule arguments (it still takes num_steps from the checkpoint)")
    stored, where = _stored_groups(m, extra)
    step, sources["optimizer_step"] = _optimizer_step(m, stored)
    adam, sources["adam"] = (adam, "asked (--adam)") if adam else adam_of(m, extra, stored, where)
    groups, sources["param_groups"] = _groups(m, stored, where, args, sched, step)
    return ResumePlan(count.train, count.valid, step, adam, groups, sched.state, sources, tuple(flags),
                      tuple(warnings))


def adam_of(m: Manifest, extra: dict[str, Any], stored: list[dict[str, Any]], where: str) -> tuple[str, str]:
    """The Adam the stored step's optimizer was: as import found it (where the step sat), else told by its groups'
    keys when they are one Adam's only (torch's ``foreach``, FusedAdam's ``bias_correction``; restore writes
    both), else FusedAdam, megatron-core's choice on GPU machines."""
    found = extra.get("adam")
    if found is not None:
        if found not in ("fused", "torch"):
            raise bad_field(m, f"extra.{MEGATRON_KEY}.adam", "'fused' or 'torch'", found)
        return found, f"scalars.extra.{MEGATRON_KEY}.adam"
    torch_keys, fused_keys = (bool(stored) and all(key in g for g in stored) for key in ("foreach", "bias_correction"))
    if torch_keys != fused_keys:
        return ("torch", f"torch AdamW's keys in {where}") if torch_keys else ("fused", f"FusedAdam's keys in {where}")
    return "fused", "unknown: FusedAdam (Transformer Engine / Apex), megatron-core's choice where either is installed"


# ---- what the step carries ------------------------------------------------------------------
def _stored_scheduler(m: Manifest, extra: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    own = m.scalars.get("lr_scheduler")
    if isinstance(own, dict) and "num_steps" in own and ("max_lr" in own or "start_lr" in own):
        return own, "scalars.lr_scheduler"
    if extra.get("opt_param_scheduler"):
        return extra["opt_param_scheduler"], f"scalars.extra.{MEGATRON_KEY}.opt_param_scheduler"
    return None, ""


def _stored_groups(m: Manifest, extra: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The stored groups, Megatron's (with wd_mult) first: a trainer may keep its torch groups in one place and
    Megatron's in the other."""
    found = [(groups, where) for groups, where in (
        ((m.scalars.get("optimizer") or {}).get("param_groups"), "scalars.optimizer.param_groups"),
        (extra.get("param_groups"), f"scalars.extra.{MEGATRON_KEY}.param_groups")) if groups]
    found.sort(key=lambda f: not any("wd_mult" in g or "pre_wd_mult" in g for g in f[0]))
    return found[0] if found else ([], "")


def _optimizer_step(m: Manifest, stored: list[dict[str, Any]]) -> tuple[int, str]:
    step = m.scalars.get("optimizer_step")
    if step is not None:
        return step, "scalars.optimizer_step"
    in_groups = {g.get("step") for g in stored if isinstance(g.get("step"), int) and not isinstance(g["step"], bool)}
    if len(in_groups) == 1:
        return in_groups.pop(), "the stored param groups' step"
    return m.step, "the iteration (Megatron steps the optimizer once per iteration; skipped steps are not counted)"


# ---- param groups -------------------------------------------------------------------------------
def _groups(m: Manifest, stored: list[dict[str, Any]], where: str, args: dict[str, Any], sched: SchedulerPlan,
            step: int) -> tuple[tuple[dict[str, Any], ...], str]:
    """One complete group per WD_MULTS entry: stored values first, then the job's args, then Megatron's defaults."""
    matched = _match(m, stored, where)
    groups, filled = [], {}
    for wd_mult, base in zip(WD_MULTS, matched):
        group, origin = _complete(m, base, wd_mult, args, sched)
        group.update(wd_mult=wd_mult, step=step)
        _check_group(m, group, origin, where)
        groups.append(group)
        for key, came in origin.items():
            if key not in filled.setdefault(came, []):
                filled[came].append(key)
    parts = [f"stored ({where})"] if filled.pop("stored", None) else []
    parts += [f"{came}: {', '.join(keys)}" for came, keys in filled.items()]
    return tuple(groups), "; ".join(parts)


def _match(m: Manifest, stored: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """The stored group each target group takes its values from (empty: none stored)."""
    if not stored:
        return [{} for _ in WD_MULTS]
    if not any("wd_mult" in g or "pre_wd_mult" in g for g in stored):
        return [stored[0] for _ in WD_MULTS]  # a plain torch optimizer's groups: the first one's hyper-parameters
    by_key = {_identity(g): g for g in stored}
    wanted = [(wd, 1.0, False, False) for wd in WD_MULTS]
    unknown = [k for k in by_key if k not in wanted]
    if unknown:
        raise FormatError(
            f"step {m.step}: {where} holds a group with {dict(zip(IDENTITY, unknown[0]))}; restore writes the two "
            f"groups megatron-core builds for a GPT model without decoupled LR or experts "
            f"({[dict(zip(IDENTITY, k)) for k in wanted]}) — restore with --no-optim and load with --no-load-optim")
    return [by_key.get(k) or by_key[next(iter(by_key))] for k in wanted]


def _identity(group: dict[str, Any]) -> tuple:
    defaults = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
    return tuple(group.get(k, group.get(f"pre_{k}", defaults[k])) for k in IDENTITY)


def _complete(m: Manifest, base: dict[str, Any], wd_mult: float, args: dict[str, Any],
              sched: SchedulerPlan) -> tuple[dict[str, Any], dict[str, str]]:
    group = {k: v for k, v in base.items() if k not in ("params", "param_names", "step")}
    origin: dict[str, str] = {k: "stored" for k in _HYPER if k in group}
    if _identity(base)[0] != wd_mult and _real(group.get("weight_decay")):
        group["weight_decay"] *= wd_mult  # another group's values (none stored for this one): its decay, scaled

    def fill(key: str, value: Any, came: str) -> None:
        if key not in group and value is not None:
            group[key], origin[key] = value, came

    fill("max_lr", sched.max_lr, sched.came)
    fill("min_lr", sched.min_lr, sched.came)
    fill("lr", group.get("max_lr"), origin.get("max_lr", FROM_ARGS))  # Megatron's scheduler sets it on load
    decay, eps = _arg(m, args, "weight_decay"), _arg(m, args, "adam_eps")
    fill("weight_decay", decay[0] * wd_mult, decay[1])
    fill("eps", eps[0], eps[1])
    b1, b2 = _arg(m, args, "adam_beta1"), _arg(m, args, "adam_beta2")
    fill("betas", (b1[0], b2[0]), FROM_ARGS if FROM_ARGS in (b1[1], b2[1]) else b1[1])
    if isinstance(group.get("betas"), list):
        group["betas"] = tuple(group["betas"])
    for key, value in _FIXED.items():
        group.setdefault(key, value)
    group.setdefault("lr", None)  # unknown: Megatron's scheduler sets it on load (--override-opt_param-scheduler)
    return group, origin


def _arg(m: Manifest, args: dict[str, Any], name: str) -> tuple[float, str]:
    value = arg_number(m, args, name)
    return (value, FROM_ARGS) if value is not None else (_ARG_DEFAULTS[name], DEFAULTS)


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_group(m: Manifest, group: dict[str, Any], origin: dict[str, str], where: str) -> None:
    """Values torch and Megatron compute with must be numbers: a forged manifest stops here, not in the trainer."""
    def field_(key: str) -> str:
        came = origin.get(key)
        return f"{where.removeprefix('scalars.')}[].{key}" if came == "stored" else f"extra.{MEGATRON_KEY}.args"

    for key in ("lr", "max_lr", "min_lr", "weight_decay", "eps"):
        value = group.get(key)
        if value is not None and not _real(value):
            raise bad_field(m, field_(key), "a number", value)
    betas = group.get("betas")
    if not (isinstance(betas, tuple) and len(betas) == 2 and all(_real(b) for b in betas)):
        raise bad_field(m, field_("betas"), "a list of two numbers", betas)


# ---- reading megatron-core's groups back (import) -------------------------------------------------
def group_members(order: list, groups: list[dict[str, Any]], where: str) -> list[list]:
    """The rank's tensors of each saved param group, in the group's order: megatron-core's groups split on weight
    decay (wd_mult 0: biases and 1-D parameters), each in named_parameters() order; one group holds all."""
    if len(groups) == 1:
        split = [order]
    else:
        mults = [g.get("wd_mult", g.get("pre_wd_mult")) for g in groups]
        if len(groups) != 2 or sorted(m != 0 for m in mults if m is not None) != [False, True]:
            raise FormatError(f"{where}: expected megatron-core's two optimizer param groups (weight-decayed, wd_mult "
                              f"1.0; not decayed, 0.0) or one, found {len(groups)} with wd_mult {mults}: which "
                              "parameters each holds is unknown (decoupled LR and expert groups are not supported)")
        split = [[rt for rt in order if decayed(rt.key, rt.shape) == (m != 0)] for m in mults]
    for group, members in zip(groups, split):
        if len(group["params"]) != len(members):
            raise FormatError(f"{where}: an optimizer param group has {len(group['params'])} parameters, the model rank "
                              f"has {len(members)} for it; is the model description (args / --arch) the model's?")
    return split


def json_group(group: dict[str, Any]) -> dict[str, Any]:
    """A saved group as JSON (its ``params`` index list dropped; what JSON cannot hold becomes null)."""
    return json.loads(json.dumps({k: v for k, v in group.items() if k != "params"}, default=lambda o: None))


def saved_groups(opt: Any) -> tuple[list[dict[str, Any]] | None, int | None, str | None]:
    """(param groups as JSON, optimizer step, Adam) of a torch_dist checkpoint's common ``optimizer``, in the form
    whichever megatron-core optimizer saved it: the distributed optimizer (``optimizer.param_groups`` with
    ``step``), FP32Optimizer (``param_groups``, and ``state.common_step`` with torch AdamW) or
    Float16OptimizerWithFloat16Params (those under ``optimizer``).  The distributed optimizer's state has no
    step of its own in either Adam; its groups' step tells them apart: torch AdamW's per-parameter step tensor read
    back (``.item()``, a float), FusedAdam's group step (``int``)."""
    if not isinstance(opt, dict):
        return None, None, None
    inner = opt.get("optimizer") if isinstance(opt.get("optimizer"), dict) else {}
    groups = inner.get("param_groups") or opt.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups) or not groups:
        return None, None, None
    steps = {int(g["step"]) for g in groups if isinstance(g.get("step"), (int, float, torch.Tensor))}
    state = opt.get("state") if isinstance(opt.get("state"), dict) else inner.get("state")
    common = state.get("common_step") if isinstance(state, dict) else None
    if isinstance(common, (int, float, torch.Tensor)):
        steps.add(int(common))
    adam = ("torch" if common is not None else "fused") if isinstance(state, dict) else _adam_of_step(groups)
    return [json_group(g) for g in groups], (steps.pop() if len(steps) == 1 else None), adam


def _adam_of_step(groups: list[dict[str, Any]]) -> str | None:
    kinds = {type(g["step"]) for g in groups if g.get("step") is not None}
    return {float: "torch", int: "fused"}.get(kinds.pop()) if len(kinds) == 1 else None
