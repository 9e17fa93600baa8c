"""The updater: applies assembled gradients to a RAM replica with the trainer's own optimizer.

The replica runs the trainer's torch CPU optimizer implementation (``optimizer.impl``: single-tensor,
foreach or fused) with the job's hyper-parameters, one optimizer over every parameter like the trainer's.
SGD, Adam and AdamW update every parameter independently (elementwise), and a torch optimizer skips
parameters whose ``.grad`` is None, so a bucket's parameters are stepped as soon as the bucket is
complete — only they hold a gradient then — and the result is bit for bit what the trainer's single
step over all parameters computes.  Gradients are zero-copy views of the allreduced vector when it is
already what the optimizer takes (fp32, averaged, no clipping), else copied into buffers kept
across iterations.  With global-norm clipping the norm needs the
whole gradient, so the step waits for the iteration's last bucket and calls the very same
``clip_grad_norm_`` over the parameters in ``model.parameters()`` order.

A scaled-out node's replica (``owned``: its part, flowcheck.capture.mirror.partition) holds, updates and
snapshots only its parameters and their optimizer slots; its snapshot still describes the whole state
(every tensor's spec, the optimizer's groups over every parameter) so that the parts agree and the
cluster commit merges them.  Its clipping takes the other parts' gradient norms from a ``NormExchange``.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from flowcheck.capture.mirror.job import Bucket, Job
from flowcheck.errors import JobError
from flowcheck.state import Shard, Snapshot, StateLayout, TensorSpec
from flowcheck.torch.state import OPT_PREFIX, snapshot_from_torch

if TYPE_CHECKING:
    from flowcheck.capture.mirror.partition import NormExchange


class PartNormsMissingError(JobError):
    """A partitioned replica could not clip: some part's gradient norms never arrived (the iteration is lost)."""

log = logging.getLogger(__name__)


