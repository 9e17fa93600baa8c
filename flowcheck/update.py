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
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import torch

from flowcheck.capture.mirror.job import Bucket, Job
from flowcheck.errors import JobError
from flowcheck.state import Snapshot
from flowcheck.torch.state import OPT_PREFIX, snapshot_from_torch

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

    def __init__(self, job: Job, state: Mapping[str, torch.Tensor], step: int) -> None:
        if not job.trains:
            raise JobError("the job lacks what updating needs: parameters, bucket contents (parameter names) "
                           "and optimizer; decode works without them, capture does not")
        self.job = job
        self.step = step
        self.names = [p.name for p in job.parameters]
        self.params: dict[str, torch.Tensor] = {}
        for p in job.parameters:
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

    def _load_optimizer_state(self, state: Mapping[str, torch.Tensor]) -> None:
        for key, t in state.items():
            if not key.startswith(OPT_PREFIX):
                continue
            slot, name = key[len(OPT_PREFIX):].split(".", 1)
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
        for name in bucket.params:
            p = self.params[name]
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
            self._step(bucket.params)
        else:
            self._pending += bucket.params

    def finish_iteration(self) -> None:
        """After the iteration's last bucket: clip (if the job clips) and step what waited; advance the step."""
        if self.job.clip_grad_norm is not None:
            if sorted(self._pending) != sorted(self.names):
                raise JobError(f"iteration incomplete: {len(self._pending)} of {len(self.names)} parameters have gradients")
            ordered = [self.params[n] for n in self.names]
            torch.nn.utils.clip_grad_norm_(ordered, self.job.clip_grad_norm)
            self._step(self.names)
            self._pending = []
        self.step += 1

    def _step(self, names: list[str]) -> None:
        """One optimizer step over the parameters that hold a gradient (exactly ``names``)."""
        self.optim.step()
        for name in names:
            self.params[name].grad = None

    # ---- state out / in -------------------------------------------------------
    def optimizer_state_dict(self) -> dict:
        return self.optim.state_dict()

    def snapshot(self, run: str) -> Snapshot:
        """The replica as a Snapshot (zero-copy views) under the canonical names."""
        return snapshot_from_torch(run, self.step, dict(self.params), self.optimizer_state_dict(),
                                   param_names=self.names, rng=False, source="mirror",
                                   extra={"mirror_job": self.job.name})

    def state(self) -> dict[str, torch.Tensor]:
        """Canonical name -> tensor (parameters and optimizer state), as the truth files hold them."""
        out = dict(self.params)
        for name in self.names:
            for slot, value in self.optim.state.get(self.params[name], {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"{OPT_PREFIX}{slot}.{name}"] = value
        return out
