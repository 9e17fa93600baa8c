"""The simulator: a CPU data-parallel trainer whose ring allreduce becomes mirrored RoCEv2 traffic, plus truth."""
from __future__ import annotations

from flowcheck.simulate.options import SimOptions
from flowcheck.simulate.run import SimResult, simulate

__all__ = ["SimOptions", "SimResult", "simulate"]
