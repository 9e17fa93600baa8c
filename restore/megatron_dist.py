"""Writer of Megatron-LM's ``torch_dist`` format: one PyTorch DCP checkpoint of global, layer-stacked tensors.

The layout is the target's only through the vocabulary padding and ``args``:
Megatron reshards on load itself.  Optimizer state goes in the
``fully_reshardable`` form (``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``,
model shapes), the only optimizer form that survives a TP/PP change and, for the
distributed optimizer, any data-parallel size.  ``common.pt`` carries the param
groups in the shape each megatron-core optimizer reads them, so one checkpoint
loads with or without ``--use-distributed-optimizer`` (see ``optimizer_common``).
"""
from __future__ import annotations

import json
import os
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from flowcheck.restore.arch import ModelArch
from flowcheck.restore.megatron_common import StepMeta, Target, iter_dirname
from flowcheck.restore.megatron_map import Param, local_suffix
from flowcheck.restore.megatron_optim import ResumePlan

METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
            "common_backend": "torch", "common_backend_version": 1}
# Megatron-LM builds its sharded state dicts for loading from the checkpoint's content metadata: the distributed
# optimizer asks for the sharding type named here (without it, 'fully_sharded_model_space', which this is not)
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                    "distrib_optim_sharding_type": "fully_reshardable",
                    "distrib_optim_fully_reshardable_mem_efficient": False}
OPT_PREFIX = "optimizer.state"
_WRITER_THREAD = "_write_files_from_queue"  # the target of torch's DCP writer threads (they are named after it)
# modules with ``_extra_state`` in megatron-core's local spec (TE adds core_attention)
_EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")


def dist_key(param: Param) -> str:
    """The torch_dist key: layer tensors are stacked under ``decoder.layers.<suffix>`` with TE norm names."""
    if param.layer is None:
        return param.name
    return f"decoder.layers.{local_suffix(param.suffix, 'te')}"


