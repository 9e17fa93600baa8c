"""What one Megatron rank pushes: its TP/PP boxes of the canonical tensors, its distributed-optimizer shards, and
the optimizer hyper-parameters, scheduler state and counters restore writes back (``scalars.extra.megatron``).

Canonical names and TP/PP rules are restore's (flowcheck/restore/megatron_map.py), so what a rank sends is
reassembled at any other layout.  Weights and the optimizer state of a non-distributed optimizer are the same
on every data-parallel replica: each box goes to one DP rank (the Checkpointer's razor).  megatron-core's
``DistributedOptimizer`` is different: each DP rank owns a contiguous range of every gradient bucket — a flat
range of some TP-local parameters — and holds the fp32 main parameters and Adam moments of that range only.
Each such range is cut into boxes of the parameter's canonical tensor (a partial row, whole rows, a partial
row) and sent by its owner, so the DP ranks' pieces tile every weight and moment with no overlap and no gap.
megatron-core is never imported here: its objects are recognised once the trainer has imported it.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from typing import Any

import torch

from flowcheck import dtypes
from flowcheck.errors import ConfigError, FlowcheckError

OPT = "optimizer."
MEGATRON_KEY = "megatron"  # scalars.extra[MEGATRON_KEY], as `flowcheck import` stores it for Megatron checkpoints
_SEP = "|"  # local keys: "<chunk>|<key>", "<chunk>|optimizer.<slot>.<key>", "<chunk>|dist.<slot>.<start>.<key>"


class MegatronPushError(FlowcheckError, ValueError):
    """A Megatron trainer's model or optimizer does not match what the Checkpointer was told (arch=, coords)."""


# ---- recognising megatron-core objects ----------------------------------------------------
def is_megatron_optimizer(optimizer: Any) -> bool:
    mod = sys.modules.get("megatron.core.optimizer.optimizer")
    return mod is not None and isinstance(optimizer, mod.MegatronOptimizer)


def leaf_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers doing the work: a ChainedOptimizer's members, or the optimizer itself."""
    if optimizer is None:
        return []
    chained = getattr(optimizer, "chained_optimizers", None)
    return [leaf for o in chained for leaf in leaf_optimizers(o)] if chained is not None else [optimizer]


