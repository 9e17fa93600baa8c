"""A trainer process for the kill tests: trains a deterministic model and pushes every step, logging as it goes.

Each step it appends ``pushing <step> <digest>`` (the digest of the state it is about to push) before ``save()`` and
``acked <step>`` once the node acknowledged it, each line flushed to the OS at once, so a SIGKILL at any instant
leaves a log that says what this rank had been told.  Usage:
    python -m tests.capture.push_kill_trainer --node tcp://HOST:PORT --log FILE --base STEP [--transport shm|tcp]
                                              [--rank R --world W --port P]     (from the repository root)
"""
from __future__ import annotations

import argparse
import os

import torch

from flowcheck.torch.checkpointer import Checkpointer
from tests.helpers import state_digest, trainer_state

WIDTH, LAYERS = 512, 4  # 1M parameters, a 12.6 MB state with AdamW


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--node", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--base", type=int, required=True)
    p.add_argument("--transport", default="shm")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    model, opt = model_and_optimizer()
    train = model
    if a.world > 1:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank,
                                             world_size=a.world)
        train = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(train.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + a.rank)
    ck = Checkpointer(model, opt, node=a.node, run="gpt", transport=a.transport, timeout_s=60)
    fd = os.open(a.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    for i in range(10**6):
        step = a.base + i
        train(torch.randn(8, WIDTH, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        os.write(fd, f"pushing {step} {state_digest(trainer_state(model, opt))}\n".encode())
        ck.save(step)
        if ck.flush(60):
            os.write(fd, f"acked {step}\n".encode())


if __name__ == "__main__":
    main()
