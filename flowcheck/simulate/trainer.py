"""The simulator's data-parallel trainer: N virtual DP ranks sharing one model, DDP-style buckets.

Per iteration every rank computes its gradient on its own micro-batch (sequentially, one model
instance: the ranks share parameters), gradients are packed into buckets in reverse parameter
order (one bucket for the whole model in iteration 1, as DDP does before it rebuilds its
buckets), each rank's bucket is divided by N (DDP's averaging), the buckets are all-reduced by
the caller's function, and the reduced values become ``.grad`` before global-norm clipping and a
torch optimizer step.  The allreduce is a parameter so the same trainer runs with and without a
wire: that is how the simulator's truth is checked.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from flowcheck.capture.mirror.job import OptimizerSpec
from flowcheck.errors import ConfigError
from flowcheck.simulate.model import GPT, MODELS, synthetic_batch
from flowcheck.torch.state import snapshot_from_torch

# Hyper-parameters per optimizer kind (recorded in the job so the decoder builds the same optimizer).
OPTIMIZER_SPECS = {
    "sgd": OptimizerSpec("sgd", lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": OptimizerSpec("adam", lr=1e-3),
    "adamw": OptimizerSpec("adamw", lr=1e-3, weight_decay=0.01),
}

# bucket capacity (KiB) when none is given: tiny gets >= 3 buckets, small a handful
DEFAULT_BUCKET_KB = {"tiny": 32, "small": 512}

Plan = tuple[tuple[str, ...], ...]  # buckets in allreduce order, each its parameter names in flat order
AllReduce = Callable[[int, Sequence[np.ndarray]], np.ndarray]  # (bucket index, per-rank inputs) -> final


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one intra-op thread: the bytes do not depend on the machine's core count, and
    models this small lose far more to OpenMP threads spinning against other processes than they gain."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def build_optimizer(spec: OptimizerSpec, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer a spec describes (``foreach=False``: the single-tensor path, on any device)."""
    if spec.kind == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, dampening=spec.dampening,
                               nesterov=spec.nesterov, weight_decay=spec.weight_decay, maximize=spec.maximize,
                               foreach=False)
    cls = torch.optim.Adam if spec.kind == "adam" else torch.optim.AdamW
    return cls(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
               amsgrad=spec.amsgrad, maximize=spec.maximize, foreach=False)


def bucket_plan(params: Sequence[tuple[str, int]], cap_bytes: int, itemsize: int = 4) -> Plan:
    """DDP's buckets: parameters in reverse order, a bucket closes once it holds >= cap_bytes (never splits one)."""
    buckets: list[tuple[str, ...]] = []
    current: list[str] = []
    size = 0
    for name, numel in reversed(params):
        current.append(name)
        size += numel * itemsize
        if size >= cap_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
    if current:
        buckets.append(tuple(current))
    return tuple(buckets)


@dataclass(frozen=True)
class TrainConfig:
    model: str = "tiny"
    dp: int = 2
    optimizer: str = "adam"
    clip: float | None = 1.0
    bucket_kb: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"--model: expected one of {sorted(MODELS)}, found {self.model!r}")
        if self.optimizer not in OPTIMIZER_SPECS:
            raise ConfigError(f"--optimizer: expected one of {sorted(OPTIMIZER_SPECS)}, found {self.optimizer!r}")


class Trainer:
    """One model and optimizer standing for N data-parallel ranks."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.gpt = MODELS[cfg.model]
        self.model = GPT(self.gpt, cfg.seed)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.params = dict(self.model.named_parameters())
        self.spec = OPTIMIZER_SPECS[cfg.optimizer]
        self.optimizer = build_optimizer(self.spec, list(self.params.values()))
        kb = cfg.bucket_kb or DEFAULT_BUCKET_KB[cfg.model]
        self.first_plan: Plan = (tuple(reversed(self.names)),)
        self.steady_plan: Plan = bucket_plan([(n, p.numel()) for n, p in self.params.items()], kb * 1024)

    def plan(self, iteration: int) -> Plan:
        return self.first_plan if iteration == 1 else self.steady_plan

    def rank_buckets(self, iteration: int) -> tuple[list[float], list[list[np.ndarray]]]:
        """(loss per rank, inputs[bucket][rank]): each rank's gradient packed per bucket and divided by N."""
        plan = self.plan(iteration)
        losses: list[float] = []
        inputs: list[list[np.ndarray]] = [[] for _ in plan]
        with one_thread():
            for rank in range(self.cfg.dp):
                losses.append(self._backward(iteration, rank))
                for b, names in enumerate(plan):
                    flat = torch.cat([self.params[n].grad.reshape(-1) for n in names])
                    flat.div_(self.cfg.dp)  # DDP's default hook averages before the allreduce
                    inputs[b].append(flat.numpy())
        return losses, inputs

    def _backward(self, iteration: int, rank: int) -> float:
        self.model.zero_grad(set_to_none=True)
        x, y = synthetic_batch(self.gpt, self.cfg.seed, iteration, rank)
        loss = self.model(x, y)
        loss.backward()
        return float(loss.item())

    def apply(self, iteration: int, finals: Sequence[np.ndarray]) -> None:
        """Reduced buckets -> ``.grad``, clip by global norm, optimizer step."""
        for names, final in zip(self.plan(iteration), finals, strict=True):
            off = 0
            for n in names:
                p = self.params[n]
                p.grad = torch.from_numpy(np.array(final[off:off + p.numel()])).view(p.shape)
                off += p.numel()
        with one_thread():
            if self.cfg.clip is not None:
                torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.cfg.clip)
            self.optimizer.step()

    def iterate(self, iteration: int, allreduce: AllReduce) -> list[float]:
        """One training iteration; ``allreduce`` is called once per bucket, in allreduce order."""
        losses, inputs = self.rank_buckets(iteration)
        finals = [allreduce(b, per_rank) for b, per_rank in enumerate(inputs)]
        self.apply(iteration, finals)
        return losses

    def state(self) -> dict[str, np.ndarray]:
        """Parameters and optimizer state under canonical names (copies)."""
        snap = snapshot_from_torch("simulate", 0, self.model, self.optimizer, rng=False)
        return {shard.tensor: np.array(arr) for shard, arr in snap.data.items()}
