"""PyTorch state dicts <-> flowcheck Snapshots (model, optimizer, lr-scheduler, RNG).

Model tensors keep their state-dict names; optimizer tensors become
``optimizer.<slot>.<param name>`` (``exp_avg``, ``exp_avg_sq``, ``step``,
``momentum_buffer``, ...); hyper-parameters, non-tensor optimizer state,
scheduler and RNG states go to the snapshot's scalars.  The round trip is
exact: a model and optimizer loaded back continue training bit for bit.
"""
from __future__ import annotations

import base64
import json
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from flowcheck import dtypes
from flowcheck.errors import FlowcheckError
from flowcheck.state import ParallelLayout, Scalars, Shard, Snapshot, StateLayout, TensorSpec

OPT_PREFIX = "optimizer."


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a CPU tensor (bf16 as its uint16 bit pattern)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_numpy(arr: np.ndarray, dtype_name: str) -> torch.Tensor:
    """A torch tensor (own memory) from stored bytes."""
    arr = np.array(arr, copy=True)
    if dtype_name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def param_names_of(model: torch.nn.Module) -> list[str]:
    """Optimizer index -> parameter name, for an optimizer built from ``model.parameters()``."""
    return [name for name, _ in model.named_parameters()]


def optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Optimizer index -> parameter name, by identity: also for an optimizer over a subset of the model's
    parameters (a LoRA trainer's adapters only); FlowcheckError naming the first parameter the model lacks."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    names = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) not in by_id:
                raise FlowcheckError(f"optimizer param_groups[{gi}].params[{pi}] (shape {tuple(p.shape)}) is not a "
                                     "parameter of the model: expected an optimizer over the model's parameters")
            names.append(by_id[id(p)])
    return names


def _json_ready(obj: Any, where: str) -> Any:
    try:
        return json.loads(json.dumps(obj, allow_nan=False, default=_encode))
    except (TypeError, ValueError) as e:
        raise FlowcheckError(f"{where} holds a value that cannot be stored as JSON ({e}); pass it as a tensor instead") from e


def _encode(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    if isinstance(obj, (tuple, set)):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def capture_rng() -> dict[str, str]:
    """torch (CPU and CUDA), numpy and python RNG states as base64 strings."""
    out = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        out["torch_cuda"] = base64.b64encode(b"".join(s.numpy().tobytes() for s in torch.cuda.get_rng_state_all())).decode()
    out["python"] = base64.b64encode(json.dumps(random.getstate()).encode()).decode()
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    out["numpy"] = base64.b64encode(json.dumps([name, keys.tolist(), pos, has_gauss, gauss]).encode()).decode()
    return out


def restore_rng(rng: Mapping[str, str]) -> None:
    if "torch" in rng:
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng["torch"])), dtype=torch.uint8))
    if "python" in rng:
        state = json.loads(base64.b64decode(rng["python"]))
        random.setstate((state[0], tuple(state[1]), state[2]))
    if "numpy" in rng:
        name, keys, pos, has_gauss, gauss = json.loads(base64.b64decode(rng["numpy"]))
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def snapshot_from_torch(
    run: str,
    step: int,
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | Mapping[str, Any] | None = None,
    *,
    param_names: list[str] | None = None,
    lr_scheduler: Any = None,
    rng: bool = True,
    extra: Mapping[str, Any] | None = None,
    roles: Mapping[str, str] | None = None,
    source_layout: ParallelLayout = ParallelLayout(),
    source: str = "push",
) -> Snapshot:
    """A Snapshot of a plain PyTorch model (+ optimizer, scheduler, RNG) — data are zero-copy views."""
    if isinstance(model, torch.nn.Module):
        param_names = param_names or param_names_of(model)
        model_state = model.state_dict()
    else:
        model_state = model
    tensors: dict[str, torch.Tensor] = {k: v for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    opt_scalars, optimizer_step = None, None
    if optimizer is not None:
        opt_state = optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer
        opt_tensors, opt_scalars, optimizer_step = _flatten_optimizer(opt_state, param_names or list(tensors))
        tensors.update(opt_tensors)
    roles = roles or {}
    specs, data = [], {}
    for name, t in tensors.items():
        spec = TensorSpec(name, dtypes.from_torch(t.dtype).name, tuple(t.shape), roles.get(name, "replicated"))
        specs.append(spec)
        data[Shard.whole(spec)] = to_numpy(t)
    scalars = Scalars(
        optimizer_step=optimizer_step,
        lr_scheduler=_json_ready(lr_scheduler.state_dict(), "lr_scheduler.state_dict()") if lr_scheduler is not None else None,
        rng=capture_rng() if rng else {},
        optimizer=opt_scalars,
        extra=_json_ready(dict(extra or {}), "extra"),
    )
    layout = StateLayout(tuple(specs), source_layout)
    return Snapshot(run, step, layout, data, scalars, source=source)


def _flatten_optimizer(opt_state: Mapping[str, Any], names: list[str], *, device_steps: bool = True):
    """(slot tensors by name, JSON scalars, optimizer step).  ``device_steps=False``: a ``step`` tensor on a device is
    not read for the step count (``.item()`` waits for the device; the Checkpointer reads its host copy instead)."""
    groups = opt_state.get("param_groups")
    state = opt_state.get("state", {})
    if not isinstance(groups, list):
        raise FlowcheckError("optimizer state_dict: expected 'param_groups' (a list); is this an optimizer state_dict?")
    indices = [i for g in groups for i in g["params"]]
    if len(indices) != len(names):
        raise FlowcheckError(
            f"optimizer has {len(indices)} parameters but {len(names)} names are known; pass the model "
            "(nn.Module) or param_names= in the optimizer's parameter order"
        )
    name_of = dict(zip(indices, names))
    tensors, loose, steps = {}, {}, []
    for idx, slots in state.items():
        pname = name_of[int(idx)]
        for slot, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{OPT_PREFIX}{slot}.{pname}"] = value
                if slot == "step" and value.numel() == 1 and (device_steps or value.device.type == "cpu"):
                    steps.append(int(value.item()))
            else:
                loose.setdefault(pname, {})[slot] = value
                if slot == "step":
                    steps.append(int(value))
    groups_named = [{**{k: v for k, v in g.items() if k != "params"}, "params": [name_of[i] for i in g["params"]]} for g in groups]
    scalars = _json_ready({"param_groups": groups_named, "state": loose}, "optimizer state")
    return tensors, scalars, (max(steps) if steps else None)


def torch_state_from_snapshot(snapshot: Snapshot) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """(model state_dict, optimizer state_dict or None) from a snapshot of whole tensors."""
    full: dict[str, torch.Tensor] = {}
    for shard in snapshot.data:
        spec = snapshot.layout.spec(shard.tensor)
        if shard.shape != spec.shape:
            raise FlowcheckError(f"{shard.tensor}: snapshot holds a partial shard; assemble the tensor first (flowcheck.restore)")
        full[shard.tensor] = from_numpy(snapshot.array(shard), spec.dtype)
    model = {k: v for k, v in full.items() if not k.startswith(OPT_PREFIX)}
    opt = snapshot.scalars.optimizer
    if not opt:
        return model, None
    index = {name: i for i, name in enumerate(n for g in opt["param_groups"] for n in g["params"])}
    groups = [{**{k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k != "params"},
               "params": [index[n] for n in g["params"]]} for g in opt["param_groups"]]
    state: dict[int, dict[str, Any]] = {}
    for key, t in full.items():
        if key.startswith(OPT_PREFIX):
            slot, pname = key[len(OPT_PREFIX):].split(".", 1)
            state.setdefault(index[pname], {})[slot] = t
    for pname, slots in opt.get("state", {}).items():
        state.setdefault(index[pname], {}).update(slots)
    return model, {"state": state, "param_groups": groups}
