"""Writer of Megatron's legacy format (``--ckpt-format torch``): one ``model_optim_rng.pt`` per (tp, pp) rank.

Optimizer state is written for Megatron's *non-distributed* optimizer
(torch optimizer state by parameter index, in TP-local shapes; with bf16
weights the fp32 masters go to ``fp32_from_fp16_params``).  The distributed
optimizer's ``distrib_optim.pt`` is a flat, version-specific bucket layout:
use ``--format megatron-dist`` to carry optimizer state into it.
"""
from __future__ import annotations

import os
from collections import OrderedDict, defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from flowcheck.restore.arch import ModelArch
from flowcheck.restore.megatron_common import StepMeta, Target, cut, iter_dirname, rank_dirname
from flowcheck.restore.megatron_map import Param, RankTensor, chunk_key, rank_tensors

FILE = "model_optim_rng.pt"


class LegacyWriter:
    """Collects each rank's local tensors, then writes one file per rank."""

    def __init__(self, arch: ModelArch, target: Target, root: str) -> None:
        self.arch, self.target, self.root = arch, target, root
        self.ranks = [(t, p) for p in range(target.pp) for t in range(target.tp)]
        self.where: dict[str, list[tuple[tuple[int, int], RankTensor]]] = defaultdict(list)
        self.order: dict[tuple[int, int], list[RankTensor]] = {}
        for rank in self.ranks:
            rts = list(rank_tensors(arch, target.tp, target.pp, target.vpp, rank[0], rank[1], target.spec(arch)))
            self.order[rank] = sorted(rts, key=lambda rt: rt.chunk)  # stable: named_parameters order per chunk
            for rt in rts:
                self.where[rt.param.name].append((rank, rt))
        self.model: dict[tuple[int, int], dict[tuple[int, str], torch.Tensor]] = defaultdict(dict)
        self.slots: dict[tuple[int, int], dict[tuple[int, str], dict[str, torch.Tensor]]] = defaultdict(dict)

    def add(self, param: Param, model: torch.Tensor, master: torch.Tensor | None, moments: dict[str, torch.Tensor]) -> None:
        for rank, rt in self.where[param.name]:
            self.model[rank][rt.chunk, rt.key] = cut(model, rt)
            state = {slot: cut(t, rt) for slot, t in moments.items()}
            if master is not None:
                state["fp32_param"] = cut(master, rt)
            if state:
                self.slots[rank][rt.chunk, rt.key] = state

    def finish(self, meta: StepMeta, workers: int = 4) -> list[str]:
        it_dir = os.path.join(self.root, iter_dirname(meta.iteration))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(lambda r: self._write_rank(r, it_dir, meta), self.ranks))

    def _write_rank(self, rank: tuple[int, int], it_dir: str, meta: StepMeta) -> str:
        tp_rank, pp_rank = rank
        obj: dict[str, Any] = {
            "args": meta.args,
            "checkpoint_version": 3.0,
            "iteration": meta.iteration,
            "num_floating_point_operations_so_far": meta.flops,
        }
        for v in range(self.target.vpp):
            obj[chunk_key(self.target.vpp, v)] = OrderedDict(
                (rt.key, self.model[rank][v, rt.key]) for rt in self.order[rank] if rt.chunk == v
            )
        if self.target.optim and self.slots[rank]:
            obj["optimizer"] = self._optimizer(rank, meta)
            if meta.scheduler is not None:
                obj["opt_param_scheduler"] = meta.scheduler
        if meta.rng is not None:
            obj["rng_state"] = meta.rng[rank]
        path = os.path.join(it_dir, rank_dirname(tp_rank, pp_rank, self.target.pp), FILE)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(obj, path)
        return path

    def _optimizer(self, rank: tuple[int, int], meta: StepMeta) -> dict[str, Any]:
        """Megatron's param groups: weights (wd) first, then 1-D params (wd_mult 0); state by index."""
        rts = self.order[rank]
        groups = [[rt for rt in rts if len(rt.shape) > 1], [rt for rt in rts if len(rt.shape) <= 1]]
        state, param_groups, masters, index = {}, [], [], 0
        for wd_mult, members in zip((1.0, 0.0), groups):
            ids = []
            for rt in members:
                slots = self.slots[rank].get((rt.chunk, rt.key), {})
                entry = {k: v for k, v in slots.items() if k != "fp32_param"}
                if meta.optimizer_step is not None:
                    entry["step"] = torch.tensor(float(meta.optimizer_step))
                state[index] = entry
                if "fp32_param" in slots:
                    masters.append(slots["fp32_param"])
                ids.append(index)
                index += 1
            group = dict(meta.param_group)
            group.update(wd_mult=wd_mult, params=ids)
            param_groups.append(group)
        inner = {"state": state, "param_groups": param_groups}
        if meta.args.bf16:
            # Float16OptimizerWithFloat16Params: fp32 masters per group, in group order
            split = len(groups[0])
            return {"optimizer": inner, "fp32_from_fp16_params": [masters[:split], masters[split:]]}
        return inner