def hook_targets(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers whose ``step()`` mutates the state: the copy must be done before any of them runs."""
    if optimizer is None:
        return []
    if not is_megatron_optimizer(optimizer):
        return [optimizer]
    return [leaf.optimizer for leaf in leaf_optimizers(optimizer) if getattr(leaf, "optimizer", None) is not None]


def _is_distributed(leaf: Any) -> bool:
    return hasattr(leaf, "model_param_group_index_map") and hasattr(leaf, "_get_model_param_range_map")


def model_chunks(model: Any) -> list[Any]:
    """Megatron's model: a module, or (virtual pipeline) a list of model chunks."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _strip(key: str) -> str:
    """A state-dict key without the wrappers' prefixes (DistributedDataParallel, Float16Module: ``module.``)."""
    while key.startswith("module."):
        key = key[len("module."):]
    return key


# ---- flat ranges -> boxes ------------------------------------------------------------------------
def flat_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The row-major flat range [start, end) of a tensor of ``shape`` as contiguous boxes (offsets, sizes):
    a partial leading row, a block of whole rows, a partial trailing row (recursively inside a row)."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else []
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner
    if first == last:
        return [((first, *o), (1, *s)) for o, s in flat_boxes(shape[1:], start - first * inner, end - first * inner)]
    out = []
    if start % inner:
        out += flat_boxes(shape, start, (first + 1) * inner)
        first += 1
    whole_end = end // inner
    if whole_end > first:
        out.append(((first, *(0,) * (len(shape) - 1)), (whole_end - first, *shape[1:])))
    if end % inner:
        out += flat_boxes(shape, whole_end * inner, end)
    return out


def _ravel(offsets: tuple[int, ...], shape: tuple[int, ...]) -> int:
    at = 0
    for o, n in zip(offsets, shape):
        at = at * n + o
    return at


def _contiguous(sizes: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """A box is one run of the flattened tensor: after its first dimension wider than 1, every one is whole."""
    wide = next((i for i, s in enumerate(sizes) if s > 1), len(sizes))
    return all(sizes[i] == shape[i] for i in range(wide + 1, len(shape)))


def _flat_view(at: int, sizes: tuple[int, ...]):
    n = math.prod(sizes)
    return lambda t: t[at:at + n].view(sizes)


def _slicer(dest: tuple[slice, ...]):
    return lambda t: t[dest]


def place_range(name: str, local: str, rt: Any, start: int, end: int) -> Iterator[tuple]:
    """Shards ``(name, canonical offsets, local, view)`` of the flat range [start, end) of a TP-local tensor
    ``rt`` (a RankTensor), held as a 1-D tensor under ``local``."""
    for offsets, sizes in flat_boxes(rt.shape, start, end):
        for part in rt.parts:
            if part.pad:
                continue
            lo = tuple(max(o, d.start) for o, d in zip(offsets, part.dest))
            hi = tuple(min(o + s, d.stop) for o, s, d in zip(offsets, sizes, part.dest))
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            box = tuple(h - l for l, h in zip(lo, hi))
            if not _contiguous(box, rt.shape):  # the TP rules only cut leading rows: cannot happen
                raise MegatronPushError(f"{name}: flat range [{start}, {end}) of local {list(rt.shape)} is not a "
                                        "run of the canonical tensor")
            src = [s.start + (l - d.start) for l, s, d in zip(lo, part.src, part.dest)]
            yield name, src, local, _flat_view(_ravel(lo, rt.shape) - start, box)


# ---- one rank ----------------------------------------------------------------------------------
class MegatronRank:
    """A Megatron trainer rank (``arch=`` given): the tensors it sends each save and how they are cut."""

    def __init__(self, model: Any, optimizer: Any, arch: Any, coords: Any) -> None:
        self.chunks = model_chunks(model)
        if len(self.chunks) != coords.vpp:
            raise ConfigError(f"Checkpointer: the model has {len(self.chunks)} chunk(s), but the virtual pipeline "
                              f"size is {coords.vpp}; pass the list of model chunks Megatron built (one per virtual "
                              "stage), or coords= with the right vpp")
        arch.check_layout(coords.tp, coords.pp, coords.vpp)
        # the padding rows of the embedding and output layer are trained state (their logits are in Megatron's
        # softmax): the step stores every row this layout has, and says how many
        self.arch = arch.with_stored_rows(arch.padded_vocab(coords.tp), "Checkpointer arch=")
        self.coords = coords
        # the optimizers holding state (a stub on a rank without trainable parameters holds none)
        leaves = leaf_optimizers(optimizer) if is_megatron_optimizer(optimizer) else leaf_optimizers(
            _PlainLeaf(optimizer) if optimizer is not None else None)
        self.leaves = [leaf for leaf in leaves if getattr(leaf, "optimizer", None) is not None]
        self._names: dict[int, tuple[int, str]] | None = None
        self.frozen: set[str] = set()  # local keys of the model's frozen (requires_grad=False) parameters, per tensors()
        self.buffers: set[str] = set()  # local keys of the model's buffers (non-parameter tensors), per tensors()
        # canonical names of the parameters frozen on other pipeline stages: they have no optimizer state, which
        # every rank's layout must say alike (the node takes one layout), and this rank cannot see them
        self.frozen_elsewhere = self._gather_frozen()

    # -- what is sent ---------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """local key -> tensor: model tensors, whole optimizer slots, distributed-optimizer shards (1-D)."""
        out: dict[str, torch.Tensor] = {}
        held: set[int] = set()
        for leaf in self.leaves:
            if _is_distributed(leaf):
                held |= self._shards(leaf, out)
            else:
                self._whole_slots(leaf, out)
        frozen: set[str] = set()
        buffers: set[str] = set()
        for v, chunk in enumerate(self.chunks):
            for k, t in chunk.state_dict(keep_vars=True).items():
                # Transformer Engine's _extra_state may be a tensor: FP8 metadata, not training state
                if isinstance(t, torch.Tensor) and id(t) not in held and not k.endswith("_extra_state"):
                    out[f"{v}{_SEP}{_strip(k)}"] = t.detach()
                    if isinstance(t, torch.nn.Parameter) and not t.requires_grad:
                        frozen.add(f"{v}{_SEP}{_strip(k)}")
                    elif not isinstance(t, torch.nn.Parameter):
                        buffers.add(f"{v}{_SEP}{_strip(k)}")
        self.frozen, self.buffers = frozen, buffers
        return out

    def _gather_frozen(self) -> frozenset[str]:
        """The frozen parameters of every pipeline stage (canonical names), gathered once over the default process
        group when there are several stages — a collective: every rank builds its Checkpointer.  Without
        torch.distributed (or at PP=1) a rank knows only its own: a stage's parameter is then taken as trainable."""
        dist = torch.distributed
        if self.coords.pp == 1 or not (dist.is_available() and dist.is_initialized()):
            return frozenset()
        rts = self._rank_tensors(self.tensors())
        where = {k: (_parse(k)[0], _parse(k)[3]) for k in self.frozen}
        mine = sorted({rts[at].param.name for at in where.values() if at in rts})  # unknown keys: cut() says so
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return frozenset(n for names in every for n in names)

    def _rank_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str], Any]:
        from flowcheck.restore.megatron_map import rank_tensors

        c = self.coords
        spec_name = "te" if any(".layer_norm_weight" in k for k in tensors) else "local"
        return {(rt.chunk, rt.key): rt for rt in rank_tensors(self.arch, c.tp, c.pp, c.vpp, c.tp_rank, c.pp_rank,
                                                                spec_name)}

    def _name(self, param: torch.Tensor) -> tuple[int, str]:
        if self._names is None:
            self._names = {id(p): (v, _strip(n)) for v, c in enumerate(self.chunks) for n, p in c.named_parameters()}
        found = self._names.get(id(param))
        if found is None:
            raise MegatronPushError(f"the optimizer holds a parameter of shape {list(param.shape)} that is not in the "
                                    "model given to the Checkpointer; pass the model chunks the optimizer was built from")
        return found

    def _shards(self, leaf: Any, out: dict[str, torch.Tensor]) -> set[int]:
        """The DP-owned ranges of a DistributedOptimizer: weights (fp32 main params, or the 16-bit model shard
        plus ``fp32_param``) and moments, each a 1-D tensor keyed with its range start.  Returns the ids of every
        parameter the optimizer shards — also those another DP rank owns whole: their weights come from it."""
        for param in leaf.model_param_group_index_map:
            v, key = self._name(param)
            start = leaf._get_model_param_range_map(param)["param"].start
            state = leaf._get_main_param_and_optimizer_states(param)
            for slot, t in state.items():
                if not isinstance(t, torch.Tensor) or t.dim() == 0:
                    continue  # Adam's step: the step count scalar carries it
                if slot == "param":
                    if t.dtype != param.dtype:
                        out[f"{v}{_SEP}dist.fp32_param.{start}.{key}"] = t
                        t = param.detach().view(-1)[start:start + t.numel()]
                    out[f"{v}{_SEP}dist.weight.{start}.{key}"] = t
                else:
                    out[f"{v}{_SEP}dist.{slot}.{start}.{key}"] = t
        return {id(p) for buffer in leaf.buffers for p in buffer.param_index_map}

    def _whole_slots(self, leaf: Any, out: dict[str, torch.Tensor]) -> None:
        """A non-distributed optimizer: slots whole (TP-local), fp32 masters of 16-bit params as ``fp32_param``."""
        inner = leaf.optimizer
        master_of = {id(m): p for mg, pg in zip(getattr(leaf, "fp32_from_float16_groups", []),
                                                 getattr(leaf, "float16_groups", [])) for m, p in zip(mg, pg)}
        for group in inner.param_groups:
            for q in group["params"]:
                param = master_of.get(id(q), q)
                v, key = self._name(param)
                for slot, t in inner.state.get(q, {}).items():
                    if isinstance(t, torch.Tensor) and t.dim() > 0:
                        out[f"{v}{_SEP}{OPT}{slot}.{key}"] = t
                if param is not q:
                    out[f"{v}{_SEP}{OPT}fp32_param.{key}"] = q.detach()

    # -- how it is cut --------------------------------------------------------------------
    def cut(self, tensors: dict[str, torch.Tensor]) -> tuple[list[dict], list[tuple], list[tuple]]:
        """(specs of every canonical tensor, boxes DP replicas share, boxes only this DP rank holds)."""
        c = self.coords
        rts = self._rank_tensors(tensors)
        shared, own, dtype_of = [], [], {}
        frozen, with_state = set(self.frozen_elsewhere), set()
        for local, t in tensors.items():
            v, slot, start, key = _parse(local)
            rt = rts.get((v, key))
            if rt is None:
                raise ConfigError(f"Checkpointer: {key!r} (model chunk {v}) is not a tensor of the described model at "
                                  f"TP={c.tp} PP={c.pp} VPP={c.vpp} (rank tp={c.tp_rank} pp={c.pp_rank})")
            name = rt.param.name if slot is None else f"{OPT}{slot}.{rt.param.name}"
            dtype_of.setdefault(slot, dtypes.from_torch(t.dtype).name)
            if local in self.frozen:
                frozen.add(rt.param.name)
            elif slot is not None:
                with_state.add(rt.param.name)
            if not self._sends(rt):
                continue
            if start is not None:
                own.extend(place_range(name, local, rt, start, start + t.numel()))
                continue
            if tuple(t.shape) != rt.shape:
                raise ConfigError(f"Checkpointer: {key}: local shape {list(t.shape)}, the model description says "
                                  f"{list(rt.shape)} at TP={c.tp}")
            shared.extend((name, [sl.start for sl in p.src], local, _slicer(p.dest)) for p in rt.parts if not p.pad)
        return self._specs(dtype_of, frozen - with_state), shared, own

    def _sends(self, rt: Any) -> bool:
        """One copy of each box: the tied output layer's is the first stage's embedding, TP replicas TP rank 0's."""
        if rt.key == "output_layer.weight" and self.arch.tied:
            return False
        return rt.param.role != "replicated" or self.coords.tp_rank == 0

    def _specs(self, dtype_of: dict[str | None, str], stateless: set[str]) -> list[dict]:
        """Every canonical parameter, and its optimizer slots unless it is frozen (``stateless``: no optimizer
        state anywhere, so no rank sends one)."""
        from flowcheck.restore.megatron_map import model_params

        slots = sorted(s for s in dtype_of if s is not None)
        specs = []
        for p in model_params(self.arch):
            specs.append({"name": p.name, "dtype": dtype_of.get(None, "float32"), "shape": list(p.shape), "role": p.role})
            if p.name not in stateless:
                specs.extend({"name": f"{OPT}{s}.{p.name}", "dtype": dtype_of[s], "shape": list(p.shape),
                              "role": p.role} for s in slots)
        return specs

    # -- scalars ----------------------------------------------------------------------------
    def param_groups(self) -> tuple[list[dict[str, Any]], int | None]:
        """The optimizer's param groups without their params (lr, min_lr, max_lr, betas, eps, weight_decay, wd_mult,
        lr_mult, is_expert_parallel, ... and step, as Megatron's distributed optimizer saves them) and the step."""
        groups, step = [], None
        for leaf in self.leaves:
            inner = leaf.optimizer
            for g in inner.param_groups:
                group = {k: v for k, v in g.items() if k != "params"}
                # a group's own step first: a per-parameter step tensor on a device costs a sync to read
                group["step"] = int(group["step"]) if group.get("step") is not None else _leaf_step(inner)
                groups.append(group)
                step = group["step"] if group["step"] is not None else step
        return groups, step

    def adam(self) -> str | None:
        """The Adam the optimizer runs, as restore's ``--adam`` names it (torch AdamW keeps the step in every
        parameter's state, FusedAdam in its groups: the checkpoint's optimizer state must be in its form); None:
        neither (another optimizer, or no state on this rank)."""
        kinds = {_adam_kind(leaf.optimizer) for leaf in self.leaves}
        return kinds.pop() if len(kinds) == 1 else None


