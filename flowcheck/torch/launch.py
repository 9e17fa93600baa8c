"""The launch a trainer's ranks push under: one id shared by every rank of one launch of the job.

The node takes pushes only from the newest launch of a run (flowcheck/capture/push/launch.py), so a requeued job's
old copy still running beside it cannot tear a step.  Where the id comes from, first that applies:
1. ``$FLOWCHECK_LAUNCH`` (the launcher sets one value for all ranks of a launch, a new one per launch);
2. a single-sender trainer: a fresh id of its own;
3. torch.distributed, when initialised with more than one rank: rank 0 makes a fresh id and broadcasts it (a
   collective at Checkpointer construction, which every rank of a multi-sender job makes).
A multi-rank trainer with neither (ranks given their coordinates by hand, no process group) pushes no launch: its
ranks could not agree on one and must not refuse each other; the node then only keeps each sender place of a step
to one connection, and this is logged once.
"""
from __future__ import annotations

import logging
import os
import secrets
import time

import torch

from flowcheck.capture.push.launch import Launch
from flowcheck.torch.coords import Coordinates

log = logging.getLogger(__name__)

LAUNCH_ENV = "FLOWCHECK_LAUNCH"


def agree_launch(coords: Coordinates) -> Launch | None:
    """This rank's launch (see the module docstring); None when the ranks cannot agree on one."""
    named = os.environ.get(LAUNCH_ENV, "").strip()
    if named:
        return Launch(named[:200], time.time())
    if coords.senders == 1:
        return _fresh()
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [_fresh().to_json() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return Launch.from_json(box[0])
    log.warning("checkpoint push: %d senders and no launch id they share (no torch.distributed process group, "
                "$%s unset): the node cannot tell this job from an older copy of it still pushing; set $%s to one "
                "value per launch on every rank", coords.senders, LAUNCH_ENV, LAUNCH_ENV)
    return None


def _fresh() -> Launch:
    return Launch(secrets.token_hex(8), time.time())
