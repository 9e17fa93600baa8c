"""Writer of Megatron's legacy format (``--ckpt-format torch``): one ``model_optim_rng.pt`` per (tp, pp) rank.

Optimizer state is written for Megatron's *non-distributed* optimizer
(torch optimizer state by parameter index, in TP-local shapes, with
megatron-core's complete param groups and the scheduler's state; with bf16
weights the fp32 masters go to ``fp32_from_fp16_params``).  The distributed
optimizer's ``distrib_optim.pt`` is a flat bucket layout tied to the
data-parallel size: restore refuses that combination (``Target.check_optimizer``)
and names ``--format megatron-dist``, which carries optimizer state into it.
"""
from __future__ import annotations

import os
from collections import OrderedDict, defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from flowcheck.restore.arch import ModelArch
from flowcheck.restore.megatron_common import StepMeta, Target, cut, iter_dirname, rank_dirname
from flowcheck.restore.megatron_map import Param, RankTensor, chunk_key, rank_tensors
from flowcheck.restore.megatron_optim import decayed

FILE = "model_optim_rng.pt"


class LegacyWriter:
    """Cuts each canonical tensor into the ranks holding it; a rank's file is written as soon as it is complete."""

    def __init__(self, arch: ModelArch, target: Target, root: str, meta: StepMeta, slots: list[str], workers: int = 4) -> None:
        self.arch, self.target, self.meta = arch, target, meta
        self.it_dir = os.path.join(root, iter_dirname(meta.iteration))
        self.ranks = [(t, p) for p in range(target.pp) for t in range(target.tp)]
        self.where: dict[str, list[tuple[tuple[int, int], RankTensor]]] = defaultdict(list)
        self.order: dict[tuple[int, int], list[RankTensor]] = {}
        self.pending: dict[tuple[int, int], int] = {}
        per_tensor = 1 + len(slots) if meta.resume.optimizer else 1
        for rank in self.ranks:
            rts = list(rank_tensors(arch, target.tp, target.pp, target.vpp, rank[0], rank[1], target.spec(arch)))
            self.order[rank] = sorted(rts, key=lambda rt: rt.chunk)  # stable: named_parameters order per chunk
            self.pending[rank] = len(rts) * per_tensor
            for rt in rts:
                self.where[rt.param.name].append((rank, rt))
        self.model: dict[tuple[int, int], dict[tuple[int, str], torch.Tensor]] = {r: {} for r in self.ranks}
        self.slots: dict[tuple[int, int], dict[tuple[int, str], dict[str, torch.Tensor]]] = {r: {} for r in self.ranks}
        self.pool = ThreadPoolExecutor(max_workers=min(workers, len(self.ranks)))
        self.futures: list[Future] = []

    def destination(self, param: Param, slot: str | None, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """No tensor of this writer holds a canonical tensor whole (each is cut into its ranks' pieces)."""
        return None

    def prepare(self, param: Param, slot: str | None, tensor: torch.Tensor) -> list[tuple[tuple[int, int], RankTensor, torch.Tensor]]:
        """One canonical tensor cut into the pieces of the ranks holding it (any thread: the restore's readers
        cut while the next tensors are read)."""
        return [(rank, rt, cut(tensor, rt)) for rank, rt in self.where[param.name]]

    def add(self, param: Param, slot: str | None, pieces: list[tuple[tuple[int, int], RankTensor, torch.Tensor]]) -> None:
        """One canonical tensor's ``prepare``d pieces (``slot`` None: the weight; else an optimizer slot such as
        exp_avg, fp32_param)."""
        for rank, rt, local in pieces:
            if slot is None:
                self.model[rank][rt.chunk, rt.key] = local
            else:
                self.slots[rank].setdefault((rt.chunk, rt.key), {})[slot] = local
            self.pending[rank] -= 1
            if self.pending[rank] == 0:
                self.futures.append(self.pool.submit(self._write_rank, rank))

    def finish(self) -> list[str]:
        try:
            incomplete = [r for r, n in self.pending.items() if n]
            if incomplete:
                raise RuntimeError(f"restore: ranks {incomplete} did not receive all their tensors")
            return [f.result() for f in self.futures]
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def _write_rank(self, rank: tuple[int, int]) -> str:
        tp_rank, pp_rank = rank
        meta = self.meta
        obj: dict[str, Any] = {
            "args": meta.args,
            "checkpoint_version": 3.0,
            "iteration": meta.iteration,
            "num_floating_point_operations_so_far": meta.flops,
        }
        model = self.model.pop(rank)
        for v in range(self.target.vpp):
            obj[chunk_key(self.target.vpp, v)] = OrderedDict(
                (rt.key, model[v, rt.key]) for rt in self.order[rank] if rt.chunk == v
            )
        slots = self.slots.pop(rank)
        if meta.resume.optimizer:
            obj["optimizer"] = self._optimizer(rank, slots)
            obj["opt_param_scheduler"] = dict(meta.resume.scheduler or {})  # Megatron-LM loads both or neither
        path = os.path.join(self.it_dir, rank_dirname(tp_rank, pp_rank, self.target.pp), FILE)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        return path

    def _optimizer(self, rank: tuple[int, int], slots: dict[tuple[int, str], dict[str, torch.Tensor]]) -> dict[str, Any]:
        """The non-distributed optimizer's state_dict: megatron-core's groups (decayed, then not), complete (torch
        replaces each live group with its saved one), state by parameter index in group order."""
        rts = self.order[rank]
        members = [[rt for rt in rts if decayed(rt.key, rt.shape)], [rt for rt in rts if not decayed(rt.key, rt.shape)]]
        resume = self.meta.resume
        step = torch.tensor(float(resume.optimizer_step))  # torch AdamW's per-parameter step: a float32 scalar
        state, param_groups, masters, index = {}, [], [], 0
        for group, group_members in zip(resume.groups, members):
            ids = []
            for rt in group_members:
                held = slots.get((rt.chunk, rt.key), {})
                state[index] = {k: v for k, v in held.items() if k != "fp32_param"}
                if resume.adam == "torch":
                    state[index]["step"] = step.clone()
                masters.append(held.get("fp32_param"))
                ids.append(index)
                index += 1
            param_groups.append(dict(group, params=ids))
        inner = {"state": state, "param_groups": param_groups}
        if self.meta.args.bf16:
            # Float16OptimizerWithFloat16Params: fp32 masters per group, in group order
            split = len(members[0])
            return {"optimizer": inner, "fp32_from_fp16_params": [masters[:split], masters[split:]]}
        return inner