def _adam_kind(optimizer: torch.optim.Optimizer) -> str | None:
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "torch"
    return "fused" if "FusedAdam" in type(optimizer).__name__ else None  # Transformer Engine's, Apex's


def _leaf_step(optimizer: torch.optim.Optimizer) -> int | None:
    """The step of an optimizer whose param groups do not carry it: its first parameter's ``step`` state."""
    steps = [t["step"] for t in optimizer.state.values() if "step" in t]
    return int(steps[0]) if steps else None


class _PlainLeaf:
    """A torch optimizer in a Megatron-style trainer, seen as a non-distributed Megatron optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer


def model_key(local: str) -> str:
    """A local key's model state-dict key (without its chunk), as a trainer names the tensor."""
    return local.split(_SEP, 1)[1]


def _parse(local: str) -> tuple[int, str | None, int | None, str]:
    """(chunk, optimizer slot or None for the weight, flat range start or None, model key) of a local key."""
    chunk, rest = local.split(_SEP, 1)
    if rest.startswith("dist."):
        slot, start, key = rest[len("dist."):].split(".", 2)
        return int(chunk), None if slot == "weight" else slot, int(start), key
    if rest.startswith(OPT):
        slot, key = rest[len(OPT):].split(".", 1)
        return int(chunk), slot, None, key
    return int(chunk), None, None, rest
