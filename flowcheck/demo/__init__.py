"""`flowcheck demo`, the main job: push half (train, kill, resume), checks (audit, export, restore), mirror half.

``prepare`` checks the options and writes the merged config (setup.py); ``run_push`` starts a node
and two trainer processes (push.py, trainer.py, model.py); ``verify`` checks what they left —
resumed losses, audit, export, Megatron restores at TP=2/PP=2 in both formats read back (checks.py,
megatron.py, and mcore.py when megatron-core is installed); ``run_mirror`` rebuilds a simulated
job's state from mirrored frames (mirror.py).  Each check comes back as a ``Check`` with its
equivalent ``flowcheck`` command, and ``DemoSummary.verdict`` is the line that ends the demo.  The
CLI (flowcheck/cli/demo.py) only prints.
"""
from __future__ import annotations

from flowcheck.demo.checks import Check, DemoSummary, command, verify
from flowcheck.demo.mirror import run_mirror
from flowcheck.demo.push import PushResult, prepare, run_push
from flowcheck.demo.setup import DemoOptions, demo_config, prepare_workdir

__all__ = ["Check", "DemoOptions", "DemoSummary", "PushResult", "command", "demo_config", "prepare",
           "prepare_workdir", "run_mirror", "run_push", "verify"]
