"""Fork N gloo ranks from one process that imported megatron-core once, and reap them: the demo's megatron-core
load and the test harness's megatron jobs share this launcher.

Forking after the import saves ~10 s per rank over spawning fresh interpreters.  A rank that raises writes its
traceback to ``<error_dir>/error_<rank>.txt``; the first failure kills the other ranks, which would otherwise wait
forever in a collective.  Ranks leave through ``exit_now``: unloading torch and megatron takes seconds.
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
