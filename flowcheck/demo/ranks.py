"""Fork N gloo ranks from one process that imported megatron-core once, and reap them: the demo's megatron-core
load and the test harness's megatron jobs share this launcher.

Forking after the import saves ~10 s per rank over spawning fresh interpreters.  A rank that raises writes its
traceback to ``<error_dir>/error_<rank>.txt``; the first failure kills the other ranks, which would otherwise wait
forever in a collective.  Ranks leave through ``exit_now``: unloading torch and megatron takes seconds.  Ranks of
a gloo group leave it through ``leave_group``, which never tears gloo down (its teardown sometimes aborts).
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable

ERROR_PREFIX = "error_"


def run_ranks(world: int, rank_main: Callable[[int], None], error_dir: str) -> int:
    """Fork ``world`` children running ``rank_main(rank)``; 0 when every rank succeeded, else 1."""
    pids = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _child(rank_main, rank, error_dir)
        pids[pid] = rank
    failed = False
    while pids:
        pid, status = os.wait()
        pids.pop(pid)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = True
            time.sleep(1.0)  # a sibling that failed for the same reason writes its traceback too
            for other in pids:
                os.kill(other, signal.SIGKILL)
    return 1 if failed else 0


def first_error(error_dir: str) -> str | None:
    """The last line of the lowest-numbered rank's traceback, if any rank failed."""
    names = sorted(n for n in os.listdir(error_dir) if n.startswith(ERROR_PREFIX))
    if not names:
        return None
    with open(os.path.join(error_dir, names[0]), encoding="utf-8") as f:
        lines = [ln for ln in f.read().strip().splitlines() if ln.strip()]
    return lines[-1] if lines else names[0]


def _child(rank_main: Callable[[int], None], rank: int, error_dir: str) -> None:
    code = 0
    try:
        rank_main(rank)
    except BaseException:  # noqa: BLE001 - whatever it is, the parent reports it
        with open(os.path.join(error_dir, f"{ERROR_PREFIX}{rank}.txt"), "w", encoding="utf-8") as f:
            f.write(traceback.format_exc())
        code = 1
    exit_now(code)


def exit_now(code: int) -> None:
    """Leave without interpreter teardown: unloading torch and megatron takes seconds."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_group(timeout_s: float = 120.0) -> None:
    """Leave the default gloo group and the process, without tearing either down, once every rank is done with it.

    Gloo's teardown (``destroy_process_group``, or the interpreter's exit) aborted a rank with "terminate called
    without an active exception" in about 1 of 40 runs of 4 CPU ranks, after all of the rank's work was done and
    written.  So no rank destroys anything: each counts itself out on the group's store after its last collective,
    waits until all have (then no gloo message is still in flight to anyone), and leaves with ``exit_now(0)``.  Rank
    0 hosts the store, so it leaves last, once every other rank has seen the count.
    """
    import torch.distributed as dist

    store, rank, world = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    deadline = time.monotonic() + timeout_s

    def wait_for(key: str, count: int) -> None:
        while store.add(key, 0) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: {key} reached {store.add(key, 0)} of {count} in {timeout_s:.0f} s")
            time.sleep(0.01)

    store.add("flowcheck/left", 1)
    wait_for("flowcheck/left", world)
    if rank != 0:
        store.add("flowcheck/seen", 1)
        exit_now(0)
    wait_for("flowcheck/seen", world - 1)
    exit_now(0)
