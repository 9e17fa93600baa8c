"""Megatron's learning-rate schedule and data position for a restored step: stored, or derived from the job's args
as Megatron-LM derives them, so a resumed run continues at the same learning rate and the same sample.

Megatron-LM counts its scheduler in *samples*: every iteration steps it by the global batch size, so
``num_steps`` equals ``args.consumed_train_samples``; it checks a loaded schedule against the one its own
arguments build (``--use-checkpoint-opt_param-scheduler`` is off by default), so a derived schedule must be
built exactly as ``megatron.training.training.get_optimizer_param_scheduler`` builds it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowcheck.manifest import Manifest
from flowcheck.restore.source import MEGATRON_KEY, bad_field

ARGS = f"scalars.extra.{MEGATRON_KEY}.args"
FROM_ARGS, DEFAULTS, FROM_SCHEDULER = f"from {ARGS}", "Megatron-LM defaults", "from the stored scheduler"
_NUMBERS = ("max_lr", "min_lr", "lr_warmup_steps", "num_steps", "lr_decay_steps", "start_wd", "end_wd", "wd_incr_steps")
_STYLES = ("lr_decay_style", "wd_incr_style")


@dataclass(frozen=True)
class Counters:
    """Where the resumed run stands in its data: Megatron-LM restores these from the checkpoint's ``args``."""

    train: int  # args.consumed_train_samples
    valid: int  # args.consumed_valid_samples
    sources: dict[str, str]
    warnings: tuple[str, ...]


@dataclass(frozen=True)
class SchedulerPlan:
    """The ``opt_param_scheduler`` to write; ``override``: only num_steps is known (the trainer must pass
    --override-opt_param-scheduler); ``max_lr``/``min_lr`` for param groups that carry none (None: unknown)."""

    state: dict[str, Any]
    source: str
    override: bool
    max_lr: float | None
    min_lr: float | None
    came: str  # where max_lr/min_lr came from, as the param-group source names it


def counters(m: Manifest, extra: dict[str, Any], stored: dict[str, Any] | None) -> Counters:
    """consumed_train_samples: as pushed or imported, else the stored schedule's num_steps, else iteration x global
    batch size (a constant batch); consumed_valid_samples as pushed or imported, else 0."""
    args = extra.get("args") or {}
    valid, valid_from = _stored_count(m, extra, "consumed_valid_samples")
    train, train_from = _stored_count(m, extra, "consumed_train_samples")
    batch = _int(m, args, "global_batch_size")
    if train is None and stored is not None and _whole(stored.get("num_steps")):
        train, train_from = int(stored["num_steps"]), "the stored scheduler's num_steps (Megatron counts it in samples)"
    if train is None and batch is not None and not args.get("rampup_batch_size"):
        train, train_from = m.step * batch, f"iteration x {ARGS}.global_batch_size"
    sources = {"consumed_train_samples": train_from, "consumed_valid_samples": valid_from}
    if train is not None:
        return Counters(train, valid or 0, sources, ())
    warning = (f"step {m.step}: the step stores neither consumed_train_samples nor the job's global_batch_size: the "
               "checkpoint says 0 samples consumed, so Megatron's data loader starts again from the first sample")
    return Counters(0, valid or 0, sources, (warning,))


def _stored_count(m: Manifest, extra: dict[str, Any], name: str) -> tuple[int | None, str]:
    """A counter as a Megatron push keeps it (scalars.extra.megatron), else as the job's args hold it."""
    for where, values in ((f"scalars.extra.{MEGATRON_KEY}", extra), (ARGS, extra.get("args") or {})):
        value = _int(m, values, name, where)
        if value is not None:
            return value, f"{where}.{name}"
    return None, "unknown (0)"


