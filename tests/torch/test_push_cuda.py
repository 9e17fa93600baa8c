"""A CUDA trainer's push: ordered after the trainer's own stream by an event, bit-exact while training goes on.

Runs only where CUDA is present (skips cleanly elsewhere).  The trainer runs on a non-default stream and queues a
long kernel before its optimizer step, so the step's results land well after ``save()`` returned on the host: a copy
not ordered after that stream would read the parameters from before the step.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flowcheck.torch.checkpointer import Checkpointer
from flowcheck.torch.device_copy import DeviceCopier
from tests.capture.test_push_node import _ram_state as _held

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time ahead of the optimizer step


def _trainer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def _push_on_a_side_stream(receiver_url: str, staging) -> tuple[dict[str, np.ndarray], Checkpointer]:
    """Train on a non-default stream; save right after a late optimizer step; keep training.  Returns the state as
    of the save (cloned on that stream) and the Checkpointer (flushed)."""
    model, opt = _trainer()
    ck = Checkpointer(model, opt, node=receiver_url, run="gpt", transport="shm", gpu_staging=staging, timeout_s=60)
    stream = torch.cuda.Stream()
    x = torch.randn(64, 256, device="cuda")
    with torch.cuda.stream(stream):
        for step in range(1, 4):
            model(x).pow(2).mean().backward()
            torch.cuda._sleep(SLEEP_CYCLES)  # the step below finishes long after save() returns
            opt.step()
            opt.zero_grad()
            if step == 3:
                ck.save(step)
                want = {k: v.detach().clone() for k, v in model.state_dict().items()}
                want.update({f"optimizer.{slot}.{n}": opt.state[p][slot].clone()
                             for n, p in model.named_parameters() for slot in ("exp_avg", "exp_avg_sq")})
        for _ in range(2):  # training goes on: the hook orders its optimizer steps after the copy
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert ck.flush(60), ck.stats.last_error
    torch.cuda.synchronize()
    return {k: v.cpu().numpy() for k, v in want.items()}, ck


@pytest.fixture
def receiver(tmp_path, monkeypatch):
    from flowcheck.node.receiver import PushReceiver
    from flowcheck.store import open_store
    from tests.capture.conftest import NodeProcess

    monkeypatch.delenv("FLOWCHECK_NODE_TOKEN", raising=False)
    store = open_store(NodeProcess(str(tmp_path)).config)
    r = PushReceiver(store, part_timeout_s=30).start()
    yield store, f"tcp://127.0.0.1:{r.address[1]}"
    r.close()


@pytest.mark.parametrize("staging", ["auto", 0])
def test_a_step_pushed_from_a_side_stream_is_bit_exact(receiver, staging):
    store, url = receiver
    want, ck = _push_on_a_side_stream(url, staging)
    assert ck.stats.staged is (staging == "auto")
    got = _held(store)
    for name, arr in want.items():
        assert np.array_equal(got[name], arr), name
    ck.close()


def test_without_the_event_the_copy_reads_the_parameters_too_early(receiver, monkeypatch):
    """The check above can fail: with the ordering event removed, the copy runs before the late optimizer step."""
    store, url = receiver
    monkeypatch.setattr(DeviceCopier, "mark", lambda self: [])
    want, ck = _push_on_a_side_stream(url, "auto")
    got = _held(store)
    assert any(not np.array_equal(got[name], arr) for name, arr in want.items())
    ck.close()