def make_optimizer(job: Job, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    o = job.optimizer
    if o is None:
        raise JobError("optimizer: the job has none; capture needs the trainer's optimizer to update the replica")
    impl = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[o.impl]
    common = {"lr": o.lr, "weight_decay": o.weight_decay, "maximize": o.maximize, **impl}
    if o.kind == "sgd":
        return torch.optim.SGD(params, momentum=o.momentum, dampening=o.dampening, nesterov=o.nesterov, **common)
    cls = torch.optim.Adam if o.kind == "adam" else torch.optim.AdamW
    return cls(params, betas=o.betas, eps=o.eps, amsgrad=o.amsgrad, **common)


class Replica:
    """Parameters and optimizer state of the trainer, advanced one iteration at a time."""

    def __init__(self, job: Job, state: Mapping[str, torch.Tensor], step: int, *,
                 owned: frozenset[str] | None = None, norms: NormExchange | None = None) -> None:
        if not job.trains:
            raise JobError("the job lacks what updating needs: parameters, bucket contents (parameter names) "
                           "and optimizer; decode works without them, capture does not")
        if owned is not None and job.clip_grad_norm is not None and norms is None:
            raise JobError("a partitioned replica of a job that clips gradients needs the other parts' norms "
                           "(a NormExchange: the partition's exchange directory)")
        self.job = job
        self.step = step
        self.owned, self.norms = owned, norms
        self.all_names = [p.name for p in job.parameters]
        self.names = [n for n in self.all_names if owned is None or n in owned]
        self.params: dict[str, torch.Tensor] = {}
        for p in job.parameters:
            if p.name not in self.names:
                continue
            if p.name not in state:
                raise JobError(f"initial state: parameter {p.name!r} is missing")
            t = state[p.name]
            if tuple(t.shape) != p.shape:
                raise JobError(f"initial state: {p.name} has shape {tuple(t.shape)}, the job says {p.shape}")
            self.params[p.name] = t.detach().clone().to(torch.float32)
        self.optim = make_optimizer(job, [self.params[n] for n in self.names])
        self._load_optimizer_state(state)
        self._pending: list[str] = []  # parameters with a gradient waiting for the iteration's step
        # the allreduced vector is the gradient as is (fp32, averaged) unless clipping will scale it in place
        self._zero_copy = job.dtype == "float32" and job.reduction != "sum-then-divide" and job.clip_grad_norm is None
        self._grads: dict[str, torch.Tensor] = {}  # gradient buffers reused across iterations (when copying)
        self._numel = {p.name: p.numel for p in job.parameters}

    def _load_optimizer_state(self, state: Mapping[str, torch.Tensor]) -> None:
        for key, t in state.items():
            if not key.startswith(OPT_PREFIX):
                continue
            slot, name = key[len(OPT_PREFIX):].split(".", 1)
            if self.owned is not None and name in self.all_names and name not in self.owned:
                continue  # another part's
            if name not in self.params:
                raise JobError(f"initial state: optimizer tensor {key!r} names no parameter of the job")
            self.optim.state[self.params[name]][slot] = t.detach().clone()

    # ---- gradients in ---------------------------------------------------------
    def apply_bucket(self, bucket: Bucket, values: np.ndarray) -> None:
        """Take one complete allreduced bucket; steps its parameters now unless clipping must wait."""
        grad = torch.from_numpy(np.ascontiguousarray(values))
        if self.job.dtype == "bfloat16":
            grad = grad.view(torch.bfloat16)
        offset = 0
        mine = []
        for name in bucket.params:
            p = self.params.get(name)
            if p is None:  # another part's parameter: its elements were never placed
                offset += self._numel[name]
                continue
            mine.append(name)
            piece = grad[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if self._zero_copy:
                p.grad = piece
                continue
            buf = self._grads.get(name)
            if buf is None:
                buf = self._grads[name] = torch.empty_like(p)
            buf.copy_(piece)  # bf16 -> fp32 exactly
            if self.job.reduction == "sum-then-divide":
                buf.div_(self.job.nranks)
            p.grad = buf
        if self.job.clip_grad_norm is None:
            if mine:
                self._step(mine)
        else:
            self._pending += mine

    def finish_iteration(self) -> None:
        """After the iteration's last bucket: clip (if the job clips) and step what waited; advance the step."""
        if self.job.clip_grad_norm is not None:
            if sorted(self._pending) != sorted(self.names):
                raise JobError(f"iteration incomplete: {len(self._pending)} of {len(self.names)} parameters have gradients")
            ordered = [self.params[n] for n in self.names]
            if self.owned is None:
                torch.nn.utils.clip_grad_norm_(ordered, self.job.clip_grad_norm)
            else:
                self._clip_with_all_parts(ordered)
            self._step(self.names)
            self._pending = []
        self.step += 1

    def _clip_with_all_parts(self, ordered: list[torch.Tensor]) -> None:
        """``clip_grad_norm_``'s computation split across the parts: per-parameter norms here (the same foreach
        norm, which is per tensor), the total over every part's in ``model.parameters()`` order."""
        exchange = self.norms
        if exchange is None:
            raise JobError("a partitioned replica that clips needs a NormExchange")
        mine = torch._foreach_norm([p.grad for p in ordered], 2.0) if ordered else []
        exchange.publish(self.step + 1, {n: float(v) for n, v in zip(self.names, mine)})
        every = exchange.gather(self.step + 1)
        if every is None or set(every) != set(self.all_names):
            self._pending = []
            for p in ordered:
                p.grad = None
            raise PartNormsMissingError(f"step {self.step + 1}: the other parts' gradient norms did not arrive within "
                                        f"{exchange.wait_s} s (exchange {exchange.directory}); clipping needs them")
        total = torch.linalg.vector_norm(torch.stack([torch.tensor(every[n], dtype=torch.float32)
                                                      for n in self.all_names]), 2.0)
        torch.nn.utils.clip_grads_with_norm_(ordered, self.job.clip_grad_norm, total)

    def _step(self, names: list[str]) -> None:
        """One optimizer step over the parameters that hold a gradient (exactly ``names``)."""
        self.optim.step()
        for name in names:
            self.params[name].grad = None

    # ---- state out / in -------------------------------------------------------
    def optimizer_state_dict(self) -> dict:
        return self.optim.state_dict()

    def snapshot(self, run: str) -> Snapshot:
        """The replica as a Snapshot (zero-copy views) under the canonical names; a part's describes the whole
        state and holds data for its own tensors only."""
        snap = snapshot_from_torch(run, self.step, dict(self.params), self.optimizer_state_dict(),
                                   param_names=self.names, rng=False, source="mirror",
                                   extra={"mirror_job": self.job.name})
        return snap if self.owned is None else self._whole_layout(snap)

    def _whole_layout(self, snap: Snapshot) -> Snapshot:
        """Every part computes the same layout and scalars from the job: parameters in job order, then each
        parameter's optimizer slots (shaped like this part's first parameter's: every parameter has the same)."""
        first = self.names[0]
        slots = [(s.name[len(OPT_PREFIX):].split(".", 1)[0], s) for s in snap.layout.tensors
                 if s.name.startswith(OPT_PREFIX) and s.name.split(".", 2)[2] == first]
        shapes = {p.name: p.shape for p in self.job.parameters}
        specs = [TensorSpec(n, "float32", shapes[n], "replicated") for n in self.all_names]
        for n in self.all_names:
            for slot, t in slots:
                shape = shapes[n] if t.shape == shapes[first] else t.shape
                specs.append(TensorSpec(f"{OPT_PREFIX}{slot}.{n}", t.dtype, shape, t.role))
        layout = StateLayout(tuple(specs), snap.layout.source, snap.layout.buckets)
        opt = snap.scalars.optimizer
        if opt is not None:
            loose = opt.get("state", {}).get(first)
            opt = {**opt, "param_groups": [{**g, "params": list(self.all_names)} for g in opt["param_groups"]],
                   "state": {n: loose for n in self.all_names} if loose is not None else {}}
        scalars = dataclasses.replace(snap.scalars, optimizer=opt)
        data = {Shard.whole(layout.spec(s.tensor)): a for s, a in snap.data.items()}
        return Snapshot(snap.run, snap.step, layout, data, scalars, source=snap.source)

    def state(self) -> dict[str, torch.Tensor]:
        """Canonical name -> tensor (parameters and optimizer state), as the truth files hold them."""
        out = dict(self.params)
        for name in self.names:
            for slot, value in self.optim.state.get(self.params[name], {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"{OPT_PREFIX}{slot}.{name}"] = value
        return out