def scheduler_plan(stored: tuple[dict[str, Any] | None, str], m: Manifest, args: dict[str, Any],
                   samples: int) -> SchedulerPlan:
    state, where = stored
    if state is not None:
        _check_state(m, state, where)
        max_lr = state.get("max_lr", state.get("start_lr"))
        if max_lr is None:  # a placeholder restore wrote (then imported): it still knows only num_steps
            return SchedulerPlan(dict(state), f"stored ({where}) without max_lr: only num_steps is meaningful", True,
                                 None, state.get("min_lr"), FROM_SCHEDULER)
        return SchedulerPlan(dict(state), f"stored ({where})", False, max_lr, state.get("min_lr"), FROM_SCHEDULER)
    derived = _from_args(m, args, samples)
    if derived is not None:
        return SchedulerPlan(derived, f"derived from {ARGS} as Megatron-LM builds it", False, derived["max_lr"],
                             derived["min_lr"], FROM_ARGS)
    lr, min_lr = arg_number(m, args, "lr"), arg_number(m, args, "min_lr")
    wd = arg_number(m, args, "weight_decay")
    wd = 0.01 if wd is None else wd
    placeholder = {"max_lr": lr, "min_lr": 0.0 if min_lr is None else min_lr, "lr_warmup_steps": 0,
                   "num_steps": samples, "lr_decay_style": "constant", "lr_decay_steps": max(samples, 1),
                   "start_wd": wd, "end_wd": wd, "wd_incr_style": "constant", "wd_incr_steps": max(samples, 1)}
    return SchedulerPlan(placeholder, f"no schedule stored and {ARGS} cannot rebuild one (lr, train_iters or "
                         "train_samples, global_batch_size): only num_steps is meaningful", True, lr, min_lr,
                         FROM_ARGS if lr is not None else DEFAULTS)


def _from_args(m: Manifest, args: dict[str, Any], samples: int) -> dict[str, Any] | None:
    """megatron.training.training.get_optimizer_param_scheduler, from the job's stored arguments (None: they
    cannot rebuild it)."""
    lr, batch = arg_number(m, args, "lr"), _int(m, args, "global_batch_size")
    iters, train_samples = _int(m, args, "train_iters"), _int(m, args, "train_samples")
    fraction = arg_number(m, args, "lr_warmup_fraction")
    if lr is None:
        return None
    if iters:  # iteration-based training: Megatron-LM's steps are samples, iterations x the global batch
        if not batch:
            return None
        decay = (_int(m, args, "lr_decay_iters") or iters) * batch
        incr = iters * batch
        warmup = fraction * decay if fraction is not None else (_int(m, args, "lr_warmup_iters") or 0) * batch
    elif train_samples:
        decay = _int(m, args, "lr_decay_samples") or train_samples
        incr = train_samples
        warmup = fraction * decay if fraction is not None else _int(m, args, "lr_warmup_samples") or 0
    else:
        return None
    wd = arg_number(m, args, "weight_decay")
    wd = 0.01 if wd is None else wd
    start, end = arg_number(m, args, "start_weight_decay"), arg_number(m, args, "end_weight_decay")
    min_lr = arg_number(m, args, "min_lr")
    return {"max_lr": float(lr), "lr_warmup_steps": warmup, "num_steps": samples,
            "lr_decay_style": _text(m, args, "lr_decay_style", "linear"), "lr_decay_steps": decay,
            "min_lr": 0.0 if min_lr is None else min_lr, "start_wd": wd if start is None else start,
            "end_wd": wd if end is None else end, "wd_incr_style": _text(m, args, "weight_decay_incr_style", "constant"),
            "wd_incr_steps": incr}


def _check_state(m: Manifest, state: dict[str, Any], where: str) -> None:
    field_ = where.removeprefix("scalars.")
    for key in _NUMBERS:
        if key in state and not _real(state[key]) and not (key in ("max_lr", "min_lr") and state[key] is None):
            raise bad_field(m, f"{field_}.{key}", "a number", state[key])
    for key in _STYLES:
        if key in state and not isinstance(state[key], str):
            raise bad_field(m, f"{field_}.{key}", "a string", state[key])


# ---- typed reads of the job's args (a forged manifest stops here, not in the trainer) ---------------------
def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _whole(value: Any) -> bool:
    return _real(value) and float(value).is_integer() and value >= 0


def arg_number(m: Manifest, args: dict[str, Any], name: str) -> float | None:
    value = args.get(name)
    if value is not None and not _real(value):
        raise bad_field(m, f"extra.{MEGATRON_KEY}.args.{name}", "a number", value)
    return value


def _int(m: Manifest, args: dict[str, Any], name: str, where: str = ARGS) -> int | None:
    value = args.get(name)
    if value is not None and not _whole(value):
        raise bad_field(m, f"{where.removeprefix('scalars.')}.{name}", "a non-negative integer", value)
    return None if value is None else int(value)


def _text(m: Manifest, args: dict[str, Any], name: str, default: str) -> str:
    value = args.get(name, default)
    if not isinstance(value, str):
        raise bad_field(m, f"extra.{MEGATRON_KEY}.args.{name}", "a string", value)
    return value