def pad_vocab(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Vocabulary rows for the target TP: truncate, or append copies of the last row (Megatron's converters)."""
    if t.shape[0] >= rows:
        return t[:rows]
    return torch.cat([t, t[-1:].expand(rows - t.shape[0], *t.shape[1:])])


@contextmanager
def _writer_thread_errors() -> Iterator[list[BaseException]]:
    """Exceptions of DCP's writer threads while one save runs.  torch lets them end their thread (printing a
    traceback), commits the checkpoint without their files, and, when its own thread fails, returns without
    waiting for them: collected here they fail the restore, and none is still writing when this exits."""
    lost: list[BaseException] = []
    previous, before = threading.excepthook, set(threading.enumerate())

    def ours(t: threading.Thread) -> bool:
        return t not in before and t.name.endswith(f"({_WRITER_THREAD})")

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.thread is not None and ours(args.thread) and args.exc_value is not None:
            lost.append(args.exc_value)
        else:
            previous(args)

    threading.excepthook = hook
    try:
        yield lost
    finally:
        for t in threading.enumerate():
            if ours(t):
                t.join()
        threading.excepthook = previous


def _first_failure(e: BaseException) -> BaseException:
    failures = getattr(e, "failures", None) or {}
    for failure in failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return inner
    return e


class DistWriter:
    """Collects global tensors (stacking layers) and saves them as one DCP checkpoint."""

    def __init__(self, arch: ModelArch, target: Target, root: str, meta: StepMeta, slots: list[str], workers: int = 4) -> None:
        self.arch, self.target, self.meta, self.workers = arch, target, meta, workers
        self.it_dir = os.path.join(root, iter_dirname(meta.iteration))
        self.state: dict[str, Any] = {}

    def _put(self, key: str, param: Param, t: torch.Tensor) -> None:
        """``t`` into its place in the checkpoint (nothing to copy where it was read there: ``destination``)."""
        if param.role == "vocab":
            rows = self.arch.padded_vocab(self.target.tp)
            held = self.state.get(key)
            if held is not None and held.data_ptr() == t.data_ptr() and rows > t.shape[0] > 0:
                held[t.shape[0]:] = t[-1:]  # read into place: the padding rows, as pad_vocab appends them
                return
            t = pad_vocab(t, rows)
        if param.layer is None:
            if key not in self.state or self.state[key].data_ptr() != t.data_ptr():
                self.state[key] = t.contiguous()
            return
        stacked = self.state.get(key)
        if stacked is None:
            stacked = self.state[key] = torch.empty((self.arch.num_layers, *t.shape), dtype=t.dtype)
        if stacked[param.layer].data_ptr() != t.data_ptr():
            stacked[param.layer] = t

    def _key(self, param: Param, slot: str | None) -> str:
        """Where ``add`` puts a tensor (the distributed optimizer's master copy: ``param``; a bf16 job's is copied
        from there to ``fp32_param`` too)."""
        key = dist_key(param)
        if slot is None:
            return key
        return f"{OPT_PREFIX}.{'param' if slot == 'fp32_param' else slot}.{key}"

    def destination(self, param: Param, slot: str | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The writer's own tensor a stored tensor of ``shape`` and ``dtype`` may be read straight into before it is
        ``add``ed (restore/direct.py): its layer of the stacked tensor, the first rows of the padded vocabulary,
        or a tensor of its own; None where ``add`` must convert it (fewer vocabulary rows than stored)."""
        key = self._key(param, slot)
        held = self.state.get(key)
        if param.role == "vocab":
            rows = self.arch.padded_vocab(self.target.tp)
            if param.layer is not None or not shape or rows < shape[0] or held is not None:
                return None
            self.state[key] = torch.empty((rows, *shape[1:]), dtype=dtype)
            return self.state[key][:shape[0]]
        if param.layer is None:
            if held is not None:
                return None
            self.state[key] = torch.empty(shape, dtype=dtype)
            return self.state[key]
        if held is None:
            held = self.state[key] = torch.empty((self.arch.num_layers, *shape), dtype=dtype)
        return held[param.layer] if held.dtype == dtype and tuple(held.shape[1:]) == tuple(shape) else None

    def prepare(self, param: Param, slot: str | None, tensor: torch.Tensor) -> torch.Tensor:
        """Nothing to do before ``add`` (the writer's interface: LegacyWriter cuts here)."""
        return tensor

    def add(self, param: Param, slot: str | None, tensor: torch.Tensor) -> None:
        """One canonical tensor (``slot`` None: the weight; fp32_param: the master copy; else a moment)."""
        self._put(self._key(param, slot), param, tensor)
        if slot == "fp32_param" and self.meta.args.bf16:  # Float16OptimizerWithFloat16Params names it fp32_param
            self._put(f"{OPT_PREFIX}.fp32_param.{dist_key(param)}", param, tensor)

    def finish(self) -> list[str]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
        from torch.distributed.checkpoint.api import CheckpointException

        os.makedirs(self.it_dir, exist_ok=True)
        state = dict(self.state)
        state.update(self._objects())
        failure = None
        try:
            with _writer_thread_errors() as lost, warnings.catch_warnings():
                # no_dist=True is the point (one process writes the whole checkpoint): not worth a warning
                warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
                dcp.save(
                    state,
                    storage_writer=FileSystemWriter(self.it_dir, thread_count=self.workers, sync_files=True),
                    planner=DefaultSavePlanner(flatten_state_dict=False),
                    no_dist=True,
                )
        except CheckpointException as e:
            failure = _first_failure(e)  # one process, one rank: its own exception (an OSError, a Ctrl-C...)
        if failure is not None or lost:
            # raised out here: inside the except block Python would replace its context (the OSError under
            # torch.save's "unexpected pos" RuntimeError) with the CheckpointException
            raise failure or lost[0]
        with open(os.path.join(self.it_dir, "common.pt"), "wb") as f:
            torch.save(self._common(self.meta), f)  # a Python file: a failed write surfaces as its OSError
        with open(os.path.join(self.it_dir, "metadata.json"), "w", encoding="utf-8") as f:
            json.dump(METADATA, f)
        return sorted(os.path.join(self.it_dir, n) for n in os.listdir(self.it_dir))

    def _objects(self) -> dict[str, list]:
        """Per-layer ``_extra_state`` entries, which Megatron's default strict load asks for.

        Megatron stores a ShardedObject as ``<key>/shard_<layer>_<layers>`` holding ``torch.save([obj])``;
        DCP torch.saves a non-tensor value, so ``[None]`` (no extra state: local spec, or a fresh TE
        module) is written as such.
        """
        modules = list(_EXTRA_STATE_MODULES)
        if self.target.spec(self.arch) == "te":
            modules.append("self_attention.core_attention")
        n = self.arch.num_layers
        return {f"decoder.layers.{m}._extra_state/shard_{i}_{n}": [None] for m in modules for i in range(n)}

    def _common(self, meta: StepMeta) -> dict[str, Any]:
        common: dict[str, Any] = {
            "args": meta.args,
            "checkpoint_version": 3.0,
            "iteration": meta.iteration,
            "num_floating_point_operations_so_far": meta.flops,
            "content_metadata": dict(CONTENT_METADATA),
        }
        if meta.resume.optimizer:
            common["optimizer"] = optimizer_common(meta.resume)
            common["opt_param_scheduler"] = dict(meta.resume.scheduler or {})  # Megatron-LM loads both or neither
        return common


def optimizer_common(resume: ResumePlan) -> dict[str, Any]:
    """The optimizer's common (non-tensor) state for every optimizer megatron-core 0.16.1 may load it into.

    Each merges its own request into these objects (the tensors' ``params`` index lists are the loading rank's
    own, so none is stored): FP32Optimizer reads ``param_groups`` and, for torch AdamW, the step it copies into
    every parameter's state, ``state.common_step`` (FusedAdam keeps it in the groups and refuses it there);
    Float16OptimizerWithFloat16Params (bf16) reads the same under ``optimizer``; DistributedOptimizer reads
    ``optimizer.param_groups`` (with their ``step``) and ``param_state_sharding_type``.
    """
    def own() -> tuple[list[dict[str, Any]], dict[str, Any]]:  # separate objects: each load mutates its own
        groups = [dict(g) for g in resume.groups]
        return groups, ({"common_step": torch.tensor(float(resume.optimizer_step))} if resume.adam == "torch" else {})

    groups, state = own()
    inner_groups, inner_state = own()
    return {"param_groups": groups, "state": state,
            "optimizer": {"param_groups": inner_groups, "state": inner_state},
            "param_state_sharding_type": "fully_reshardable"}
