"""The simulator: a CPU data-parallel trainer whose ring allreduce becomes mirrored RoCEv2 traffic, plus truth.

The names below load on first use: importing the package (as the CLI does to register ``flowcheck
simulate``) must not import torch, or every command — ``flowcheck serve`` too — would pay for it in
start-up time and memory.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowcheck.simulate.options import SimOptions
    from flowcheck.simulate.run import SimResult, simulate

__all__ = ["SimOptions", "SimResult", "simulate"]


def __getattr__(name: str) -> Any:
    if name == "SimOptions":
        from flowcheck.simulate.options import SimOptions

        return SimOptions
    if name in ("SimResult", "simulate"):
        from flowcheck.simulate import run

        return getattr(run, name)
    raise AttributeError(f"module 'flowcheck.simulate' has no attribute {name!r}")
